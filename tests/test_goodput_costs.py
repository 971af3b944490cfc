"""What a goodput choice weighs besides α: the host seconds of each kind of round (K = 0 and
K >= 1, windowed medians), the hurdle every K >= 1 must clear (`spec_margin`), and how often a
repeated K = 0 hold checks them. Host-side, no model."""

import numpy as np
import pytest

from jaxspec.engine import holds
from jaxspec.engine.goodput import AlphaTracker, GoodputK

IDS = ['a', 'b']


def _policy(alpha, costs, k_max=1, **kwargs):
  kwargs.setdefault('cold_rounds', 0)        # every round counts (see the cold-rounds test)
  kwargs.setdefault('switch_rounds', 0)      # (and the switch-rounds test)
  policy = GoodputK(tracker=AlphaTracker(prior=alpha, prior_trials=1e9), costs=costs, **kwargs)
  policy.setup(k_max)
  return policy


def test_k1_must_beat_k0_by_the_spec_margin():
  # α = 0.5: K = 1 emits 1.5 tokens a round against K = 0's 1.
  assert _policy(0.5, {0: 1.0, 1: 1.45}, spec_margin=0.0).choose(IDS)[0] == 1    # +3.4 %
  assert _policy(0.5, {0: 1.0, 1: 1.45}, spec_margin=0.05).choose(IDS)[0] == 0
  assert _policy(0.5, {0: 1.0, 1: 1.35}, spec_margin=0.05).choose(IDS)[0] == 1   # +11 %
  with pytest.raises(ValueError, match='spec_margin'):
    GoodputK(spec_margin=-0.01)


def test_a_cost_table_time_must_be_a_positive_number_not_a_bool():
  for bad in (True, 0.0, float('nan'), '1.0'):
    with pytest.raises(ValueError, match='cost table'):
      _policy(0.5, {0: 1.0, 1: bad})


def test_spec_and_stay_margins_make_a_band():
  """Entered above (1 + spec_margin) x K = 0's goodput, K >= 1 is left only below
  (1 + spec_margin) / (1 + stay_margin) x (here 1x)."""
  policy = _policy(0.5, {0: 1.0, 1: 1.35}, spec_margin=0.05, stay_margin=0.05)
  assert policy.choose(IDS)[0] == 1                 # +11 %: enters
  policy.set_costs({0: 1.0, 1: 1.45})               # +3.4 %: would not enter, stays
  assert policy.choose(IDS)[0] == 1
  policy.set_costs({0: 1.0, 1: 1.55})               # -3 %: leaves
  assert policy.choose(IDS)[0] == 0


def test_host_seconds_are_medians_per_kind_of_round():
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  for seconds in (0.1, 0.1, 5.0, 0.1):              # one slow round (a GC pause) is ignored
    policy.round_timing(0, 1.0, seconds)
  assert policy.host.median(0) == pytest.approx(0.1)
  assert policy.host.median(1) is None and policy.host.of(1) == pytest.approx(0.1)
  policy.round_timing(1, 1.5, 0.4)
  assert policy.host.median(1) == pytest.approx(0.4) and policy.host.median(0) == pytest.approx(0.1)
  assert policy.host.of(1) == pytest.approx(0.4) and policy.host.of(0) == pytest.approx(0.1)


def test_dearer_host_work_of_k1_rounds_keeps_k0():
  """d = {0: 1, 1: 1.3} s, α = 0.5: K = 1 wins by 15 % with no host time, but with 0.3 s more
  host work per K >= 1 round (1.5 / 1.6 against 1 / 1) K = 0 does."""
  policy = _policy(0.5, {0: 1.0, 1: 1.3}, spec_margin=0.0)
  policy.round_timing(0, 1.0, 0.0)
  assert policy.choose(IDS)[0] == 1
  policy.round_timing(1, 1.3, 0.3)
  assert policy.choose(['c', 'd'])[0] == 0          # a new batch: scored again


def test_stale_k1_host_seconds_move_halfway_to_k0s():
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  policy.round_timing(1, 1.5, 0.5)
  for _ in range(GoodputK.STALE_ROUNDS):
    policy.round_timing(0, 1.0, 0.1)
  assert policy.host.median(1) == pytest.approx(0.3)
  policy.round_timing(1, 1.5, 0.5)                  # padded with the carried 0.3: [0.5, 0.3, 0.3]
  assert policy.host.median(1) == pytest.approx(0.3)


