"""Goodput while requests wait for a slot (`makespan.rounds_with_queue`, `speculation.horizon`),
and the host work it saves: the K = 0 and K >= 1 holds of `GoodputK.choose`. Host-side, no
model (`DraftSync`'s probes: tests/test_draft_sync_probes.py)."""

import collections
import types

import numpy as np
import pytest

from jaxspec.engine import holds, makespan
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.k_policy import FixedK
from jaxspec.engine.live_costs import LiveRatio
from jaxspec.engine.speculation import choose, horizon


def test_rounds_with_queue_at_k0_counts_idle_rounds_of_admissions():
  def k0(rooms, queue, slots):
    return makespan.rounds_with_queue([0.5] * len(rooms), rooms, 2, None, queue, 0.5, 0.5,
                                      slots)[0]
  assert k0([5, 5], [3, 4], 2) == 9       # lock-step: both admitted together, no idle round
  assert k0([5, 2], [3], 2) == 6          # the room-2 slot idles one round: 2 + 1 + 3
  assert k0([5], [3], 2) == 5             # a free slot: 1 idle round + 3, under the other's 5
  assert k0([5], [3], 1) == 8             # one slot: its prefill runs alone, no round idles
  assert k0([5, 5], [3, 3, 9], 2) == 17   # the third waits for the slot that frees first
  assert k0([3, 5], [2, 4], 2) == 10      # both go to the slot freed at 3: 3 + 1 + 2 + 4
  assert k0([2, 10], [2, 2], 2) == 10
  with pytest.raises(ValueError, match='>= 1'):
    k0([5, 5], [0], 2)
  with pytest.raises(ValueError, match='slots'):
    k0([5, 5, 5], [], 2)
  with pytest.raises(ValueError, match='room'):
    makespan.rounds_with_queue([0.5], [3, 3], 2, None, [], 0.5, 0.5, 4)


def _simulate(alpha, k, rooms, queue, slots, runs, rng):
  """Mean makespan in rounds: each slot runs its request, then takes the next queued one after
  an idle round if another slot still decodes (T = 1 + accepted, geometric, capped at K + 1)."""
  total = 0
  for _ in range(runs):
    left = list(rooms) + [0] * (slots - len(rooms))
    idle = [0] * slots
    waiting = collections.deque(queue)
    rounds = 0
    while any(l > 0 for l in left) or waiting:
      for s in range(slots):           # admissions: a free slot takes the next request
        if left[s] <= 0 and waiting:
          left[s], idle[s] = waiting.popleft(), 1
      busy = [s for s in range(slots) if left[s] > 0 and not idle[s]]
      if not busy:                     # every admitted request prefills alone: no round
        idle = [0] * slots
        continue
      rounds += 1
      for s in range(slots):
        if idle[s]:
          idle[s] = 0
        elif left[s] > 0:
          left[s] -= min(int(rng.geometric(1 - alpha)), k + 1)
    total += rounds
  return total / runs


@pytest.mark.parametrize('rooms,queue,slots', [
    ([20] * 4, [20] * 4, 4), ([20, 12], [20] * 3, 3), ([30, 6], [6, 6], 2), ([3, 5], [2, 4], 2),
    ([20, 20], [20], 8), ([10, 3], [4] * 6, 2)])
def test_rounds_with_queue_matches_a_simulation(rooms, queue, slots):
  rng = np.random.default_rng(0)
  model = makespan.rounds_with_queue([0.7] * len(rooms), rooms, 2, None, queue, 0.7, 0.7, slots)
  for k in (0, 1, 2):
    assert model[k] == pytest.approx(_simulate(0.7, k, rooms, queue, slots, 1500, rng), rel=0.08)


def _policy(alpha, costs, k_max=2):
  policy = GoodputK(tracker=AlphaTracker(prior=alpha, prior_trials=1e9), costs=costs,
                    stay_margin=0.0, spec_margin=0.0, switch_rounds=0)
  policy.setup(k_max)
  return policy


