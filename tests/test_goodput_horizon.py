"""What goodput sees beyond one round: the prefill calls that breaking lock-step admissions costs
(`speculation.split_cost`), the batch's makespan once nothing waits (`makespan`), and whether a
probe could change its choice (`GoodputK.worth_probing`). Host-side, no model."""

import types
import warnings

import numpy as np
import pytest

from jaxspec.engine import makespan
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.speculation import split_cost

PREFILL = {1: 10.0, 2: 12.0, 4: 16.0}       # seconds per call of each row bucket


def _req(room=0, prompt=8, max_tokens=5):
  return types.SimpleNamespace(room=room, prefill_tokens=[0] * prompt, max_tokens=max_tokens)


def test_split_cost_counts_groups_that_would_admit_together():
  waiting = [_req(max_tokens=5 + i) for i in range(3)]
  # Three requests finish together at K = 0 and admit all three in one [4, C] call.
  seconds, tokens = split_cost([_req(7), _req(7), _req(7)], waiting, PREFILL, chunk_size=8)
  assert seconds == pytest.approx(3 * 10.0 - 16.0) and tokens == 5 + 6 + 7
  # Finishes already apart: each admission is alone at any K, nothing to lose.
  assert split_cost([_req(3), _req(5), _req(7)], waiting, PREFILL, 8) == (0.0, 0)
  # Two groups: the earlier (room 2) admits two together, the later one the last alone.
  seconds, tokens = split_cost([_req(9), _req(2), _req(2), _req(9)], waiting, PREFILL, 8)
  assert seconds == pytest.approx(2 * 10.0 - 12.0) and tokens == 5 + 6
  # Prompts of three chunks pay it per chunk; nothing waiting or no cost table: 0.
  long = [_req(max_tokens=4, prompt=20) for _ in range(2)]
  assert split_cost([_req(4), _req(4)], long, PREFILL, 8)[0] == pytest.approx(3 * (20.0 - 12.0))
  assert split_cost([_req(4), _req(4)], [], PREFILL, 8) == (0.0, 0)
  assert split_cost([_req(4), _req(4)], waiting, {}, 8) == (0.0, 0)
  # More admissions than the largest bucket: the batched side takes full calls plus the rest.
  many = [_req(max_tokens=1) for _ in range(6)]
  seconds, _ = split_cost([_req(1)] * 6, many, PREFILL, 8)
  assert seconds == pytest.approx(6 * 10.0 - (16.0 + 12.0))


def test_token_moments_match_the_truncated_geometric():
  alphas = np.array([0.0, 0.3, 0.8, 1.0])
  mean, var = makespan.token_moments(alphas, 4)
  for i, a in enumerate(alphas):
    for k in range(5):
      p = [a ** (j - 1) * (1 - a) for j in range(1, k + 1)] + [a ** k]   # T = 1..K+1
      t = np.arange(1, k + 2)
      assert mean[i, k] == pytest.approx(np.dot(p, t))
      assert var[i, k] == pytest.approx(np.dot(p, t ** 2) - np.dot(p, t) ** 2, abs=1e-12)
  assert (mean[:, 0] == 1).all() and (var[:, 0] == 0).all()


def test_rounds_to_finish():
  rounds = makespan.rounds_to_finish([0.7, 0.7], [10, 6], 3)
  assert rounds[0] == 10                                   # K = 0: the largest room
  one = makespan.rounds_to_finish([0.7], [10], 3)
  mean, _ = makespan.token_moments(np.array([0.7]), 3)
  assert one == pytest.approx(10 / mean[0])                # one request: no spread
  # The slowest of n requests: later the more requests run in lock-step (not at K = 0).
  many = [makespan.rounds_to_finish([0.7] * n, [10] * n, 3) for n in (1, 4, 32)]
  assert many[0][2] < many[1][2] < many[2][2] and many[0][0] == many[2][0] == 10
  assert makespan.expected_max_normal(1) == 0 and makespan.expected_max_normal(2) > 0.5
  with pytest.raises(ValueError, match='room'):
    makespan.rounds_to_finish([0.5, 0.5], [3], 2)
  # A Monte Carlo check of the expected maximum at K = 2 over 8 requests of room 20.
  rng = np.random.default_rng(0)
  finish = []
  for _ in range(4000):
    steps = np.zeros(8)
    left = np.full(8, 20)
    while (left > 0).any():
      t = np.minimum(rng.geometric(0.3, 8), 3)             # α = 0.7, K = 2: T in 1..3
      steps += left > 0
      left -= t
    finish.append(steps.max())
  assert makespan.rounds_to_finish([0.7] * 8, [20] * 8, 2)[2] == pytest.approx(
      np.mean(finish), rel=0.1)


def _policy(alpha, costs, k_max=2, **kwargs):
  kwargs.setdefault('spec_margin', 0.0)       # these test the model's scores, not the hurdle
  policy = GoodputK(tracker=AlphaTracker(prior=alpha, prior_trials=1e9), costs=costs, **kwargs)
  policy.setup(k_max)
  return policy


