"""The K policies on their own (no engine): the +2/-1 schedule, goodput's choice against alpha
and the cost table (live ratios, stale ratios, rooms), alpha estimates, the engine's check of a
policy's answer, and `make_policy` with options."""

import numpy as np
import pytest

from jaxspec.engine import FixedK
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.makespan import expected_tokens
from jaxspec.engine.k_policy import ScheduleK, make_policy
from jaxspec.engine.live_costs import nondecreasing
from jaxspec.engine.speculation import _checked


def test_schedule_steps_and_bounds():
  policy = ScheduleK(initial=2)
  policy.setup(6)
  assert policy.choose(['a']) == (2, [2])
  policy.observe('a', 2, 2, 2.0, 2.0)                         # all accepted: +2
  policy.observe('b', 2, 1, 1.0, 2.0)                         # one rejected: -1
  assert policy.choose(['a', 'b']) == (4, [4, 1])             # batch K = max, rows capped
  for _ in range(3):
    policy.observe('a', policy.k_for('a'), policy.k_for('a'), 0, 0)
    policy.observe('b', policy.k_for('b'), 0, 0.0, 1.0)
  assert policy.k_for('a') == 6 and policy.k_for('b') == 1    # clipped to [min_k, K_max]
  policy.forget('a')
  assert policy.k_for('a') == 2
  with pytest.raises(ValueError, match='min_k must be an int >= 1, got 0'):
    ScheduleK(min_k=0)
  with pytest.raises(ValueError, match='initial=9 outside'):
    ScheduleK(initial=9).setup(4)


def _goodput(alpha, costs):
  policy = GoodputK(tracker=AlphaTracker(prior=alpha), costs=costs)
  policy.setup(max(costs))
  return policy.choose(['a', 'b'])[0]


