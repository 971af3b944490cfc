"""How far apart requests finish: `acceptance.Dispersion` (φ, measured on finished requests) and
the `dispersion` factor of `makespan.rounds_to_finish` / `rounds_with_queue`, as `GoodputK`
uses them. Host-side, no model."""

import math

import numpy as np
import pytest

from jaxspec.engine import makespan
from jaxspec.engine.acceptance import Dispersion
from jaxspec.engine.goodput import AlphaTracker, GoodputK


def _accepted(rng, alpha, k):
  """Proposals one round at cap k accepts, each accepted with probability alpha."""
  n = 0
  while n < k and rng.random() < alpha:
    n += 1
  return n


def _finish_requests(dispersion, alphas, global_alpha, k=2, rounds=15, seed=0):
  rng = np.random.default_rng(seed)
  for i, alpha in enumerate(alphas):
    for _ in range(rounds):
      dispersion.round(i, k, _accepted(rng, alpha, k))
    dispersion.finish(i, global_alpha, [global_alpha] * 8)


def test_requests_alike_give_a_dispersion_near_one():
  dispersion = Dispersion(window=400)
  _finish_requests(dispersion, [0.7] * 400, 0.7)
  assert 0.8 < dispersion.value < 1.25


def test_requests_unlike_spread_more():
  """Half accept 0.9, half 0.4: against their common estimate their totals spread far more
  than independent rounds at one α would."""
  dispersion = Dispersion(window=64)
  _finish_requests(dispersion, [0.9, 0.4] * 32, 0.65)
  assert dispersion.value > 3.0


def test_a_common_shift_is_not_spread():
  """Every request accepts more than the estimate (the estimate lags a workload switch): the
  totals are all off the same way, not apart."""
  dispersion = Dispersion(window=200)
  _finish_requests(dispersion, [0.9] * 200, 0.5)
  assert dispersion.value < 1.5


def test_probes_count_as_first_proposal_trials():
  dispersion = Dispersion(window=64, prior_requests=0.0)
  rng = np.random.default_rng(1)
  for i in range(64):
    alpha = 0.95 if i % 2 else 0.3
    for _ in range(20):
      dispersion.probe(i, float(rng.random() < alpha), 1.0)
    dispersion.finish(i, 0.6, [0.6] * 8)
  assert dispersion.value > 3.0


def test_prior_and_requests_without_observations():
  dispersion = Dispersion(window=8, prior=2.0, prior_requests=4.0)
  assert dispersion.value == 2.0
  dispersion.finish('never-seen', 0.5, [0.5] * 8)           # no rounds: no z
  dispersion.probe('k0-only', 0.0, 0.0)                      # no trials: nothing kept
  dispersion.finish('k0-only', 0.5, [0.5] * 8)
  dispersion.round('gone', 2, 1)
  dispersion.forget('gone')
  dispersion.finish('gone', 0.5, [0.5] * 8)
  assert dispersion.value == 2.0 and not dispersion._z
  for bad in (1, 2.5, True):
    with pytest.raises(ValueError, match='window'):
      Dispersion(window=bad)
  with pytest.raises(ValueError, match='prior_requests'):
    Dispersion(prior_requests=-1.0)
  for bad in (0.0, -1.0, math.inf):
    with pytest.raises(ValueError, match='prior'):
      Dispersion(prior=bad)


def test_dispersion_scales_the_spread_not_the_mean():
  alphas, rooms = [0.7] * 4, [20, 20, 18, 20]
  mean, var = makespan.token_moments(np.array(alphas), 3, None, np.array(rooms))
  center = (np.array(rooms)[:, None] / mean).max(axis=0)
  one = makespan.rounds_to_finish(alphas, rooms, 3)
  four = makespan.rounds_to_finish(alphas, rooms, 3, dispersion=4.0)
  assert four[0] == one[0] == 20
  np.testing.assert_allclose(four[1:] - center[1:], 2 * (one[1:] - center[1:]))
  queued = [makespan.rounds_with_queue(alphas, rooms, 3, None, [20] * 4, 0.7, 0.7, 4,
                                       dispersion=d) for d in (1.0, 4.0)]
  assert queued[0][0] == queued[1][0]
  assert (queued[1][1:] > queued[0][1:]).all()
  for bad in (0.0, -1.0, math.nan, math.inf, True, '2'):
    with pytest.raises(ValueError, match='dispersion'):
      makespan.rounds_to_finish(alphas, rooms, 3, dispersion=bad)
    with pytest.raises(ValueError, match='dispersion'):
      makespan.rounds_with_queue(alphas, rooms, 3, None, [20], 0.7, 0.7, 4, dispersion=bad)


def test_goodput_prices_k_lower_after_requests_that_finished_apart():
  """The policy measures φ on the requests it forgets and prices the batch's tail with it:
  after requests that spread (half accept almost all, half few), K >= 1 scores lower over a
  queue than after requests alike, at the same acceptance estimates."""
  def policy_after(alphas):
    policy = GoodputK(tracker=AlphaTracker(prior=0.65, prior_trials=1e9),
                      costs={0: 1.0, 1: 1.4, 2: 1.7}, stay_margin=0.0, spec_margin=0.0)
    policy.setup(2)
    rng = np.random.default_rng(0)
    for i, alpha in enumerate(alphas):
      for _ in range(15):
        n = _accepted(rng, alpha, 2)
        policy.observe(('old', i), 2, n, float(n >= 1), 1.0)
      policy.forget(('old', i))
    ids = [f'r{i}' for i in range(4)]
    policy.rooms, policy.queued = [24] * 4, 4
    policy.queue_rooms, policy.slots, policy.split_s = [24] * 4, 4, 0.0
    return policy.dispersion.value, policy._scores(*policy._alphas(ids))

  alike_phi, alike = policy_after([0.65] * 16)
  apart_phi, apart = policy_after([0.95, 0.35] * 8)
  assert apart_phi > 2 * alike_phi
  assert apart[0] == pytest.approx(alike[0])
  assert apart[1] < alike[1] and apart[2] < alike[2]