def test_repeated_k0_hold_checks_its_costs_every_few_rounds():
  policy = _policy(0.2, {0: 1.0, 1: 1.5})
  policy.rooms, policy.queued = [100, 100], 0
  assert policy.choose(IDS)[0] == 0
  rows = policy.rows
  assert policy.repeat(IDS, rows, 0) == (0, [0, 0])
  for _ in range(GoodputK.PRIOR_ROUNDS):            # a slow stretch: K = 0 rounds cost 3x
    policy.round_timing(0, 3.0, 0.0)
  for _ in range(GoodputK.CHECK_EVERY - 2):         # not checked until the hold's next check
    assert policy.repeat(IDS, rows, 0) == (0, [0, 0])
  assert policy.repeat(IDS, rows, 0) is None


def test_an_engines_first_round_of_each_kind_is_not_timed():
  """An engine's first live round at K = 0 and at K >= 1 are cold (slower on device and host
  than the rounds after them): with `cold_rounds` 1 they price nothing."""
  policy = _policy(0.5, {0: 1.0, 1: 1.5}, cold_rounds=1)
  policy.round_timing(1, 6.0, 0.9)                  # cold: neither the ratio nor h moves
  policy.round_timing(0, 3.0, 0.9)
  assert policy.costs == pytest.approx({0: 1.0, 1: 1.5}) and policy.host.median(0) is None
  assert policy.host.median(1) is None
  policy.round_timing(0, 1.0, 0.1)                  # warm rounds count
  policy.round_timing(1, 1.5, 0.2)
  assert policy.host.median(0) == pytest.approx(0.1) and policy.host.median(1) == pytest.approx(0.2)
  with pytest.raises(ValueError, match='cold_rounds must be an int >= 0, got -1'):
    GoodputK(cold_rounds=-1)


def test_the_first_rounds_after_a_switch_to_k1_are_not_timed():
  """The first `switch_rounds` rounds of a K >= 1 stretch that follows K = 0 rounds run slower
  than the stretch's later ones (cold draft weights and step): they price nothing, in d(K) or
  h(K); a stretch the engine starts with, and K = 0 rounds after K >= 1 ones, count at once."""
  policy = _policy(0.5, {0: 1.0, 1: 1.5}, switch_rounds=2)
  policy.round_timing(1, 1.5, 0.2)                  # no K = 0 round before it: counts
  assert policy.host.median(1) == pytest.approx(0.2)
  policy.round_timing(0, 1.0, 0.1)                  # K = 0 after K >= 1: counts
  assert policy.host.median(0) == pytest.approx(0.1)
  before = policy.live.table(None)
  policy.round_timing(1, 6.0, 0.9)                  # the stretch's first two: not timed
  policy.round_timing(1, 6.0, 0.9)
  assert policy.live.table(None) == before and policy.host.median(1) == pytest.approx(0.2)
  policy.round_timing(1, 3.0, 0.4)                  # the third and later count
  assert policy.host.median(1) == pytest.approx(0.3)
  policy.round_timing(1, 3.0, 0.4)
  assert policy.live.table(None)[1] == pytest.approx(3.0)    # the median ratio of 1, 2, 2
  with pytest.raises(ValueError, match='switch_rounds must be an int >= 0, got -1'):
    GoodputK(switch_rounds=-1)