def test_goodput_scores_the_queue_and_its_idle_rounds():
  """Per round K = 2 wins (2.19 tokens for 1.9x the time); over the queue it pays an idle round
  per admission and the last wave's tail, and the split admissions, and K = 0 wins."""
  costs = {0: 1.0, 1: 1.5, 2: 1.9}
  ids = [f'r{i}' for i in range(8)]
  policy = _policy(0.7, costs)
  policy.rooms, policy.queued = [12] * 8, 8
  assert policy.choose(ids)[0] == 2
  policy.queue_rooms, policy.slots, policy.split_s = [12] * 8, 8, 2.0
  rounds = makespan.rounds_with_queue([0.7] * 8, [12] * 8, 2, None, [12] * 8, 0.7, 0.7, 8)
  scores = policy._scores(*policy._alphas(ids))
  for k in range(3):
    assert scores[k] == pytest.approx(192 / (rounds[k] * costs[k] + (2.0 if k else 0.0)))
  assert policy.choose(ids)[0] == 0 == max(scores, key=scores.get)
  policy = _policy(0.95, costs)                 # a draft that rarely misses pays again
  policy.rooms, policy.queued = [12] * 8, 8
  policy.queue_rooms, policy.slots, policy.split_s = [12] * 8, 8, 2.0
  assert policy.choose(ids)[0] == 2


def test_waves_after_the_horizon_pay_the_split_again():
  """Finishes apart stay apart, so every later wave is prefilled request by request: with three
  more waves queued behind the listed one, each adds its tokens, its share of the rounds and
  the split again, and K = 0 (lock-step) wins where with one wave K = 2 did."""
  costs = {0: 1.0, 1: 1.5, 2: 1.9}
  ids = [f'r{i}' for i in range(8)]
  policy = _policy(0.95, costs)
  policy.rooms, policy.queued = [12] * 8, 8
  policy.queue_rooms, policy.slots, policy.split_s = [12] * 8, 8, 4.0
  assert policy.choose(ids)[0] == 2
  policy.queued = 32
  rounds = makespan.rounds_with_queue([0.95] * 8, [12] * 8, 2, None, [12] * 8, 0.95, 0.95, 8)
  scores = policy._scores(*policy._alphas(ids))
  for k in range(3):
    seconds, split = rounds[k] * costs[k], 4.0 if k else 0.0
    later = 3 * (seconds / 2 + split)               # three more waves: half the time, the split
    assert scores[k] == pytest.approx((192 + 3 * 96) / (seconds + split + later))
  assert policy.choose(ids)[0] == 0


def test_horizon_lists_the_queue_in_admission_order():
  def req(room, decoding=False, output=()):
    return types.SimpleNamespace(room=room, max_tokens=room, prefill_tokens=[0] * 4,
                                 decoding=decoding, output=list(output))
  run = [req(9, True), req(7), req(5, True)]               # the middle one still prefills
  # A resumed request (it has output) emits nothing at its prefill: all its room is decoded.
  waiting = collections.deque([req(4), req(1), req(6, output=[3]), req(8)])
  engine = types.SimpleNamespace(
      policy=object(), prefill_costs={}, chunk_size=8, num_slots=4, prefill_live=LiveRatio(),
      scheduler=types.SimpleNamespace(running=run, waiting=waiting))
  decodes = [r for r in run if r.decoding]
  split, queued, rooms, slots = horizon(engine, decodes)
  # The prefilling request first, then the waiting ones up to num_slots requests; each
  # decodes its room less the prefill's token (room 1: nothing to decode).
  assert queued == 5 and rooms == [6, 3, 6] and slots == 4 and split == (0.0, 0)
  engine.policy = None
  assert horizon(engine, decodes) == ((0.0, 0), None, None, None)


