"""The goodput policy's two-position acceptance model: the first proposal of a round (α) and
each later one (β) are estimated apart, and E[tokens] and the makespan use both."""

import numpy as np
import pytest

from jaxspec.engine import makespan, speculation
from jaxspec.engine.acceptance import round_observation
from jaxspec.engine.drafters import Round
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.makespan import expected_tokens
from jaxspec.engine.request import Request, RequestMetrics


def test_round_observation_splits_the_first_proposal_from_the_later_ones():
  assert round_observation(3, 0) == (0.0, 1.0, 0.0, 0.0)     # first rejected: no later trial
  assert round_observation(3, 1) == (1.0, 1.0, 0.0, 1.0)     # second rejected
  assert round_observation(3, 2) == (1.0, 1.0, 1.0, 2.0)
  assert round_observation(3, 3) == (1.0, 1.0, 2.0, 2.0)     # all accepted: no rejected trial
  assert round_observation(1, 1) == (1.0, 1.0, 0.0, 0.0)
  assert round_observation(2, 5) == round_observation(2, 2)  # clipped to the cap


def test_tracker_keeps_first_and_later_acceptance_apart():
  tracker = AlphaTracker(prior=0.5, prior_trials=1.0, global_span=1.0)   # a fast global estimate
  # No later-proposal observation anywhere yet: β falls back to the global α.
  tracker.observe('a', 1.0, 1.0)
  assert tracker.later('a') == pytest.approx(tracker.global_alpha)
  assert tracker.later('new') == pytest.approx(tracker.global_alpha)
  for _ in range(30):                       # first always accepted, the second always rejected
    tracker.observe('a', *round_observation(4, 1))
  assert tracker.alpha('a') > 0.9 and tracker.later('a') < 0.1
  assert tracker.global_alpha > 0.9 and tracker.global_later < 0.2
  # A first-proposal-only observation (a K = 0 probe, a K = 1 round) sees no later proposal:
  # β's sums only decay, so a stale β drifts back to its prior instead of staying put.
  later, sums = tracker.later('a'), tracker._sums['a'][2:]
  tracker.observe('a', 0.0, 8.0)
  assert tracker.alpha('a') < 0.9
  assert tracker._sums['a'][2:] == pytest.approx([tracker.decay * v for v in sums])
  for _ in range(60):
    tracker.observe('a', 1.0, 1.0)
  assert tracker.later('a') > later + 0.5
  with pytest.raises(ValueError, match='prior_trials'):
    AlphaTracker(prior_trials=-1.0)
  with pytest.raises(ValueError, match='global_span'):
    AlphaTracker(global_span=0.5)


def test_one_requests_bad_tail_does_not_reset_the_global_alpha():
  """B = 1: requests run one after another, so the global estimate (the next request's start)
  decays per observation; with `global_span` it keeps ~span / (1 - decay) of them, and five
  rejected first proposals at the end of one request leave it near the workload's α, where
  with a span of 1 it fell to where K = 0 wins."""
  slow, fast = AlphaTracker(), AlphaTracker(global_span=1.0)
  for tracker in (slow, fast):
    for i in range(30):                      # α 0.75: three in four first proposals accepted
      tracker.observe('a', float(i % 4 != 0), 1.0)
    for _ in range(5):                       # the request's last five all rejected
      tracker.observe('a', 0.0, 1.0)
    tracker.forget('a')
  assert slow.alpha('next') > 0.55 and fast.alpha('next') < 0.4


def _enumerated(alpha, later, k):
  """Mean and variance of 1 + accepted proposals, walking the proposals one by one: the j-th
  is accepted with probability α (j = 0) or β, and a round stops at its first rejection."""
  probs, going = [], 1.0
  for j in range(k):
    q = alpha if j == 0 else later
    probs.append(going * (1 - q))          # exactly j accepted
    going *= q
  probs.append(going)                      # all k accepted
  mean = sum(p * (1 + n) for n, p in enumerate(probs))
  return mean, sum(p * (1 + n) ** 2 for n, p in enumerate(probs)) - mean ** 2


