"""The goodput policy's optional closed loop (`jaxspec.engine.calibration`, `calibrate=True`):
K >= 1 rounds that deliver less than predicted lower every K >= 1 score, so a policy that entered
K >= 1 on a model that over-promises stops re-entering. Host-side, no model."""

import pytest

from jaxspec.engine.calibration import Calibration
from jaxspec.engine.goodput import AlphaTracker, GoodputK

IDS = ['a', 'b']


def _rounds(calibration, n, tokens, seconds, k=1, catch_up_s=0.0):
  for _ in range(n):
    calibration.outcome(tokens, catch_up_s)
    calibration.round(k, seconds)


def test_factor_is_realized_over_predicted_tokens_and_seconds_padded_with_the_prior():
  c = Calibration(half_life=10**9, prior_rounds=8)
  assert c.factor == 1.0
  c.expect(tokens=4.0, seconds=1.0)
  _rounds(c, 8, tokens=2, seconds=1.0)         # half the tokens, on time: 8 more rounds at 4/4
  assert c.factor == pytest.approx((16 + 32) / (32 + 32))
  c = Calibration(half_life=10**9, prior_rounds=8)
  c.expect(tokens=4.0, seconds=1.0)
  _rounds(c, 8, tokens=4, seconds=2.0)         # every token, twice the time
  assert c.factor == pytest.approx(1.0 / ((16 + 8) / (8 + 8)))


def test_k0_rounds_do_not_count_and_a_choices_one_time_seconds_are_booked_once():
  c = Calibration(half_life=10**9, prior_rounds=0)
  c.expect(tokens=2.0, seconds=1.0, once_s=1.0)
  _rounds(c, 5, tokens=7, seconds=9.0, k=0, catch_up_s=4.0)   # K = 0 rounds (and their probes)
  assert c.rounds == 0 and c.factor == 1.0
  _rounds(c, 1, tokens=2, seconds=1.0, catch_up_s=3.0)   # 1 + 3 s measured, 1 + 1 s priced
  assert c.rounds == 1 and c.factor == pytest.approx(1.0 / (4.0 / 2.0))
  _rounds(c, 1, tokens=2, seconds=1.0)                  # the stretch goes on: nothing one-time
  assert c.factor == pytest.approx(1.0 / (5.0 / 3.0))
  c.expect(tokens=2.0, seconds=1.0, once_s=2.0)         # a new choice prices a new catch-up
  _rounds(c, 1, tokens=2, seconds=1.0, catch_up_s=2.0)
  assert c.factor == pytest.approx(1.0 / (8.0 / 6.0))


def test_old_rounds_fade_and_the_factor_stays_in_its_range():
  c = Calibration(half_life=4, prior_rounds=0, low=0.5, high=1.25)
  c.expect(tokens=4.0, seconds=1.0)
  _rounds(c, 4, tokens=0, seconds=1.0)
  assert c.factor == 0.5                       # 0 realized: clamped at low
  _rounds(c, 40, tokens=4, seconds=1.0)        # on prediction since: back near 1
  assert c.factor == pytest.approx(1.0, abs=0.01)
  _rounds(c, 40, tokens=8, seconds=1.0)
  assert c.factor == 1.25                      # twice the prediction: clamped at high


def test_the_factor_returns_to_the_prior_while_the_policy_stays_at_k0():
  c = Calibration(half_life=4, prior_rounds=8)
  c.expect(tokens=4.0, seconds=1.0)
  _rounds(c, 8, tokens=1, seconds=1.0)
  low = c.factor
  assert low < 0.8
  _rounds(c, 8, tokens=0, seconds=1.0, k=0)
  assert low < c.factor < 1.0
  _rounds(c, 100, tokens=0, seconds=1.0, k=0)
  assert c.factor == pytest.approx(1.0, abs=1e-4)


def test_a_prediction_that_is_not_positive_and_finite_counts_no_round():
  c = Calibration()
  for tokens, seconds, once_s in ((0.0, 1.0, 0.0), (2.0, float('nan'), 0.0),
                                  (float('inf'), 1.0, 0.0), (2.0, 1.0, -1.0)):
    c.expect(tokens, seconds, once_s)
    _rounds(c, 3, tokens=1, seconds=1.0)
  assert c.rounds == 0 and c.factor == 1.0


@pytest.mark.parametrize('kwargs, message', [
    (dict(half_life=0), 'half_life'), (dict(prior_rounds=-1.0), 'prior_rounds'),
    (dict(low=0.0), 'low'), (dict(low=1.5), 'low'), (dict(high=0.9), 'high'),
    (dict(high=float('nan')), 'high')])
def test_bad_arguments_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Calibration(**kwargs)


def _policy(**kwargs):
  # α = 0.5 held fixed (a huge prior): K = 1 emits 1.5 tokens a round at 1.35x K = 0's cost,
  # +11 % goodput, past the 5 % hurdle.
  policy = GoodputK(tracker=AlphaTracker(prior=0.5, prior_trials=1e9),
                    costs={0: 1.0, 1: 1.35}, cold_rounds=0, switch_rounds=0, **kwargs)
  policy.setup(1)
  return policy