def test_a_switch_to_k1_is_priced_with_what_its_first_rounds_cost_beyond_steady_ones():
  """Those first rounds price nothing in d(K) and h(K), but their excess over t(K) is measured
  (`LiveCosts.switch_s`, the median over switches) and a K >= 1 choice after K = 0 rounds pays
  it once with the catch-up (`once_s`); right after K >= 1 rounds it pays neither."""
  policy = _policy(0.5, {0: 1.0, 1: 1.3}, switch_rounds=2)
  assert policy.choose(IDS)[0] == 1                 # 1.5 tokens / 1.3 s against 1 / 1 s
  policy.round_timing(0, 1.0, 0.0)
  assert policy.live.switch_s == 0.0 and policy.once_s == 0.0     # none measured yet
  policy.round_timing(1, 2.3, 0.0)                  # a switch: 1.0 beyond t(1) = 1.3
  policy.round_timing(1, 1.6, 0.0)                  # and 0.3 more
  assert policy.live.switch_s == pytest.approx(1.3)
  assert policy.once_s == 0.0                       # the draft in step: nothing to pay
  policy.round_timing(1, 1.3, 0.0)                  # a steady round: no sample
  policy.round_timing(0, 1.0, 0.0)
  policy.round_timing(1, 1.4, 0.0)                  # a stretch of one round: 0.1 beyond
  policy.round_timing(0, 1.0, 0.0)
  policy.round_timing(1, 1.8, 0.0)
  policy.round_timing(1, 1.8, 0.0)                  # 1.0 beyond
  assert policy.live.switch_s == pytest.approx(1.0)               # median of 1.3, 0.1, 1.0
  policy.round_timing(0, 1.0, 0.0)
  policy.sync_s = 0.05                              # the catch-up alone would leave K = 1 ahead
  assert policy.once_s == pytest.approx(1.05)       # catch-up and switch, once
  assert policy.choose(IDS)[0] == 0                 # 1.5 / (1.3 + 1.05) loses to K = 0
  policy.rooms, policy.queued = [8, 8], 0           # the makespan's horizon prices it too
  scores = policy._scores(np.array([0.5, 0.5]), np.full((2, 1), 0.5))
  policy.live._switches.clear()
  policy.live._switch_median = None
  assert policy._scores(np.array([0.5, 0.5]), np.full((2, 1), 0.5))[1] == pytest.approx(
      16 / (16 / scores[1] - 1.0))                  # 1.0 s less once without the switch


def test_a_switch_with_a_cold_round_is_left_out_and_new_tables_drop_the_switches():
  policy = _policy(0.5, {0: 1.0, 1: 1.3}, switch_rounds=2, cold_rounds=1)
  policy.round_timing(0, 1.0, 0.0)                  # cold: uncounted
  policy.round_timing(0, 1.0, 0.0)
  policy.round_timing(1, 9.0, 0.0)                  # the first K = 1 round is cold: spoiled
  policy.round_timing(1, 2.3, 0.0)
  assert policy.live.switch_s == 0.0
  policy.round_timing(0, 1.0, 0.0)
  policy.round_timing(1, 2.3, 0.0)
  policy.round_timing(1, 1.3, 0.0)
  assert policy.live.switch_s == pytest.approx(1.0)
  policy.set_costs({0: 1.0, 1: 1.3})
  assert policy.live.switch_s == 0.0


@pytest.mark.parametrize('kwargs, message', [
    (dict(tracker='abc'), "tracker must be an AlphaTracker, got 'abc'"),
    (dict(costs='abc'), r"costs must be a \{K: seconds\} mapping, got 'abc'"),
    (dict(costs=[1.0, 2.0]), r'costs must be a \{K: seconds\} mapping, got \[1.0, 2.0\]'),
])
def test_goodput_arguments_of_the_wrong_type_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    GoodputK(**kwargs)
  policy = GoodputK()
  policy.setup(2)
  with pytest.raises(ValueError, match='a cost table must be a'):
    policy.set_costs({0: 1.0, 1: 1.2, 2: 1.4}, by_rows={1: 'abc'})