def test_a_nan_observation_is_refused_and_a_failed_row_is_not_observed():
  tracker = AlphaTracker(prior=0.5, prior_trials=1.0)
  with pytest.raises(ValueError, match='acceptance counts must be finite numbers, got '
                                       'successes=nan'):
    tracker.observe('a', float('nan'), 1.0)
  for counts, name in [((10, 2), 'successes=10, trials=2'), ((-5, 1), 'successes=-5, trials=1'),
                       ((1, 1, 3, 2), 'later_successes=3, later_trials=2'),
                       ((0, -1), 'successes=0, trials=-1')]:
    with pytest.raises(ValueError, match=f'0 <= .*successes <= .*trials, got {name}'):
      tracker.observe('a', *counts)           # an α of 3.0 or -0.2 would reach every request
  assert tracker.global_alpha == 0.5 and tracker.alpha('a') == 0.5
  tracker.observe('a', 1.0 + 1e-5, 1.0)       # a float32 Σ min(p, q) past its one trial
  # A row that drew INVALID_TOKEN (its target's logits were NaN) tells the policy nothing.
  class Seen:
    calls = []
    observe = lambda self, *args: self.calls.append(args)

  requests = [Request(i, [1], 4, (), b'', RequestMetrics(0.0)) for i in range(2)]
  window = np.array([[5, 6, 7], [5, -1, 0]], np.int32)
  result = Round(window, np.array([2, 1]), np.array([3, 2]), np.array([2, 2]),
                 np.array([1.0, np.nan]), np.array([1.0, 1.0]))
  speculation.observe_round(Seen(), list(enumerate(requests)), result, np.array([2, 2]))
  assert [call[0] for call in Seen.calls] == [0]


def test_token_moments_with_a_later_acceptance_match_enumeration():
  alphas, later = np.array([0.8, 0.3, 1.0]), np.array([0.5, 0.9, 0.7])
  mean, var = makespan.token_moments(alphas, 4, later)
  for i, (a, b) in enumerate(zip(alphas, later)):
    for k in range(5):
      m, v = _enumerated(a, b, k)
      assert mean[i, k] == pytest.approx(m) and var[i, k] == pytest.approx(v, abs=1e-12)
      assert mean[i, k] == pytest.approx(expected_tokens(a, k, b))
  same = makespan.token_moments(alphas, 4, alphas)
  np.testing.assert_allclose(same[0], makespan.token_moments(alphas, 4)[0])
  assert expected_tokens(0.8, 3, 0.5) == pytest.approx(1 + 0.8 * (1 + 0.5 + 0.25))
  assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(0.9, 0, 0.1) == 1.0


@pytest.mark.parametrize('accepted,expected', [(1, 1), (4, 4)])
def test_goodput_chooses_k_from_both_acceptances(accepted, expected):
  """A pair that accepts the first proposal and rarely a later one is worth K = 1; one whose
  later proposals follow an accepted first is worth a long K: the policy's choice is the argmax
  of Σ E / t computed here from its own two estimates."""
  costs = {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2}
  policy = GoodputK(costs=costs)
  policy.setup(4)
  for _ in range(20):
    policy.observe('a', 4, accepted, float(accepted), float(accepted + (accepted < 4)))
  a, b = policy.tracker.alpha('a'), policy.tracker.later('a')
  best = max(costs, key=lambda k: expected_tokens(a, k, b) / costs[k])
  assert policy.choose(['a'])[0] == best
  assert best == expected


def test_k0_hold_breaks_when_the_fitted_cost_ratio_moves():
  """The K = 0 hold keys on the live cost ratios the table is fitted with (prior rounds
  included): a second slow K = 0 round out of PRIOR_ROUNDS leaves the raw median where it was
  but doubles K = 0's fitted cost, so the held K = 0 must be scored again (K = 1 now wins)."""
  policy = GoodputK(costs={0: 1.0, 1: 1.2}, spec_margin=0.0, cold_rounds=0)
  policy.setup(1)
  for _ in range(3):
    policy.round_timing(1, 1.2, 0.0)           # K >= 1 live ratio 1
  policy.round_timing(0, 2.0, 0.0)             # one slow K = 0 round: padded median still 1
  policy.rooms, policy.queued = [100], 1
  policy.observe('a', 0, 0, 0.0, 8.0)          # α low: K = 0
  assert policy.choose(['a'])[0] == 0
  policy.round_timing(0, 2.0, 0.0)             # a second one: K = 0's fitted cost doubles
  assert policy.costs == pytest.approx({0: 1.6, 1: 1.6})
  scores = policy._scores(*policy._alphas(['a']))
  assert scores[1] > scores[0] * (1 + policy.margin)
  assert policy.choose(['a'])[0] == 1


