"""Acceptance by proposal position: `AlphaTracker.observe_depth` and `profile` (the global
acceptance of proposal j = 2, 3, ... relative to their mean), per-position β in `makespan` and
`round_tokens`, and the goodput choice they change. Host-side, no model."""

import numpy as np
import pytest

from jaxspec.engine import makespan
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.makespan import round_tokens


def test_observe_depth_counts_each_position_reached():
  tracker = AlphaTracker(decay=0.5, global_span=1.0)
  tracker.observe_depth(4, 2)          # proposals 1, 2 accepted, 3 rejected, 4 never drafted
  assert tracker._depth == [[1.0, 1.0], [0.0, 1.0]]
  tracker.observe_depth(4, 9)          # all four accepted (clipped to the cap)
  assert tracker._depth == [[1.5, 1.5], [1.0, 1.5], [1.0, 1.0]]
  tracker.observe_depth(1, 1)          # K = 1 (and K = 0 probes): the sums only fade
  assert tracker._depth == [[0.75, 0.75], [0.5, 0.75], [0.5, 0.5]]


def test_profile_moves_acceptance_between_positions_not_its_level():
  tracker = AlphaTracker(prior_trials=4.0)
  assert tracker.profile(3) == [1.0, 1.0, 1.0]                 # nothing observed
  for _ in range(10):
    tracker.observe_depth(2, 1)                                 # only position 2, rejected
  assert tracker.profile(3) == [1.0, 1.0, 1.0]                 # nothing accepted: no shape
  tracker = AlphaTracker(prior_trials=4.0, decay=0.999)
  for i in range(200):                 # proposal 2 accepted 2 in 5 times, 3 whenever reached
    tracker.observe_depth(3, 3 if i % 5 < 2 else 1)
  f2, f3, f4 = tracker.profile(3)
  (s2, n2), (s3, n3) = tracker._depth
  mean = (s2 + s3) / (n2 + n3)
  assert f2 * mean == pytest.approx(0.4, abs=0.01) and f3 * mean == pytest.approx(1.0, abs=0.03)
  assert f4 == 1.0                                              # never reached: the mean
  # Weighted by trials (exactly: by trials + prior_trials), the profile averages to ~1: the
  # level stays the request's β.
  assert (f2 * n2 + f3 * n3) / (n2 + n3) == pytest.approx(1.0, abs=0.03)


def _enumerated(alpha, later, k):
  """Mean and variance of 1 + accepted, the j-th proposal accepted with probability α (j = 1)
  or later[j - 2], a round stopping at its first rejection."""
  probs, going = [], 1.0
  for j in range(k):
    q = alpha if j == 0 else later[j - 1]
    probs.append(going * (1 - q))
    going *= q
  probs.append(going)
  mean = sum(p * (1 + n) for n, p in enumerate(probs))
  return mean, sum(p * (1 + n) ** 2 for n, p in enumerate(probs)) - mean ** 2


def test_per_position_later_acceptance_matches_enumeration():
  alphas = np.array([0.9, 0.6])
  later = np.array([[0.4, 0.9, 0.8, 0.7], [0.8, 0.5, 1.0, 0.2]])
  mean, var = makespan.token_moments(alphas, 4, later)
  totals = round_tokens(alphas.tolist(), later.tolist(), None, 4)
  for k in range(5):
    assert totals[k] == pytest.approx(mean[:, k].sum())
    for i in range(2):
      m, v = _enumerated(alphas[i], later[i], k)
      assert mean[i, k] == pytest.approx(m) and var[i, k] == pytest.approx(v, abs=1e-12)
  # One β per request is the constant row; a longer row than K_max is cut.
  flat = makespan.token_moments(alphas, 3, np.array([0.5, 0.7]))
  rows = makespan.token_moments(alphas, 3, np.array([[0.5] * 5, [0.7] * 5]))
  np.testing.assert_allclose(flat, rows)
  with pytest.raises(ValueError, match='per position'):
    makespan.survival(alphas, 4, np.array([[0.5, 0.5], [0.5, 0.5]]))     # 2 < K_max columns
  with pytest.raises(ValueError, match='per position'):
    makespan.rounds_with_queue(alphas, [9, 9], 4, np.array([0.5]), [9], 0.5, 0.5, 2)
  with pytest.raises(ValueError, match='queue_later'):
    makespan.rounds_with_queue(alphas, [9, 9], 4, None, [9], 0.5, [0.5, 0.5], 2)


def test_a_low_second_position_makes_k1_beat_k2():
  """Retrieval-like rounds (the first proposal always accepted, the second 2 in 5 times, every
  later one whenever reached): one pooled β (~0.57) prices K = 2 above K = 1; per position
  (0.4 at j = 2) K = 1 is the better choice, as the shipped pair measured on retrieval (K = 1
  1.10x K = 0 at B = 2, K = 2 0.99x)."""
  costs = {0: 1.0, 1: 1.5, 2: 1.9, 3: 2.3}

  def policy_after_rounds(pooled):
    policy = GoodputK(tracker=AlphaTracker(prior_trials=4.0, decay=0.99), costs=costs,
                      spec_margin=0.0, stay_margin=0.0)
    policy.setup(3)
    if pooled:
      policy.tracker.profile = lambda k_max: [1.0] * k_max
    for i in range(100):
      n = 3 if i % 5 < 2 else 1
      policy.observe('a', 3, n, float(n), float(n + (n < 3)))
    return policy

  assert policy_after_rounds(pooled=True).choose(['a'])[0] == 2
  assert policy_after_rounds(pooled=False).choose(['a'])[0] == 1


def test_a_request_measured_at_one_position_is_not_shaped_twice():
  """β of a request that ran K = 2 is its position-2 rate already: multiplied by position 2's
  profile value again (0.4 over a mean of ~0.75) it would be priced near 0.2. Its `shape`
  (the profile's mean over the positions behind its β) divides that back out."""
  policy = GoodputK(tracker=AlphaTracker(prior_trials=4.0, decay=0.9), costs={0: 1.0, 1: 1.5,
                    2: 1.9, 3: 2.3, 4: 2.7}, spec_margin=0.0)
  policy.setup(4)
  for i in range(300):                 # another request's K = 4 rounds shape the profile
    n = 4 if i % 5 < 2 else 1          # position 2: 0.4; positions 3 and 4: 1.0
    policy._alphas(['x'])
    policy.observe('x', 4, n, float(n), float(n + (n < 4)))
  f2 = policy.tracker.profile(4)[0]
  assert f2 < 0.7
  for i in range(100):                 # 'a' ran K = 2 only: its β is position 2's 0.4
    n = 2 if i % 5 < 2 else 1
    policy._alphas(['a'])
    policy.observe('a', 2, n, float(n), float(n + (n < 2)))
  raw = policy.tracker.later('a')
  assert raw == pytest.approx(0.4, abs=0.1)
  _, later = policy._alphas(['a'])
  assert later[0, 0] == pytest.approx(raw, abs=0.03)      # not raw x f2 (~0.24)
  assert f2 < policy.tracker.shape('a') < 1.0     # its trials at f2, its prior's at 1
  assert policy.tracker.shape('new') == 1.0