def test_goodput_scores_the_makespan_once_nothing_waits():
  costs = {0: 1.0, 1: 1.5, 2: 1.9}
  ids = [f'r{i}' for i in range(16)]
  policy = _policy(0.7, costs, stay_margin=0.0)
  policy.rooms = [12] * 16
  assert policy.choose(ids)[0] == 2                      # per round: 2.19 / 1.9 > 1 / 1
  policy.queued = 0                                      # the last wave: the slowest counts
  rounds = makespan.rounds_to_finish([0.7] * 16, [12] * 16, 2)
  expect = max(range(3), key=lambda k: -rounds[k] * costs[k])
  assert policy.choose(ids)[0] == expect == 0
  policy.queued = 3
  assert policy.choose(ids)[0] == 2


def test_goodput_pays_the_split_once_over_the_rounds_it_serves():
  policy = _policy(0.7, {0: 1.0, 1: 1.5, 2: 1.9})
  policy.rooms, policy.queued = [12, 12], 2
  assert policy.choose(['a', 'b'])[0] == 2
  policy.split_s, policy.split_tokens = 30.0, 24
  tokens = 2 * (1 + 0.7 + 0.49)
  expect = tokens / (1.9 + 30.0 / ((24 + 24) / tokens))
  assert policy.goodput([0.7, 0.7], 2, [12, 12]) == pytest.approx(expect)
  assert policy.choose(['a', 'b'])[0] == 0


def test_worth_probing_only_near_the_threshold_or_while_alpha_is_loose():
  costs = {0: 1.0, 1: 1.5, 2: 1.9}
  far = _policy(0.1, costs)                              # the prior's 1e9 trials: sd ~ 0
  assert far.choose(['a'])[0] == 0 and not far.worth_probing(['a'])
  near = _policy(0.5, costs)                             # α + 0.05 would choose K >= 1
  assert near.choose(['a'])[0] == 0 and near.worth_probing(['a'])
  never = GoodputK(tracker=AlphaTracker(prior=0.45, prior_trials=1e9), costs=costs,
                   probe_margin=0.0, spec_margin=0.0)
  never.setup(2)
  assert not never.worth_probing(['a'])
  # A loose estimate (a few trials): α = 0.2 from 5 trials is worth a probe; from 500, not.
  for trials, worth in ((5, True), (500, False)):
    policy = GoodputK(tracker=AlphaTracker(prior=0.2, prior_trials=0.0, decay=0.0),
                      costs=costs, spec_margin=0.0)
    policy.setup(2)
    policy.observe('a', 0, 0, 0.2 * trials, trials)
    assert policy.choose(['a'])[0] == 0 and policy.worth_probing(['a']) == worth
  with pytest.raises(ValueError, match='probe_margin'):
    GoodputK(probe_margin=1.5)


def test_a_cold_policy_finds_every_probe_worth_it():
  """Until the global estimate holds `COLD_TRIALS` trials (the prior's pseudo-trials
  included), `worth_probing` says yes even where the estimate says no: a low α from a first
  probe or two must not stop the probes that would correct it. A prior of many pseudo-trials
  is never cold."""
  costs = {0: 1.0, 1: 1.5, 2: 1.9}
  policy = GoodputK(tracker=AlphaTracker(prior=0.5, prior_trials=4.0, decay=0.999), costs=costs)
  policy.setup(2)
  assert policy.cold and policy.worth_probing(['a'])
  policy.observe('a', 0, 0, 0.0, 3.0)                   # 0 of 3: α 0.29 over 7 trials
  assert policy.cold and policy.choose(['a'])[0] == 0 and policy.worth_probing(['a'])
  policy.observe('a', 0, 0, 0.0, 6.0)                   # 0 of 9: ~13 trials, warm
  assert not policy.cold and not policy.worth_probing(['a'])
  assert not _policy(0.1, costs).cold                   # 1e9 pseudo-trials


def test_worth_probing_raises_the_queued_requests_estimates_too():
  """While requests wait, the horizon prices them at the global α and β: a probe's question
  (would higher estimates choose K >= 1?) raises those too, not just the running requests'.
  Priced at the loose global α 0.3, a queue that holds most of the horizon's tokens kept K = 0
  and no probe ever came to show the workload's real α."""
  costs = {0: 1.0, 1: 1.3, 2: 1.5}
  policy = GoodputK(tracker=AlphaTracker(prior=0.3, prior_trials=10.0), costs=costs,
                    spec_margin=0.0)
  policy.setup(2)
  policy.rooms, policy.queued, policy.queue_rooms, policy.slots = [2, 2], 6, [30, 30], 2
  assert policy.choose(['a', 'b'])[0] == 0
  up = policy.probe_margin + 2 * np.sqrt(0.3 * 0.7 / 10.0)
  raised = np.full(2, 0.3 + up)
  assert policy._pick(policy._scored(raised, raised)) == 0        # the queue at 0.3: K = 0
  assert policy._pick(policy._scored(raised, raised, raise_by=up)) >= 1
  assert policy.worth_probing(['a', 'b'])