@pytest.mark.parametrize('window', [1, 2])
def test_live_cost_ratios_count_with_a_window_below_the_prior_rounds(window):
  """A group never holds more than `window` live rounds, so the pseudo-rounds pad it up to
  min(PRIOR_ROUNDS, window): with window = 1 the live ratios must still scale d(K)."""
  policy = GoodputK(costs={0: 1.0, 1: 1.5}, window=window, cold_rounds=0)
  policy.setup(1)
  for _ in range(4):
    policy.round_timing(0, 2.0, 0.0)           # K = 0 live at twice its start-up time
  assert policy.costs == pytest.approx({0: 2.0, 1: 3.0})
  for _ in range(4):
    policy.round_timing(1, 6.0, 0.0)           # K >= 1 at four times
  assert policy.costs == pytest.approx({0: 2.0, 1: 6.0})


def test_a_stale_later_acceptance_does_not_trap_the_policy_at_k1():
  """K = 1 rounds never test β: after K = 3 rounds that always rejected the second proposal,
  K = 1 is right, but once its first proposals are always accepted the fading β lets a longer
  K be tried again."""
  policy = GoodputK(costs={k: 1.0 + 0.2 * k for k in range(5)}, spec_margin=0.0)
  policy.setup(4)
  for _ in range(20):
    policy.observe('a', 3, 1, 0.0, 1.0)         # K = 3: first accepted, second rejected
  assert policy.choose(['a'])[0] == 1
  chosen = []
  for _ in range(40):
    policy.observe('a', 1, 1, 0.0, 1.0)         # K = 1, always accepted
    chosen.append(policy.choose(['a'])[0])
  assert max(chosen) >= 2


def test_mismatched_later_or_rooms_raise_instead_of_truncating():
  """zip would silently score only the first requests: a β (or room) list of another length
  than the α list is a ValueError naming it."""
  policy = GoodputK(costs={0: 1.0, 1: 1.5})
  policy.setup(1)
  assert policy.goodput([0.5, 0.5], 1, None, [0.9, 0.9]) == pytest.approx(2 * 1.5 / 1.5)
  with pytest.raises(ValueError, match='later'):
    policy.goodput([0.5, 0.5], 1, None, [0.9])
  with pytest.raises(ValueError, match='rooms'):
    policy.goodput([0.5, 0.5], 1, [5])
  with pytest.raises(ValueError, match='later'):
    makespan.rounds_to_finish([0.5, 0.5], [30, 30], 2, [0.9])
  with pytest.raises(ValueError, match='later'):
    makespan.token_moments(np.array([0.5, 0.5]), 2, np.array([0.9]))


def test_makespan_caps_tokens_per_round_at_the_room():
  """A round emits at most a request's room: one token left takes one round at every K (not
  1 / E[T] < 1), so a last wave of requests with room 1 runs K = 0, not a speculative round
  that can accept nothing; the capped moments match enumeration at min(K, room - 1)."""
  assert makespan.rounds_to_finish([0.9] * 4, [1] * 4, 4) == pytest.approx([1.0] * 5)
  mean, var = makespan.token_moments(np.array([0.8, 0.6]), 4, np.array([0.5, 0.9]), [2, 3])
  for i, (a, b, room) in enumerate(((0.8, 0.5, 2), (0.6, 0.9, 3))):
    for k in range(5):
      m, v = _enumerated(a, b, min(k, room - 1))
      assert mean[i, k] == pytest.approx(m) and var[i, k] == pytest.approx(v, abs=1e-12)
  policy = GoodputK(tracker=AlphaTracker(prior=0.9, prior_trials=1e9),
                    costs={0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2})
  policy.setup(4)
  policy.rooms, policy.queued = [1] * 4, 0
  assert policy.choose(list('abcd'))[0] == 0


