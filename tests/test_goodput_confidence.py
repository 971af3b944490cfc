"""The target's confidence (its top probability at K = 0) moves the goodput policy's α priors:
`AlphaTracker.confidence_shift`, `speculation.confidence`, and the measuring script."""

import math
import pathlib
import types

import numpy as np
import pytest

from jaxspec.engine import speculation
from jaxspec.engine.goodput import AlphaTracker, GoodputK


def _fed(pairs, repeats: int = 40, **kwargs) -> AlphaTracker:
  """A tracker that saw `repeats` rounds of 8-trial observations (x, α) from `pairs`."""
  tracker = AlphaTracker(**kwargs)
  for i in range(repeats):
    for j, (x, alpha) in enumerate(pairs):
      tracker.observe(j, 8 * alpha, 8, confidence=x)
  return tracker


def test_a_confident_target_raises_a_new_requests_alpha_and_an_unsure_one_lowers_it():
  tracker = _fed([(0.3, 0.5), (0.7, 0.9)])
  assert tracker.confidence_shift(None) == 0.0
  low, high = tracker.confidence_shift(0.3), tracker.confidence_shift(0.7)
  assert low < 0 < high and high - low == pytest.approx(0.4, abs=0.05)   # slope ~1, shrunk
  g = tracker.global_alpha
  assert tracker.alpha('new', 0.7) == pytest.approx(min(g + high, 1.0))
  assert tracker.alpha('new', 0.3) < g < tracker.alpha('new', 0.7)
  assert tracker.alpha('new') == g and tracker.later('new', 0.7) > tracker.later('new')


def test_no_shift_without_confidences_or_against_a_falling_relation():
  tracker = AlphaTracker()
  for i in range(20):
    tracker.observe(i, 6.0, 8)                         # no confidence given
  assert tracker.confidence_shift(0.9) == 0.0
  falling = _fed([(0.3, 0.9), (0.7, 0.5)])             # clipped: the slope is >= 0
  assert falling.confidence_shift(0.9) == 0.0 and falling.confidence_shift(0.1) == 0.0
  flat = _fed([(0.5, 0.6), (0.5, 0.8)])                # one x only: nothing to fit a slope on
  assert abs(flat.confidence_shift(0.9)) < 1e-9


def test_the_shift_is_measured_from_the_confidence_the_global_alpha_stands_at():
  # A fit over two sets, then a long stretch of the confident set alone: the global α is that
  # set's, so a request as confident as it is not moved, and an unsure one is moved down.
  tracker = _fed([(0.3, 0.5), (0.7, 0.9)])
  for i in range(200):
    tracker.observe(i % 2, 8 * 0.9, 8, confidence=0.7)
  assert tracker.global_alpha > 0.85
  assert abs(tracker.confidence_shift(0.7)) < 0.03 and tracker.confidence_shift(0.3) < -0.2


def test_queued_requests_are_priced_at_the_running_ones_confidence():
  tracker = _fed([(0.3, 0.5), (0.7, 0.9)])
  g, b, profile = tracker.global_alpha, tracker.global_later, [1.0, 0.5]
  alpha, later = tracker.queue_estimates([None, None], profile, raise_by=0.1)   # as before
  assert alpha == pytest.approx(min(g + 0.1, 1.0))
  np.testing.assert_allclose(later, np.minimum(b * np.array(profile) + 0.1, 1.0))
  shift = tracker.confidence_shift(0.6)
  assert tracker.queue_estimates([0.5, 0.7, None], profile)[0] == pytest.approx(g + shift)
  low = tracker.queue_estimates([0.3], profile)[0]
  assert low < g
  # Raised (the optimistic pricing of `worth_probing`): moved up only, never down.
  assert tracker.queue_estimates([0.3], profile, raise_by=0.05)[0] == pytest.approx(g + 0.05)