def test_goodput_stays_speculating_unless_k0_wins_by_the_stay_margin():
  """After a round at K >= 1 (the draft in sync) K = 0 must win by more than stay_margin;
  from K = 0 the plain argmax decides."""
  ids = ['a', 'b']
  # α = 0.5: per round K = 1 gives 1.5 / c(1) against 1 / 1 for K = 0.
  for cost, stays in ((1.52, True), (1.62, False)):      # K = 0 ahead by ~1 % / ~8 %
    policy = _policy(0.5, {0: 1.0, 1: cost}, k_max=1, stay_margin=0.05)
    assert policy.choose(ids)[0] == 0                    # from K = 0: the argmax
    policy.set_costs({0: 1.0, 1: 1.4})
    assert policy.choose(ids)[0] == 1
    policy.set_costs({0: 1.0, 1: cost})
    assert policy.choose(ids)[0] == (1 if stays else 0)
  with pytest.raises(ValueError, match='stay_margin'):
    GoodputK(stay_margin=-0.1)


def test_pricing_names_how_a_scoring_prices_the_batch():
  policy = _policy(0.7, {0: 1.0, 1: 1.5, 2: 1.9})
  assert policy.pricing(2) == (None, 'round', [0, 1])          # no rooms given
  policy.rooms, policy.queued = [5, 7], 0
  assert policy.pricing(3) == (None, 'round', [0, 1, 2])       # rooms not one per request
  assert policy.pricing(2) == ([5, 7], 'finish', [0, 1])       # nothing waits
  policy.queued, policy.queue_rooms, policy.slots = 2, [9, 9], 2
  assert policy.pricing(2) == ([5, 7], 'queue', [0, 1])
  policy.rooms = [0, 7]                                        # a finished row is left out
  assert policy.pricing(2) == ([7], 'queue', [1])
  policy.slots = 1                                             # one slot: per round
  assert policy.pricing(1) == (None, 'round', [0]) and policy.pricing(2) == ([7], 'round', [1])
  policy.slots, policy.queue_rooms = 2, None                   # the queue's rooms unknown
  assert policy.pricing(2) == ([7], 'round', [1])


@pytest.mark.parametrize('queued', [0, 2])
def test_a_batch_with_nothing_left_to_emit_chooses_the_smallest_k(queued):
  """Every room 0 (no token left to emit) once raised a bare `min()` error after 0 / 0."""
  for candidates, expect in ((None, 0), ((1, 2), 1)):
    policy = _policy(0.7, {0: 1.0, 1: 1.5, 2: 1.9}, candidates=candidates)
    policy.rooms, policy.queued, policy.queue_rooms, policy.slots = [0, 0], queued, [9], 2
    with warnings.catch_warnings():
      warnings.simplefilter('error')
      assert policy.choose(['a', 'b']) == (expect, [expect, expect])


@pytest.mark.parametrize('queued', [0, 2, None])
def test_finished_rows_are_scored_as_absent(queued):
  """A row with room 0 emits nothing and takes no round: the batch scores as the others alone
  (the makespan once divided 0 by 0 for it, the queue's horizon rejected it)."""
  def scores(rooms, ids):
    policy = _policy(0.7, {0: 1.0, 1: 1.5, 2: 1.9})
    policy.rooms, policy.queued, policy.queue_rooms, policy.slots = rooms, queued, [9], 2
    policy.sync_s = 0.5
    with warnings.catch_warnings():
      warnings.simplefilter('error')
      return policy._scores(*policy._alphas(ids))
  assert scores([0, 6], ['a', 'b']) == pytest.approx(scores([6], ['b']))
  policy = _policy(0.7, {0: 1.0, 1: 1.5, 2: 1.9})
  policy.sync_s = 0.5                                # a once-cost over no tokens: 0, not 1 / 0
  assert policy.goodput([0.7, 0.7], 2, rooms=[0, 0]) == 0.0


@pytest.mark.parametrize('field, value, message', [
    ('sync_s', -1000.0, r'sync_s \(seconds\) must be a finite number in \[0.0, inf\)'),
    ('sync_s', float('nan'), r'sync_s \(seconds\) must be a finite number'),
    ('split_s', float('nan'), r'split_s \(seconds\) must be a finite number'),
    ('split_s', float('inf'), r'split_s \(seconds\) must be a finite number'),
    ('slots', 2.5, r'slots must be an int >= 1 or None, got 2.5'),
    ('slots', 0, r'slots must be an int >= 1 or None, got 0')])
def test_bad_choice_inputs_are_named(field, value, message):
  """A one-time cost set by hand to a negative or NaN value once ended in a bare `min()` of an
  empty sequence, an infinite split in a NaN score (0 x inf) and slots of 2.5 in a TypeError
  from numpy; now the choice names the bad input before it scores."""
  policy = _policy(0.7, {0: 1.0, 1: 1.5, 2: 1.9}, candidates=(1, 2))
  policy.rooms, policy.queued, policy.queue_rooms, policy.slots = [12, 12], 2, [9], 2
  setattr(policy, field, value)
  with warnings.catch_warnings():
    warnings.simplefilter('error')               # no RuntimeWarning on the way
    with pytest.raises(ValueError, match=f'GoodputK {message}'):
      policy.choose(['a', 'b'])