def test_conditional_acceptance_by_position():
  """scripts/acceptance_by_position.py: P(n >= j | n >= j - 1) from a round's accepted counts."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parent.parent / 'scripts' / 'acceptance_by_position.py'
  spec = importlib.util.spec_from_file_location('acceptance_by_position', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  result = module.conditional_acceptance([0, 1, 2, 2, 3], 3)
  assert [p for p, _ in result] == pytest.approx([4 / 5, 3 / 4, 1 / 3])
  assert [n for _, n in result] == [5, 4, 3]
  assert module.conditional_acceptance([0, 0], 2)[1] == (None, 0)   # nothing reached j = 2
  # The first proposal by the round before: request 1 rounds 2, 0, 1, 2; request 2 rounds 0, 2.
  split = module.after_round([[2, 0, 1, 2], [0, 2]], 2)
  assert split == {'first': (1, 2), 'after_all': (0, 1), 'after_reject': (3, 3)}
  with pytest.raises(ValueError, match='got 3'):
    module.after_round([[3]], 2)
  with pytest.raises(ValueError, match='k must be >= 1, got 0'):
    module.after_round([[0]], 0)


def test_a_k0_probe_tells_the_later_proposals_acceptance_too():
  """A probe's pairs of consecutive scored tokens (`KPolicy.observe_probe`) move β while the
  policy runs K = 0 (before, β stayed at its prior there: the global α); the first-proposal
  counts move α as a K = 0 `observe` does."""
  def tracker():
    return AlphaTracker(prior=0.5, prior_trials=1.0, global_span=1.0)
  probed, plain = GoodputK(tracker=tracker()), GoodputK(tracker=tracker())
  for policy in (probed, plain):
    policy.setup(4)
  for _ in range(20):         # first proposals accepted half the time, the next after one always
    probed.observe_probe('a', 4.0, 8.0, 3.0, 3.0)
    plain.observe('a', 0, 0, 4.0, 8.0)
  assert probed.tracker.alpha('a') == pytest.approx(plain.tracker.alpha('a'))
  assert probed.tracker.later('a') > 0.9 > plain.tracker.later('a')
  assert probed.tracker.global_later > 0.9 > plain.tracker.global_later
  probed.observe_probe('a', 0.0, 0.0, 1.0, 1.0)      # nothing scored: nothing observed
  assert probed.tracker.later('a') > 0.9


def test_estimates_are_each_requests_alpha_later_and_shape_at_its_confidence():
  # `estimates` computes the shared terms once; it must give what the per-request methods give.
  rng = np.random.default_rng(0)
  tracker = AlphaTracker()
  for step in range(60):
    r, k, x = f'r{step % 5}', int(rng.integers(1, 5)), float(rng.uniform(0.2, 0.95))
    accepted = k if rng.uniform() < x else 0                 # acceptance rises with x: a slope
    tracker.observe(r, *round_observation(k, accepted), later_weight=float(rng.uniform(0.5, 2)),
                    confidence=None if step % 3 == 0 else x)
    tracker.observe_depth(k, int(rng.integers(0, k + 1)))
  tracker.forget('r4')
  ids = ['r0', 'r1', 'r2', 'r3', 'r4', None, 'new']
  xs = [0.9, None, 0.3, float('nan'), 0.6, 0.8, 0.2]
  ns = [16, 3, 1, 4, None, 2, 0]
  assert tracker.confidence_shift(0.9, 16) != 0.0            # the shift is exercised
  alphas, later, profile = tracker.estimates(ids, xs, 4, ns)
  for i, (r, x, n) in enumerate(zip(ids, xs, ns)):
    if r is None:
      alpha, beta = tracker.global_alpha, tracker.global_later
    else:
      alpha, beta = tracker.alpha(r, x, n), tracker.later(r, x, n) / tracker.shape(r)
    assert alphas[i] == pytest.approx(alpha, abs=1e-12)
    np.testing.assert_allclose(later[i], np.minimum(beta * np.array(profile), 1.0), atol=1e-12)
  with pytest.raises(ValueError, match='one confidence per request id'):
    tracker.estimates(['a', 'b'], [0.5], 4)