def test_horizon_prices_the_split_at_the_live_prefill_calls_ratio():
  # Two decoding requests of equal room finish together at K = 0 and admit the two waiting
  # ones in one call: one chunk x (2 x t(1) - t(2)) = 0.5 s by the table; live prefill calls
  # that ran 1.4x the table make it 0.7 s.
  def req(room, decoding=True):
    return types.SimpleNamespace(room=room, max_tokens=room, prefill_tokens=[0] * 4,
                                 decoding=decoding, output=[])
  run, waiting = [req(6), req(6)], collections.deque([req(5, False), req(5, False)])
  live = LiveRatio()
  engine = types.SimpleNamespace(
      policy=object(), prefill_costs={1: 1.0, 2: 1.5}, chunk_size=8, num_slots=2,
      prefill_live=live, scheduler=types.SimpleNamespace(running=run, waiting=waiting))
  assert horizon(engine, run)[0] == (pytest.approx(0.5), 10)
  for seconds in (1.4, 2.1, 1.4):                  # 1-row, 2-row and 1-row calls: 1.4x each
    live.add(seconds, engine.prefill_costs[1 if seconds < 2 else 2])
  assert horizon(engine, run)[0] == (pytest.approx(0.7), 10)


def test_live_ratio_is_a_padded_median_that_skips_what_is_not_a_time():
  live = LiveRatio(window=3)
  assert live.value == 1.0
  live.add(300.0, 1.0)                             # a call that recompiled: the median holds
  assert live.value == 1.0
  for bad in ((1.0, 0.0), (float('nan'), 1.0), (1.0, float('inf')), (-1.0, 1.0)):
    live.add(*bad)
  assert live.value == 1.0 and len(live._ratios) == 1
  live.add(1.2, 1.0)
  live.add(1.3, 1.0)
  live.add(1.25, 1.0)                              # the window drops the 300
  assert live.value == pytest.approx(1.25)


def test_k0_hold_is_longer_after_a_clear_lead():
  calls = []

  def run(alpha, rounds):
    policy = _policy(alpha, {0: 1.0, 1: 1.5, 2: 1.9})
    scores = policy._scores
    policy._scores = lambda *a: calls.append(1) or scores(*a)
    policy.rooms, policy.queued = [1000], 1
    calls.clear()
    for _ in range(rounds):
      assert policy.choose(['a'])[0] == 0
    return len(calls)
  hold = GoodputK.HOLD_ROUNDS
  assert run(0.1, 4 * hold) == 1                # K = 0 far ahead: one score per 4 x hold
  assert run(0.1, 4 * hold + 1) == 2
  assert run(0.48, 2 * hold) == 2               # a close call: scored every hold rounds


def test_k1_choice_holds_while_rooms_leave_its_caps_alone():
  policy = _policy(0.9, {0: 1.0, 1: 1.2, 2: 1.4})
  calls = []
  scores = policy._scores
  policy._scores = lambda *a: calls.append(1) or scores(*a)
  policy.rooms, policy.queued = [50, 50], 1
  hold = GoodputK.SPEC_HOLD_ROUNDS
  ks = []
  for r in range(2 * hold):
    policy.rooms = [50 - 3 * r, 50 - 2 * r]     # rooms shrink, all far above K + 1
    ks.append(policy.choose(['a', 'b'])[0])
  assert ks == [2] * (2 * hold) and len(calls) == 2      # scored every SPEC_HOLD_ROUNDS
  policy.rooms = [40, 4]                        # K + 2 = 4: the caps at K and K + 1 still free
  policy.choose(['a', 'b'])
  assert len(calls) == 3                        # (a new hold)
  policy.rooms = [40, 3]                        # K + 1 would be capped now: scored at once
  assert policy.choose(['a', 'b'])[0] >= 1 and len(calls) == 4
  policy.choose(['a', 'c'])                     # another batch: scored
  assert len(calls) == 5