def test_goodput_follows_alpha_and_the_cost_table():
  flat = {k: 1.0 for k in range(5)}
  assert _goodput(0.0, flat) == 0 and _goodput(0.005, flat) == 0
  assert _goodput(1.0, flat) == 4 and _goodput(0.95, flat) == 4
  # A rising cost table: the argmax of (Σ E) / t(K), computed independently here.
  costs = {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2}
  for alpha in (0.3, 0.6, 0.8, 0.9):
    best = max(costs, key=lambda k: (1 - alpha ** (k + 1)) / (1 - alpha) / costs[k])
    assert _goodput(alpha, costs) == best
  assert [_goodput(a, costs) for a in (0.3, 0.9)] == [0, 4]
  # Host work per round (the same at every K) makes a K > 0 round relatively cheaper.
  policy = GoodputK(tracker=AlphaTracker(prior=0.6), costs={0: 1.0, 1: 2.0},
                    cold_rounds=0, switch_rounds=0)
  policy.setup(1)
  assert policy.choose(['a'])[0] == 0                        # 1 / 1 > 1.6 / 2
  policy.round_timing(0, 1.0, 10.0)
  assert policy.choose(['a'])[0] == 1                        # 1 / 11 < 1.6 / 12
  # Live rounds at K = 1 costing more than the start-up table said move the choice back.
  policy.round_timing(0, 1.0, 10.0)
  for _ in range(30):
    policy.round_timing(1, 20.0, 10.0)
  assert policy.costs[1] > 15 and policy.choose(['a'])[0] == 0
  # Live / start-up ratios: live K = 0 rounds at twice the start-up time make every K twice as
  # dear until K >= 1 rounds have run; then all K >= 1 follow their group's median ratio, K = 0's
  # filling in for the first PRIOR_ROUNDS = 3, so one slow round at K >= 1 (the first call of a
  # run is ~2x) does not price K >= 1 out (a K not chosen would never be measured again).
  policy = GoodputK(costs={0: 1.0, 1: 1.5, 2: 2.0}, cold_rounds=0, switch_rounds=0)
  policy.setup(2)
  policy.round_timing(0, 3.0, 0.0)                  # one slow K = 0 round: ratio 3, [3, 1, 1]
  assert policy.costs == pytest.approx({0: 1.0, 1: 1.5, 2: 2.0})
  for _ in range(4):
    policy.round_timing(0, 2.0, 0.0)
  assert policy.costs == pytest.approx({0: 2.0, 1: 3.0, 2: 4.0})
  policy.round_timing(2, 6.0, 0.0)                  # ratio 3 for K >= 1: [3, 2, 2]
  assert policy.costs == pytest.approx({0: 2.0, 1: 3.0, 2: 4.0})
  policy.round_timing(2, 6.0, 0.0)                  # [3, 3, 2]
  assert policy.costs == pytest.approx({0: 2.0, 1: 4.5, 2: 6.0})
  # K >= 1 ratios left unrefreshed for STALE_ROUNDS rounds at K = 0 are dropped; K = 0's ratio
  # times the square root of their quotient to it (3 / 2) stands in.
  for _ in range(policy.STALE_ROUNDS - 1):
    policy.round_timing(0, 2.0, 0.0)
  assert policy.costs[2] == pytest.approx(6.0)
  policy.round_timing(0, 2.0, 0.0)
  q = 1.5 ** 0.5
  assert policy.costs == pytest.approx({0: 2.0, 1: 3.0 * q, 2: 4.0 * q})
  for _ in range(3 * policy.STALE_ROUNDS):          # no K >= 1 round: nothing more to drop
    policy.round_timing(0, 2.0, 0.0)
  assert policy.costs == pytest.approx({0: 2.0, 1: 3.0 * q, 2: 4.0 * q})
  policy.round_timing(2, 6.0, 0.0)
  policy.round_timing(2, 6.0, 0.0)
  policy.round_timing(1, 15.0, 0.0)                                 # one slow round: ratio 10
  assert policy.costs == pytest.approx({0: 2.0, 1: 4.5, 2: 6.0})
  # A measured dip (noise) is pooled away: t(K) is made non-decreasing before the argmax.
  assert nondecreasing([1.0, 2.0, 1.0, 3.0]) == [1.0, 1.5, 1.5, 3.0]
  noisy = {0: 1.0, 1: 3.0, 2: 3.0, 3: 3.0, 4: 1.0}              # K = 4 "cheap" by a fluke
  assert _goodput(0.3, noisy) == 0
  assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4
  # A round emits at most `room` tokens: near the end of requests a large K gains nothing.
  policy = GoodputK(tracker=AlphaTracker(prior=0.9), costs={0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6})
  policy.setup(3)
  assert policy.choose(['a', 'b'])[0] == 3
  policy.rooms = [2, 2]                                      # K = 1 emits both; more is waste
  assert policy.choose(['a', 'b'])[0] == 1
  assert policy.goodput([0.9, 0.9], 3, [2, 2]) == pytest.approx(2 * 1.9 / 1.6)


def test_goodput_alpha_recovers_after_k0_rounds():
  policy = GoodputK(tracker=AlphaTracker(prior_trials=1.0),
                    costs={k: 1.0 + 0.1 * k for k in range(4)})
  policy.setup(3)
  for _ in range(10):                                        # K = 3 rounds, all rejected
    policy.observe('a', 3, 0, 0.0, 1.0)
  assert policy.choose(['a'])[0] == 0
  chosen = [0]
  while chosen[-1] != 3:                                     # K = 0 rounds, Σ min(p, q) = 0.9
    policy.observe('a', 0, 0, 0.9, 1.0)
    chosen.append(policy.choose(['a'])[0])
    assert len(chosen) < 20
  assert chosen == sorted(chosen) and policy.tracker.alpha('a') > 0.5
  # A new request starts at the global estimate; finishing forgets the request's own.
  assert policy.tracker.alpha('new') == pytest.approx(policy.tracker.global_alpha)