@pytest.mark.parametrize('calibrate', [True, False])
def test_k1_rounds_that_deliver_less_than_predicted_send_the_policy_back_to_k0(calibrate):
  policy = _policy(calibrate=calibrate)
  policy.round_timing(0, 1.0, 0.0)
  assert policy.choose(IDS)[0] == 1
  for _ in range(8):                 # every row rejects its proposal: 1 token, not 1.5
    for rid in IDS:
      policy.observe(rid, 1, 0, 0.0, 1.0)
    policy.round_outcome(2, 0.0)
    policy.round_timing(1, 1.35, 0.0)
  # α's estimate cannot move (its prior is huge): only the calibration can change the choice.
  assert policy.choose(['c', 'd'])[0] == (0 if calibrate else 1)
  if calibrate:      # predicted 3 tokens a round (2 rows x 1.5) in 1.35 s, as the rounds took
    weight = sum(0.5 ** (i / 64) for i in range(8))      # the default half-life: 64 rounds
    assert policy.calibration.factor == pytest.approx((weight * 2 + 8 * 3) / (weight * 3 + 8 * 3))
  else:
    assert policy.calibration is None


def test_k1_rounds_that_deliver_what_was_predicted_keep_k1():
  policy = _policy(calibrate=True)
  assert policy.choose(IDS)[0] == 1
  for r in range(16):                # half the rows accept: 3 tokens a round, as predicted
    policy.observe('a', 1, 1, 1.0, 1.0)
    policy.observe('b', 1, 0, 0.0, 1.0)
    policy.round_outcome(3, 0.0)
    policy.round_timing(1, 1.35, 0.0)
  assert policy.calibration.factor == pytest.approx(1.0)
  assert policy.choose(['c', 'd'])[0] == 1


def test_calibration_is_an_experiment_off_by_default():
  assert GoodputK().calibration is None


def test_a_choice_predicts_only_what_unfinished_rows_may_still_emit():
  """Rows with room 0 are left out of the prediction and the others capped at their room."""
  policy = _policy(calibrate=True)
  policy.rooms, policy.queued = [0, 1, 40], 0
  policy.choose(['a', 'b', 'c'])
  assert policy.calibration._expected[0] == pytest.approx(1 + 1.5)   # b: 1 token, c: 1.5


def test_the_engine_tells_the_policy_each_rounds_tokens_after_the_cuts(tiny, tiny_draft):
  """Σ round_outcome tokens = every token the decode rounds emitted (all but each request's
  first, which prefill draws), with max_tokens cutting accepted runs short at K = 3."""
  from jaxspec.engine import Engine
  from jaxspec.engine.k_policy import FixedK

  class Told(FixedK):
    def __init__(self):
      super().__init__()
      self.tokens = []

    def round_outcome(self, tokens, catch_up_s):
      self.tokens.append(tokens)

  config, params = tiny
  policy = Told()
  engine = Engine(config, params, draft=tiny_draft[0], draft_params=tiny_draft[1], k=3,
                  k_policy=policy, num_slots=2, num_pages=64, page_size=8, chunk_size=8)
  ids = [engine.add_request(list(range(3, 3 + n)), max_tokens=m) for n, m in ((5, 7), (9, 10))]
  outs = engine.run()
  assert sum(policy.tokens) == sum(len(outs[i].tokens) - 1 for i in ids) == 15
  assert len(policy.tokens) == engine.k_rounds[3]


@pytest.mark.parametrize('probe_every', [None, 1])
def test_the_engine_tells_the_policy_the_catch_up_before_each_k1_round_and_no_probes(
    tiny, tiny_draft, probe_every):
  """`round_outcome`'s catch_up_s: the lazy draft's catch-up run right before a round at K >= 1
  (after K = 0 rounds), 0 for every other round, probes (run before K = 0 rounds' choices) not
  counted: with probes off they add up to every catch-up the draft ran, with them less."""
  from jaxspec.engine import Engine
  from jaxspec.engine.drafters import ModelDrafter
  from jaxspec.engine.k_policy import KPolicy

  class Cycle(KPolicy):
    candidates = property(lambda self: (0, 2))

    def __init__(self):
      super().__init__()
      self.calls, self.told = 0, []

    def choose(self, request_ids):
      k = (0, 0, 2)[self.calls % 3]
      self.calls += 1
      return k, [k] * len(request_ids)

    def round_outcome(self, tokens, catch_up_s):
      self.told.append(catch_up_s)

    def round_timing(self, k, device_s, host_s):
      self.told[-1] = (k, self.told[-1])

  config, params = tiny
  policy = Cycle()
  engine = Engine(config, params, draft=tiny_draft[0], draft_params=tiny_draft[1], k=2,
                  k_policy=policy, drafter=ModelDrafter(probe_every=probe_every, probe_budget=None,
                                                        overlap_choice=False),
                  num_slots=2, num_pages=64, page_size=8, chunk_size=8)
  for n in (5, 9):
    engine.add_request(list(range(3, 3 + n)), max_tokens=12)
  engine.run()
  assert [k for k, _ in policy.told][:6] == [0, 0, 2, 0, 0, 2]
  assert all((s > 0) == (k >= 1) for k, s in policy.told)      # each K = 2 round follows K = 0s
  told = sum(s for _, s in policy.told)
  if probe_every is None:
    assert told == pytest.approx(engine.draft_sync.seconds)
  else:
    assert 0 < told < engine.draft_sync.seconds