def test_a_bad_confidence_or_no_shrinkage_moves_nothing_and_raises_nothing():
  tracker = _fed([(0.3, 0.5), (0.7, 0.9)])
  assert tracker.confidence_shift(math.nan) == 0.0
  assert tracker.alpha('new', math.nan) == tracker.global_alpha
  level = list(tracker._level)
  tracker.observe('x', 4.0, 8, confidence=math.inf)        # counted as no confidence
  assert tracker._level[0] < level[0] and tracker._level[1] < level[1]    # faded, nothing added
  bare = AlphaTracker(prior_trials=0.0)                    # no shrinkage: one x, no spread
  bare.observe('a', 6.0, 8, confidence=0.5)
  assert bare.confidence_shift(0.9) == 0.0


def test_goodput_feeds_the_confidences_it_priced_with_into_the_fit():
  policy = GoodputK()
  policy.setup(4)
  policy.confidences = [0.8]
  policy._alphas(['a'])
  policy.observe('a', 2, 2, 2.0, 2.0)                       # a K = 2 round: one first trial
  assert policy.tracker._fit[0] == 1.0 and policy.tracker._fit[1] == pytest.approx(0.8)
  off = GoodputK(use_confidence=False)
  off.setup(4)
  assert not off.wants_confidences and policy.wants_confidences
  off.observe_probe('a', 6.0, 8.0, 3.0, 5.0, confidence=0.8)
  assert off.tracker._level == [0.0, 0.0] and off.tracker._fit == [0.0] * 5


def test_the_fit_takes_only_confidences_of_enough_tokens_and_pricing_takes_all():
  # A new request's confidence rests on its first token (from prefill): priced with it, but
  # its observations stay out of the slope fit until FIT_TOKENS tokens back it.
  priced = GoodputK(tracker=_fed([(0.3, 0.3), (0.7, 0.8)]))
  policy = GoodputK()                                       # nothing fitted yet
  for p in (priced, policy):
    p.setup(4)
    p.confidences, p.confidence_tokens = [0.9, 0.2], [1, GoodputK.FIT_TOKENS]
  alphas, _ = priced._alphas(['new', 'old'])
  assert alphas[0] > priced.tracker.global_alpha > alphas[1]      # both priced
  policy._alphas(['new', 'old'])
  policy.observe('new', 2, 2, 2.0, 2.0)                     # a K = 2 round, both accepted
  assert policy.tracker._fit == [0.0] * 5                   # no x entered the fit
  policy.observe('old', 2, 0, 0.0, 2.0)
  assert policy.tracker._fit[0] > 0 and \
      policy.tracker._fit[1] == pytest.approx(0.2 * policy.tracker._fit[0])


def test_a_confidence_of_few_tokens_moves_an_estimate_less_than_one_of_many():
  # lambda(n) = (n / (n + N0)) / (R / (R + N0)), R = CONFIDENCE_TOKENS, at most 1.
  tracker = _fed([(0.3, 0.5), (0.7, 0.9)])
  r, n0 = AlphaTracker.CONFIDENCE_TOKENS, tracker.confidence_prior_tokens
  assert n0 == 3.0 and tracker.confidence_weight(None) == 1.0
  weights = [tracker.confidence_weight(n) for n in (0, 1, 2, 4, 8, r, 4 * r)]
  assert weights[0] == 0.0 and weights == sorted(weights) and weights[-2:] == [1.0, 1.0]
  assert weights[1] == pytest.approx(1 / (1 + n0) * (r + n0) / r)
  full = tracker.confidence_shift(0.7)
  assert full > 0.05 and tracker.confidence_shift(0.7, r) == pytest.approx(full)
  assert tracker.confidence_shift(0.7, 1) == pytest.approx(weights[1] * full)
  low = tracker.confidence_shift(0.3)
  assert low < 0 and tracker.confidence_shift(0.3, 1) == pytest.approx(weights[1] * low)
  unshrunk = _fed([(0.3, 0.5), (0.7, 0.9)], confidence_prior_tokens=0.0)
  assert unshrunk.confidence_shift(0.7, 1) == pytest.approx(unshrunk.confidence_shift(0.7))
  with pytest.raises(ValueError, match='confidence_prior_tokens'):
    AlphaTracker(confidence_prior_tokens=-1.0)