def test_k0_hold_rides_out_a_common_slowdown_not_a_relative_one():
  """A live cost ratio that moves every K alike (a slower machine) keeps a K = 0 hold (up to
  LEVEL_DRIFT); one that makes K >= 1 rounds dearer or cheaper against K = 0 (beyond DRIFT)
  ends it."""
  policy = _policy(0.1, {0: 1.0, 1: 1.5, 2: 1.9})
  calls = []
  scores = policy._scores
  policy._scores = lambda *a: calls.append(1) or scores(*a)
  policy.rooms, policy.queued, policy.rows = [1000], 1, None
  assert policy.choose(['a'])[0] == 0 and len(calls) == 1
  for _ in range(3):                            # K = 0 rounds 20 % slower; K >= 1 follow
    policy.round_timing(0, 1.2, 0.0)
  assert policy.live.group_ratios() == pytest.approx((1.2, 1.2))
  assert policy.choose(['a'])[0] == 0 and len(calls) == 1
  for _ in range(3):                            # K >= 1 rounds 40 % cheaper than start-up
    policy.round_timing(1, 0.9, 0.0)
  policy.choose(['a'])
  assert len(calls) == 2
  assert holds.DRIFT < abs(np.log(0.6 / 1.2)) and np.log(1.2) < holds.LEVEL_DRIFT


def test_k0_hold_ends_only_when_host_seconds_rise():
  """h is paid every round and K >= 1 runs fewer rounds: less h keeps a K = 0 hold, more
  (by over 5 % of a K = 0 round) scores again."""
  policy = _policy(0.1, {0: 1.0, 1: 1.5, 2: 1.9})
  calls = []
  scores = policy._scores
  policy._scores = lambda *a: calls.append(1) or scores(*a)
  policy.rooms, policy.queued = [1000], 1
  policy.host.set(0, 0.2)
  assert policy.choose(['a'])[0] == 0 and len(calls) == 1
  policy.host.set(0, 0.01)
  assert policy.choose(['a'])[0] == 0 and len(calls) == 1
  policy.host.set(0, 0.3)
  assert policy.choose(['a'])[0] == 0 and len(calls) == 2


def test_holds_end_when_the_queue_changes():
  calls = []
  for alpha in (0.1, 0.9):                      # a K = 0 hold, then a K >= 1 one
    policy = _policy(alpha, {0: 1.0, 1: 1.2, 2: 1.4})
    scores = policy._scores
    policy._scores = lambda *a, scores=scores: calls.append(1) or scores(*a)
    policy.rooms, policy.queued, policy.queue_rooms, policy.slots = [50, 50], 2, [20, 20], 4
    calls.clear()
    policy.choose(['a', 'b'])
    policy.queue_rooms = [20, 30]
    policy.choose(['a', 'b'])
    policy.slots = 3
    policy.choose(['a', 'b'])
    assert len(calls) == 3


def test_a_held_k0_round_skips_gathering_the_horizon():
  """While a K = 0 hold stands (`GoodputK.repeat`), `speculation.choose` does not gather the
  queue, split and catch-up inputs; a new observation, another queue length or row bucket, or
  a probe falling due sends it the whole way again."""
  policy = _policy(0.1, {0: 1.0, 1: 1.5, 2: 1.9})
  gathered = []

  def gather():
    gathered.append(1)
    return (0.0, 0), 1, [20], 4
  decodes = [types.SimpleNamespace(id='a', room=30), types.SimpleNamespace(id='b', room=30)]
  ask = lambda queued=1, rows=2, sync=None: choose(policy, decodes, rows, 2, sync,
                                                     queued=queued, horizon=gather)
  assert ask() == (0, [0, 0]) and len(gathered) == 1
  assert ask() == (0, [0, 0]) and len(gathered) == 1            # held: nothing gathered
  assert policy.repeat(['a', 'b'], 2, 1) == (0, [0, 0])
  assert policy.repeat(['a', 'c'], 2, 1) is None                # another batch
  ask(queued=2)                                                 # the queue grew
  assert len(gathered) == 2
  ask(rows=4)                                                   # another row bucket
  assert len(gathered) == 3
  ask(rows=4)
  assert len(gathered) == 3
  policy.observe('a', 0, 0, 1.0, 1.0)                           # a new observation
  ask(rows=4)
  assert len(gathered) == 4
  due = types.SimpleNamespace(probe_due=lambda d: True, before_choice=lambda d: 0.0,
                              before_round=lambda d, k: None)
  ask(rows=4, sync=due)                                         # a probe is due
  assert len(gathered) == 5