def test_repeated_k1_hold_rides_out_finishes_and_admissions_from_the_queue():
  """A held K >= 1 choice is repeated without gathering the horizon for SPEC_HOLD_ROUNDS while
  its row bucket is unchanged, the batch changed only by finishes and by admissions of requests
  that were queued at the choice, some room stays >= K + 2 and, with requests waiting, no two
  rooms are equal unless the choice priced a split."""
  policy = _policy(0.9, {0: 1.0, 1: 1.2})
  policy.rooms, policy.queued, policy.slots = [20, 21], 0, 2
  assert policy.choose(IDS)[0] == 1
  rows = policy.rows
  assert policy.repeat(IDS, rows, 0, [20, 21]) == (1, [1, 1])
  assert policy.repeat(['a', 'c'], rows, 0, [20, 21]) is None       # 'c' was not queued
  assert policy.repeat(IDS, rows, 1, [20, 21]) is None              # an arrival
  assert policy.repeat(IDS, rows, 0, [2, 2]) is None                # every room below K + 2
  assert policy.repeat(IDS, rows, 0, None) is None                  # rooms not known
  assert policy.repeat(IDS, 4, 0, [20, 21]) is None                 # another row bucket
  assert policy.repeat(IDS, rows, 0, [20, 2]) == (1, [1, 1])        # one room leaves K + 1 free
  assert policy.repeat(IDS, rows, 0, [9, 9]) == (1, [1, 1])         # nothing waits: no split
  for _ in range(GoodputK.SPEC_HOLD_ROUNDS - 4):        # (refused repeats do not count)
    assert policy.repeat(IDS, rows, 0, [20, 21]) == (1, [1, 1])
  assert policy.repeat(IDS, rows, 0, [20, 21]) is None              # the hold is used up
  policy.rooms, policy.queued = [10, 12], 4                         # requests wait
  assert policy.choose(['e', 'f'])[0] == 1
  assert policy.repeat(['e', 'f'], rows, 4, [9, 11]) == (1, [1, 1])
  assert policy.repeat(['e', 'f'], rows, 4, [9, 9]) is None         # equal rooms: rescored
  assert policy.repeat(['f'], rows, 4, [8]) == (1, [1])             # 'e' done, 'g' prefilling
  assert policy.repeat(['f', 'g'], rows, 3, [7, 30]) == (1, [1, 1])   # 'g' came from the queue
  assert policy.repeat(['g', 'h'], rows, 3, [29, 30]) is None       # 'h' too, queue still 3
  policy.split_s, policy.queued = 0.01, 4                           # a choice that priced a split
  assert policy.choose(['p', 'q'])[0] == 1
  assert policy.repeat(['p', 'q'], rows, 4, [9, 9]) == (1, [1, 1])
  policy.split_s, policy.slots = 0.0, 1                             # one slot: its own K each
  assert policy.choose(['r'])[0] == 1
  assert policy.repeat(['s'], rows, 3, [20]) is None
  policy.slots, policy.queued = 2, None                             # queue unknown: the same
  assert policy.choose(['t', 'u'])[0] == 1                          # batch only
  assert policy.repeat(['t', 'u'], rows, None, [20, 21]) == (1, [1, 1])
  assert policy.repeat(['u'], rows, None, [20]) is None


def test_k0_host_seconds_never_exceed_k1s():
  """K = 0 rounds measured slow (cold) and then never run again while the policy speculates
  must not keep K = 0 priced above a K >= 1 round's host work."""
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  for _ in range(2):
    policy.round_timing(0, 1.0, 0.4)
  for _ in range(3):
    policy.round_timing(1, 1.5, 0.2)
  assert policy.host.median(0) == pytest.approx(0.4)
  assert policy.host.of(0) == pytest.approx(0.2) and policy.host.of(1) == pytest.approx(0.2)


@pytest.mark.parametrize('device_s, host_s',
                         [(float('nan'), 0.1), (1.0, float('inf')), (-1.0, 0.1)])
def test_round_times_must_be_finite_and_non_negative(device_s, host_s):
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  with pytest.raises(ValueError, match='round times must be finite seconds >= 0'):
    policy.round_timing(0, device_s, host_s)
  assert policy.host.median(0) is None           # nothing recorded


def test_admitted_only_counts_new_requests_against_the_queue_shrinking():
  assert holds.admitted_only(('a', 'b'), 3, ['b', 'c'], 2)           # 'a' done, 'c' admitted
  assert holds.admitted_only(('a', 'b'), 3, ['b'], 3)                # 'a' done, 'c' prefilling
  assert not holds.admitted_only(('a', 'b'), 3, ['b', 'c'], 3)       # 'c' came from nowhere
  assert not holds.admitted_only(('a', 'b'), 3, ['a', 'b'], 4)       # an arrival
  assert not holds.admitted_only(('a', 'b'), None, ['a', 'b'], None)  # queue unknown