def test_goodput_and_the_queue_weigh_each_confidence_by_its_tokens():
  policy = GoodputK(tracker=_fed([(0.3, 0.3), (0.7, 0.8)]))
  policy.setup(4)
  g = policy.tracker.global_alpha
  policy.confidences, policy.confidence_tokens = [0.9, 0.9, 0.1], [1, 16, 1]
  alphas, _ = policy._alphas(['one', 'many', 'low'])
  assert g < alphas[0] < alphas[1] and alphas[2] < g
  assert alphas[0] - g == pytest.approx(policy.tracker.confidence_weight(1) * (alphas[1] - g))
  # The queue at the running requests' mean confidence, weighed by their tokens together.
  tracker, profile = policy.tracker, [1.0, 1.0, 1.0, 1.0]
  few = tracker.queue_estimates([0.9, 0.9], profile, tokens=[1, 1])[0]
  assert g < few < tracker.queue_estimates([0.9, 0.9], profile, tokens=[8, 8])[0] == \
      pytest.approx(tracker.queue_estimates([0.9], profile)[0])
  assert few == pytest.approx(g + tracker.confidence_shift(0.9, 2))


def test_goodput_prices_its_queue_by_the_tokens_behind_the_running_confidences():
  policy = GoodputK(tracker=_fed([(0.3, 0.3), (0.7, 0.8)]))
  policy.setup(4)
  policy.set_costs({k: 0.010 + 0.002 * k for k in range(5)})
  policy.rooms, policy.queued, policy.queue_rooms, policy.slots = [20, 20], 2, [20, 20], 2
  policy.confidences = [0.9, 0.9]
  alphas, later = policy._alphas(['a', 'b'])       # the running requests priced alike below
  scores = {}
  for tokens in ([1, 1], [16, 16], None):
    policy.confidence_tokens = tokens               # `_alphas` keeps them for the queue
    policy._alphas(['a', 'b'])
    scores[None if tokens is None else tokens[0]] = policy._scores(alphas, later)
  # A confident set: the queue's α is raised, the less so the fewer tokens back it.
  assert scores[1][2] / scores[1][0] < scores[16][2] / scores[16][0]
  assert scores[16] == pytest.approx(scores[None])  # 16 tokens: as unweighed
  with pytest.raises(ValueError):
    policy.tracker.queue_estimates([0.9, 0.9], [1.0] * 4, tokens=[1])
  with pytest.raises(ValueError):
    policy.tracker.estimates(['a', 'b'], [0.9, 0.9], 4, tokens=[1])
  # A count of None (unknown) prices the queue unweighed, at the plain mean.
  plain = policy.tracker.queue_estimates([0.9, 0.5], [1.0] * 4)[0]
  assert policy.tracker.queue_estimates([0.9, 0.5], [1.0] * 4, tokens=[1, None])[0] == plain


def test_speculation_confidence_averages_the_known_top_probabilities():
  request = types.SimpleNamespace(max_p=[0.0, 0.5, 0.0, 0.7])   # 0: unknown
  assert speculation.confidence(request) == pytest.approx(0.6)
  assert speculation.confidence(types.SimpleNamespace(max_p=[0.0])) is None
  assert speculation.confidence(types.SimpleNamespace(max_p=[0.1] * 4 + [0.9] * 16)) == \
      pytest.approx(0.9)                                          # the last 16 known
  assert speculation.confidence(types.SimpleNamespace(id=1, room=3)) is None