def test_a_fixed_k_round_skips_gathering_the_horizon():
  """A static K never reads the queue, split and catch-up inputs: `FixedK.repeat` returns its
  choice, so `speculation.choose` does not gather them."""
  policy = FixedK()
  policy.setup(3)
  gathered = []

  def gather():
    gathered.append(1)
    return (0.0, 0), 1, [20], 2
  decodes = [types.SimpleNamespace(id='a', room=30), types.SimpleNamespace(id='b', room=2)]
  assert choose(policy, decodes, 2, 3, queued=1, horizon=gather) == (3, [3, 3])
  assert not gathered


def test_one_slot_scores_the_decoding_request_alone():
  """With one slot nothing couples the requests: each queued one gets its own K when it runs, so
  the score is the decoding request's per round, its own α deciding, not the queue's global one
  (`rounds_with_queue` would price the queued rounds at the K chosen now)."""
  costs = {0: 1.0, 1: 1.5, 2: 1.9}
  policy = GoodputK(tracker=AlphaTracker(prior=0.3, prior_trials=4.0, decay=0.99), costs=costs,
                    spec_margin=0.0, cold_rounds=0, switch_rounds=0)
  policy.setup(2)
  for _ in range(20):                          # request 'a' accepts every proposal
    policy.observe('a', 2, 2, 0.0, 1.0)
  for _ in range(200):                         # one finished before rejected every first one
    policy.observe('b', 2, 0, 0.0, 1.0)
  policy.forget('b')
  assert policy.tracker.global_alpha < 0.15 and policy.tracker.alpha('a') > 0.8
  policy.rooms, policy.split_s, policy.slots = [30], 0.0, 1
  alone = policy._scores(*policy._alphas(['a']))          # nothing queued: per round
  assert max(alone, key=alone.get) == 2
  policy.queued, policy.queue_rooms = 6, [30]
  assert policy._scores(*policy._alphas(['a'])) == alone   # the queue left out
  assert policy.choose(['a'])[0] == 2
  policy.slots = 2                              # two slots: the queue at α 0.3 weighs in
  two = policy._scores(*policy._alphas(['a']))
  assert two != alone and max(two, key=two.get) < 2


def test_one_slot_k1_choice_is_rescored_every_few_rounds():
  """With one slot the per-round score is cheap and a request's estimates move fast: a K >= 1
  choice holds ONE_SLOT_HOLD_ROUNDS rounds, not SPEC_HOLD_ROUNDS."""
  policy = _policy(0.9, {0: 1.0, 1: 1.2, 2: 1.4})
  calls = []
  scores = policy._scores
  policy._scores = lambda *a: calls.append(1) or scores(*a)
  policy.queued, policy.queue_rooms, policy.slots = 3, [50], 1
  hold = GoodputK.ONE_SLOT_HOLD_ROUNDS
  assert hold < GoodputK.SPEC_HOLD_ROUNDS
  for r in range(4 * hold):
    policy.rooms = [60 - 3 * r]
    assert policy.choose(['a'])[0] == 2
  assert len(calls) == 4


def test_per_round_scores_sum_the_capped_expected_tokens():
  """The per-round score's Σ_i E_i (plain Python) equals `goodput`'s for every K, rooms capping
  each request's proposals (room 0: nothing)."""
  rng = np.random.default_rng(0)
  for _ in range(50):
    n, k_max = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    alphas, later = rng.random(n), rng.random(n)
    rooms = [int(r) for r in rng.integers(1, 12, n)]
    policy = GoodputK(costs={k: 1.0 + k for k in range(k_max + 1)}, cold_rounds=0, switch_rounds=0)
    policy.setup(k_max)
    policy.rooms = rooms
    scores = policy._scores(alphas, later)
    for k in range(k_max + 1):
      assert scores[k] == pytest.approx(policy.goodput(alphas, k, rooms, later))
  policy.rooms = rooms = [0] + rooms[1:]
  scores = policy._scores(alphas, later)
  assert scores[0] == pytest.approx((n - 1) / 1.0)
  for k in range(k_max + 1):
    assert scores[k] == pytest.approx(policy.goodput(alphas, k, rooms, later))