def test_each_row_bucket_scales_its_own_table():
  """A round's live / start-up ratio prices its own row bucket's table: a batch's tail rounds of
  one row (overhead-bound, ~1.8x their idle time at B = 4 against ~1.3x for full rounds on the
  development CPU) leave the full batch's d(K) alone. Pooled, goodput's K = 0 ratio came from
  little else than tail rounds while it speculated, and its full-batch K >= 1 rounds were priced
  20-25 % too cheap against K = 0."""
  policy = _policy(0.5, {0: 1.0, 1: 1.5, 2: 2.0}, k_max=2)
  policy.set_costs({0: 1.0, 1: 1.5, 2: 2.0}, by_rows={1: {0: 0.5, 1: 0.8, 2: 1.0},
                                                      4: {0: 1.0, 1: 1.5, 2: 2.0}})
  live = policy.live
  assert live.bucket(None) == live.bucket(4) == live.bucket(3) == 4 and live.bucket(1) == 1
  for _ in range(3):
    policy.rows = 1
    policy.round_timing(0, 0.9, 0.0)                # 1.8x the 1-row table
    policy.rows = 4
    policy.round_timing(0, 1.3, 0.0)                # 1.3x the full batch's
  assert live.group_ratios() == live.group_ratios(4) == pytest.approx((1.3, 1.3))
  assert live.group_ratios(1) == pytest.approx((1.8, 1.8))
  assert live.table(None) == pytest.approx({0: 1.3, 1: 1.95, 2: 2.6})
  assert live.table(1) == pytest.approx({0: 0.9, 1: 1.44, 2: 1.8})
  policy.rows = 4
  for _ in range(3):                                # K >= 1 rounds of the full batch
    policy.round_timing(2, 2.4, 0.0)
  assert live.group_ratios() == pytest.approx((1.3, 1.2))
  assert live.group_ratios(1) == pytest.approx((1.8, 1.8))      # no K >= 1 round of its own


def test_one_given_table_pools_every_bucket():
  """A cost table given to the policy (no start-up table per bucket) serves every row bucket, so
  their rounds share one ratio."""
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  live = policy.live
  assert live.bucket(1) is None and live.bucket(None) is None
  for rows, seconds in ((1, 1.8), (2, 1.2), (1, 1.8)):
    policy.rows = rows
    policy.round_timing(0, seconds, 0.0)
  assert live.group_ratios(2) == live.group_ratios() == pytest.approx((1.8, 1.8))


def test_staleness_carries_the_full_batchs_quotient_only_from_its_own_rounds():
  """After `STALE_ROUNDS` rounds in a row at K = 0 every bucket's K >= 1 ratios are dropped; the
  quotient carried into the K >= 1 pseudo-rounds is the full batch's, and only when the full
  batch ran K >= 1 rounds of its own (a tail bucket's alone leave the carried one as it was)."""
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  policy.set_costs({0: 1.0, 1: 1.5}, by_rows={1: {0: 0.5, 1: 0.75}, 4: {0: 1.0, 1: 1.5}})
  live = policy.live

  def stretch(spec_rows):         # three K >= 1 rounds at 1.6x, then K = 0 rounds at 1.0x
    policy.rows = spec_rows
    for _ in range(3):
      policy.round_timing(1, 1.6 * live.idle[spec_rows][1], 0.0)
    policy.rows = 4
    for _ in range(live.STALE_ROUNDS):
      policy.round_timing(0, 1.0, 0.0)
  stretch(4)
  assert live.group_ratios() == pytest.approx((1.0, np.sqrt(1.6)))   # sqrt(1.6 / 1.0)
  assert live.group_ratios(1) == pytest.approx((1.0, np.sqrt(1.6)))  # carried to every bucket
  stretch(1)                      # the tail's K >= 1 rounds: dropped, the quotient kept
  assert live.group_ratios() == pytest.approx((1.0, np.sqrt(1.6)))
  assert live.group_ratios(1) == pytest.approx((1.0, np.sqrt(1.6)))


def test_a_hold_watches_its_own_buckets_ratios():
  """A K = 0 choice held for a one-row round is checked against that bucket's live ratios: the
  full batch's rounds slowing K = 0 alone do not end it."""
  policy = _policy(0.1, {0: 1.0, 1: 1.5, 2: 1.9})
  policy.set_costs({0: 1.0, 1: 1.5, 2: 1.9}, by_rows={1: {0: 0.5, 1: 0.8, 2: 1.0},
                                                      2: {0: 1.0, 1: 1.5, 2: 1.9}})
  calls = []
  scores = policy._scores
  policy._scores = lambda *a: calls.append(1) or scores(*a)
  policy.rooms, policy.queued, policy.rows = [1000], 1, 1
  assert policy.choose(['a'])[0] == 0 and len(calls) == 1
  policy.rows = 2
  for _ in range(3):                            # the full batch's K = 0 rounds 2x slower
    policy.round_timing(0, 2.0, 0.0)
  policy.rows = 1
  for _ in range(GoodputK.CHECK_EVERY):
    assert policy.repeat(['a'], 1, 1, [1000]) == (0, [0])
  assert len(calls) == 1