def test_alpha_tracker_global_estimate_has_a_prior_and_decays_per_round():
  tracker = AlphaTracker(decay=0.8, prior=0.5, prior_trials=1.0)
  tracker.observe('a', 0.0, 1.0)                             # one unlucky first round
  assert tracker.global_alpha == pytest.approx(0.25)         # (0 + 1 x 0.5) / (1 + 1)
  # 64 requests: the global sums decay about once per round of all of them, so eight
  # rejections after a round in which all 64 accepted do not drag it below 0.8.
  tracker = AlphaTracker(decay=0.8, prior=0.5, prior_trials=0.0)
  for r in range(64):
    tracker.observe(r, 1.0, 1.0)
  for r in range(8):
    tracker.observe(r, 0.0, 1.0)
  assert 0.8 < tracker.global_alpha < 1.0


def test_a_policys_choice_is_checked_alike_as_plain_or_numpy_ints():
  """The engine's check of a policy's (K, caps): plain ints pass as they are, numpy ints as
  ints, and a bool, a cap above K, a missing cap or a K the policy did not declare are refused
  either way."""
  policy = FixedK()
  policy.setup(4)                                      # candidates (4,)
  assert _checked(policy, 4, 2, 4, [4, 3]) == (4, [4, 3])
  out = _checked(policy, 4, 2, np.int64(4), (np.int32(4), 2))
  assert out == (4, [4, 2]) and all(type(x) is int for x in (out[0], *out[1]))
  same = _checked(policy, 4, 2, 4, (4, 0))                # a tuple of plain ints: a list back
  assert same == (4, [4, 0]) and type(same[1]) is list
  for k, caps in ((True, [1, 1]), (4, [True, 0]), (4, [5, 0]), (4, [4]), (np.int64(4), [True, 0]),
                  (3, [3, 3]), (0, [0, 0])):              # K = 0 is not FixedK(4)'s
    with pytest.raises(ValueError, match='chose K='):
      _checked(policy, 4, 2, k, caps)
  goodput = GoodputK()                                 # K = 0 a candidate: the fast path
  goodput.setup(4)
  fast = _checked(goodput, 4, 2, 0, (0, 0))
  assert fast == (0, [0, 0]) and type(fast[1]) is list
  assert _checked(goodput, 4, 2, 0, (0, np.int32(0))) == (0, [0, 0])
  for k, caps in ((False, [0, 0]), (0, [0, False]), (0, [0, 0.0]), (0, [0]), (0, [0, 1]),
                  (0, [0, 0, 0]), (np.zeros(2, int), [0, 0])):
    with pytest.raises(ValueError, match='chose K='):
      _checked(goodput, 4, 2, k, caps)


def test_make_policy_builds_a_named_policy_with_its_options_and_names_a_bad_one():
  policy = make_policy('goodput', spec_confidence=True, spec_margin=0.1)
  assert isinstance(policy, GoodputK) and policy.wants_spec_confidences
  assert policy.spec_margin == 0.1 and not make_policy('goodput').wants_spec_confidences
  assert make_policy('schedule', initial=3).initial == 3
  assert make_policy(policy) is policy
  with pytest.raises(ValueError, match=r"'goodput' has no option 'spec_margn' \(known: .*"
                                       r"spec_margin"):
    make_policy('goodput', spec_margn=0.1)
  with pytest.raises(ValueError, match=r"'fixed' has no option 'k' \(known: none\)"):
    make_policy('fixed', k=2)
  with pytest.raises(ValueError, match=r"'goodput' with \{'window': 0\}: window must be"):
    make_policy('goodput', window=0)
  with pytest.raises(ValueError, match='need a policy name, not the instance'):
    make_policy(policy, spec_margin=0.2)
  with pytest.raises(ValueError, match="unknown k_policy 'bogus'"):
    make_policy('bogus')
  # Fixed at construction (each picks what the engine gathers or compiles for it).
  with pytest.raises(AttributeError):
    policy.wants_spec_confidences = False
