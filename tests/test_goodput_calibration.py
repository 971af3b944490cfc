"""The goodput policy's optional closed loop (`jaxspec.engine.calibration`, `calibrate=True`):
K >= 1 rounds that deliver less than predicted lower every K >= 1 score, so a policy that entered
K >= 1 on a model that over-promises stops re-entering. Host-side, no model."""

import pytest

from jaxspec.engine.calibration import Calibration
from jaxspec.engine.goodput import AlphaTracker, GoodputK

IDS = ['a', 'b']


def _rounds(calibration, n, tokens, seconds, k=1):
  for _ in range(n):
    calibration.add_tokens(tokens)
    calibration.round(k, seconds)


def test_factor_is_realized_over_predicted_tokens_and_seconds_padded_with_the_prior():
  c = Calibration(half_life=10**9, prior_rounds=8)
  assert c.factor == 1.0
  c.expect(tokens=4.0, seconds=1.0)
  _rounds(c, 8, tokens=2, seconds=1.0)         # half the tokens, on time
  assert c.factor == pytest.approx((8 * 0.5 + 8) / (8 + 8))
  c = Calibration(half_life=10**9, prior_rounds=8)
  c.expect(tokens=4.0, seconds=1.0)
  _rounds(c, 8, tokens=4, seconds=2.0)         # every token, twice the time
  assert c.factor == pytest.approx((8 + 8) / (8 * 2.0 + 8))


def test_k0_rounds_do_not_count_and_the_first_k1_round_pays_the_one_time_seconds():
  c = Calibration(half_life=10**9, prior_rounds=0)
  c.expect(tokens=2.0, seconds=1.0, once_s=1.0, sync_s=3.0)
  _rounds(c, 5, tokens=7, seconds=9.0, k=0)    # K = 0 rounds (a probe's tokens not counted)
  assert c.rounds == 0 and c.factor == 1.0
  c.add_tokens(2)
  c.round(1, 1.0)                              # realized 1 + 3 s against predicted 1 + 1 s
  assert c.rounds == 1 and c.factor == pytest.approx(1.0 / 2.0)
  c.add_tokens(2)
  c.round(1, 1.0)                              # in the stretch: no one-time seconds
  assert c.factor == pytest.approx(2.0 / (2.0 + 1.0))


def test_old_rounds_fade_and_the_factor_stays_in_its_range():
  c = Calibration(half_life=4, prior_rounds=0, low=0.5, high=1.25)
  c.expect(tokens=4.0, seconds=1.0)
  _rounds(c, 4, tokens=0, seconds=1.0)
  assert c.factor == 0.5                       # 0 realized: clamped at low
  _rounds(c, 40, tokens=4, seconds=1.0)        # on prediction since: back near 1
  assert c.factor == pytest.approx(1.0, abs=0.01)
  _rounds(c, 40, tokens=8, seconds=1.0)
  assert c.factor == 1.25                      # twice the prediction: clamped at high


def test_a_prediction_that_is_not_positive_and_finite_counts_no_round():
  c = Calibration()
  for tokens, seconds in ((0.0, 1.0), (2.0, float('nan')), (float('inf'), 1.0)):
    c.expect(tokens, seconds)
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
    policy.round_timing(1, 1.35, 0.0)
  # α's estimate cannot move (its prior is huge): only the calibration can change the choice.
  assert policy.choose(['c', 'd'])[0] == (0 if calibrate else 1)
  if calibrate:
    weight = sum(0.5 ** (i / 64) for i in range(8))      # the default half-life: 64 rounds
    assert policy.calibration.factor == pytest.approx((weight * 2 / 3 + 8) / (weight + 8))
  else:
    assert policy.calibration is None


def test_k1_rounds_that_deliver_what_was_predicted_keep_k1():
  policy = _policy(calibrate=True)
  assert policy.choose(IDS)[0] == 1
  for r in range(16):                # half the rows accept: 3 tokens a round, as predicted
    policy.observe('a', 1, 1, 1.0, 1.0)
    policy.observe('b', 1, 0, 0.0, 1.0)
    policy.round_timing(1, 1.35, 0.0)
  assert policy.calibration.factor == pytest.approx(1.0)
  assert policy.choose(['c', 'd'])[0] == 1


def test_calibration_is_an_experiment_off_by_default():
  assert GoodputK().calibration is None