def test_goodput_prices_new_requests_by_their_confidence_unless_turned_off():
  policy = GoodputK(tracker=_fed([(0.3, 0.3), (0.7, 0.8)]))
  policy.setup(4)
  policy.confidences = [0.3, 0.7]
  alphas, later = policy._alphas(['a', 'b'])
  assert alphas[0] < policy.tracker.global_alpha < alphas[1] and later[0, 0] < later[1, 0]
  off = GoodputK(tracker=policy.tracker, use_confidence=False)
  off.setup(4)
  off.confidences = [0.3, 0.7]
  alphas, _ = off._alphas(['a', 'b'])
  assert alphas[0] == alphas[1] == policy.tracker.global_alpha


def test_the_script_scores_a_draft_against_the_target(tiny, tiny_draft, monkeypatch):
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / 'scripts'))
  import confidence_vs_alpha  # pylint: disable=import-outside-toplevel
  config, params = tiny
  _, draft_params = tiny_draft
  prompts = [[5, 9, 12, 3], [7, 7, 30, 2, 8, 11]]
  same = confidence_vs_alpha.request_stats(config, params, config, params, prompts, 6, set())
  assert [(a, m) for a, _, m, _ in same] == [(1.0, 6), (1.0, 6)]  # the target as its own draft
  assert all(0.0 < x <= 1.0 and x == pytest.approx(np.mean(top)) and len(top) == 6
             for _, x, _, top in same)
  other = confidence_vs_alpha.request_stats(config, params, config, draft_params, prompts, 6,
                                            set())
  assert [x for _, x, _, _ in other] == pytest.approx([x for _, x, _, _ in same])
  assert np.mean([a for a, _, _, _ in other]) < 1.0               # the perturbed draft misses


def test_the_scripts_first_tokens_table_measures_what_few_tokens_tell(monkeypatch):
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / 'scripts'))
  import confidence_vs_alpha  # pylint: disable=import-outside-toplevel
  # α follows the whole output's confidence; the first token is noise around it.
  rng = np.random.default_rng(0)
  stats = []
  for level in rng.uniform(0.2, 0.9, 200):
    top = np.clip(level + rng.normal(0, 0.3, 16), 0, 1)
    top[1:] = np.clip(level + rng.normal(0, 0.05, 15), 0, 1)
    stats.append((0.3 + 0.6 * float(np.mean(top)), float(np.mean(top)), 16, top.tolist()))
  table = confidence_vs_alpha.first_tokens(stats, [1, 8, 16])
  (n1, corr1, slope1), (n8, corr8, slope8), (n16, corr16, slope16) = table
  assert (n1, n8, n16) == (1, 8, 16) and corr16 == pytest.approx(1.0) and slope16 == 1.0
  assert corr1 < 0.8 < corr8 and slope1 < 0.5 < slope8 < 1.0      # few tokens over-move
  flat = [(0.5, 0.4, 2, [0.4, 0.4])] * 3
  assert confidence_vs_alpha.first_tokens(flat, [1]) == [(1, None, None)]


@pytest.mark.parametrize('kwargs, lazy, asked', [
    ({}, True, False),                                           # off by default (measured)
    ({'spec_confidence': True}, True, True),
    ({'spec_confidence': True, 'use_confidence': False}, True, False),
    ({'spec_confidence': True}, False, False)])                  # no lazy draft: none recorded
def test_goodput_asks_model_step_for_k_ge_1_confidences_only_when_set(monkeypatch, kwargs, lazy,
                                                                      asked):
  from jaxspec.engine import drafters, spec_steps
  seen = {}

  def model_step(*args, confidence=False, **rest):
    seen['confidence'] = confidence
    raise StopIteration                   # the call's arguments are all this test needs

  monkeypatch.setattr(spec_steps, 'model_step', model_step)
  engine = types.SimpleNamespace(policy=GoodputK(**kwargs), draft_sync=object() if lazy else None,
                                 target=None, draft=None, target_params=None, draft_params=None)
  with pytest.raises(StopIteration):
    drafters.ModelDrafter().decode(engine, [None, None], k=2, pending=np.zeros(2, np.int32),
                                   room=np.ones(2, np.int32), stop=None, caps=None,
                                   contexts=None, rng=None, sampling=None)
  assert seen['confidence'] is asked
