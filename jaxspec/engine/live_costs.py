"""What the goodput K policy (`jaxspec.engine.goodput`) measures while the engine runs, host
side: a decode round's cost t(K) = d(K) + h(K) kept up to date from live rounds (`LiveCosts`),
the host seconds per round of each kind of round (`HostSeconds`), medians over a window of
recent rounds, padded with a prior while there are few of them (`padded_median`), how much
slower a kind of call runs live than its start-up table (`LiveRatio`), a cost table checked
(`checked_table`), the least-squares non-decreasing fit of a cost table (`nondecreasing`) and
the line through a measured table's K >= 2 entries (`line_through`)."""

from __future__ import annotations

import collections
import math
import numbers
import statistics
from typing import Mapping, Optional, Sequence


def padded_median(samples, prior: float, rounds: int) -> float:
  """The median of `samples` padded with copies of `prior` up to `rounds` values."""
  return statistics.median(list(samples) + [prior] * max(0, rounds - len(samples)))


def checked_table(table, candidates) -> dict:
  """{K: float seconds} of a cost table `table` for every K in `candidates`.

  Raises:
    ValueError: a table that is not a mapping, misses a candidate or has a time that is not a
      finite number > 0 (named).
  """
  if not isinstance(table, Mapping):
    raise ValueError(f'a cost table must be a {{K: seconds}} mapping, got {table!r}')
  missing = [k for k in candidates if k not in table]
  if missing:
    raise ValueError(f'cost table {dict(table)} misses K in {missing}')
  bad = {k: t for k, t in table.items() if isinstance(t, bool) or
         not (isinstance(t, numbers.Real) and math.isfinite(t) and t > 0)}
  if bad:
    raise ValueError(f'cost table times must be finite and > 0 seconds, got {bad}')
  return {k: float(table[k]) for k in candidates}


class LiveRatio:
  """How much slower a kind of call runs live than its start-up table says: the median of the
  last `window` (live seconds / table seconds) ratios, padded with 1.0 up to min(3, window)
  values (`value`, 1.0 before any). A median, so one call that recompiled (after
  `jax.clear_caches()`, e.g. by `jaxspec.executables.release_near_limit`) or met a pause does
  not price every later call hundreds of times too high, as an exponential average of its
  seconds-long ratio did. Used for a lazy draft's catch-ups (`DraftSync`) and the prefill calls
  that price a split (`speculation.horizon`): live calls run after other calls that pushed their
  data out of the CPU's caches, and the table times them back to back."""

  def __init__(self, window: int = 8):
    self._ratios = collections.deque(maxlen=max(1, int(window)))
    self._pad = min(3, self._ratios.maxlen)
    self.value = 1.0

  def add(self, seconds: float, table_s: float) -> None:
    """Count one live call of `seconds` whose table estimate was `table_s` (skipped unless both
    are finite and > 0)."""
    if 0 < table_s < math.inf and 0 < seconds < math.inf:
      self._ratios.append(seconds / table_s)
      self.value = padded_median(self._ratios, 1.0, self._pad)


def nondecreasing(values: Sequence[float]) -> list:
  """The least-squares non-decreasing fit of `values` (isotonic regression, pool adjacent
  violators): runs that decrease are replaced by their mean."""
  blocks = []                                    # [sum, count] per pooled block
  for v in values:
    blocks.append([v, 1])
    while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
      s, n = blocks.pop()
      blocks[-1][0] += s
      blocks[-1][1] += n
  return [s / n for s, n in blocks for _ in range(n)]


LINE_POINTS = 5   # K >= 2 entries `line_through` needs to fit a line (fewer: kept as timed)
LINE_FIT = 0.1    # the median relative distance of the entries from it, at most


def line_through(table: dict) -> dict:
  """A cost table {K: seconds of one decode round} with its K >= 2 entries replaced by the
  Theil-Sen line through them (Theil 1950, Sen 1968: slope the median of the pairwise slopes,
  here at least 0; intercept the median of seconds - slope x K). K = 0 and K = 1 are kept as
  timed; so is a table with a K >= 2 entry that is not a positive number (left for
  `GoodputK.set_costs` to refuse, as it refuses a bad K = 0 or K = 1 entry); so is a table
  with fewer than `LINE_POINTS` K >= 2 entries (with four, one entry far off at an end tilts the
  median line) or whose entries are not close to a line (their median relative distance from
  it above `LINE_FIT`: a device whose rounds stay memory-bound up to some K, flat and then
  rising, is better priced as timed), and so is any
  entry whose line value would not exceed K = 0's time (a K >= 1 round does all a K = 0 round
  does and more) or 0.

  A round at K runs K draft steps and one verify of K + 1 tokens per row, so its cost is close
  to a + b K; each timed entry carries its own noise (the fastest of a few calls on a shared
  machine), and one entry timed too fast made the goodput policy run that K (B = 2 on the
  development CPU: one warm-up timed K = 2 at 1.56x and K = 5 at 2.13x K = 0's where K = 3 took
  1.88x and K = 6 2.72x, and the policy ran K = 2 and K = 5 for whole passes; B = 4: one put
  K = 2 at 1.38x, barely above K = 1's 1.34x, where six others timed 1.71-1.87x and 1.39-1.55x,
  and the policy ran K = 2 at 0.8-0.9 of K = 0's tokens/s). The median line ignores one such
  entry among five or more. K = 1 is not on that line: the draft's K steps are one `lax.scan`,
  which XLA compiles to a while loop for K >= 2 and to straight-line code for one step, so a
  K = 1 round skips the loop's cost. In the batching study's records (docs/batching, 2026-12-07)
  the line through K >= 1 priced K = 1 at a median 1.144x its timed cost at B = 1 (39 tables,
  up to 1.58x), 1.025x at B = 2, 1.010x at B = 4 and 1.064x at B = 8, and K = 2 and K = 8 at
  medians within ~4 % of theirs; static K = 1's live rounds cost what its timed entry said
  (docs/adaptive_k.md, *K = 1 off the line*)."""
  ks = sorted(k for k in table if k >= 2)
  if len(ks) < LINE_POINTS or not all(
      isinstance(table[k], numbers.Real) and table[k] > 0 for k in ks):
    return dict(table)
  slopes = [(table[b] - table[a]) / (b - a) for i, a in enumerate(ks) for b in ks[i + 1:]]
  slope = max(0.0, statistics.median(slopes))
  intercept = statistics.median(table[k] - slope * k for k in ks)
  if statistics.median(abs(table[k] - intercept - slope * k) / table[k] for k in ks) > LINE_FIT:
    return dict(table)
  floor = max(table.get(0, 0.0), 0.0)
  return {k: (intercept + slope * k if k >= 2 and intercept + slope * k > floor else t)
          for k, t in table.items()}


class HostSeconds:
  """h(K), the host seconds of a decode round besides its device call (scheduling, tables, the
  K choice, proposals, emitting): the median of the last `window` rounds of its group, K = 0
  (group 0) or K >= 1 (group 1), the other group's while it has none (0 before any round), and
  h(0) never above h(K >= 1) (`of`).

  A median, because one round's host time can be many times the usual (a garbage collection,
  an engine's first rounds). After `stale` (the policy stayed at K = 0 for long) group 1's
  rounds are dropped and the value halfway between the two medians is carried as
  `prior_rounds` pseudo-rounds until new rounds replace it.

  Args:
    window: rounds per group (>= 1); prior_rounds: pseudo-rounds of a carried value (>= 1).
  """

  def __init__(self, window: int, prior_rounds: int):
    self._rounds = (collections.deque(maxlen=window), collections.deque(maxlen=window))
    self._prior_rounds = min(prior_rounds, window)
    self._prior: Optional[float] = None     # group 1's carried value (after `stale`)
    self._medians: dict = {}                # {group: median} (lazily; dropped on a change)

  def add(self, k: int, seconds: float) -> None:
    """Record one round at K = k that spent `seconds` on the host."""
    group = min(k, 1)
    self._rounds[group].append(seconds)
    self._medians.pop(group, None)

  def set(self, group: int, seconds: float) -> None:
    """Make `seconds` the group's only round (and drop a carried value)."""
    self._rounds[group].clear()
    self.add(group, seconds)
    if group:
      self._prior = None

  def median(self, group: int) -> Optional[float]:
    """The group's median (padded with a carried value); None before any round or value."""
    if group not in self._medians:
      rounds = self._rounds[group]
      prior = self._prior if group else None
      if prior is not None:
        self._medians[group] = padded_median(rounds, prior, self._prior_rounds)
      else:
        self._medians[group] = statistics.median(rounds) if rounds else None
    return self._medians[group]

  def of(self, k: int) -> float:
    """h(k) in seconds: its group's median, else the other group's, else 0; h(0) at most
    h(K >= 1). A K >= 1 round does all a K = 0 round does and more, and the K = 0 group is not
    measured while the policy speculates, so it keeps whatever its last rounds measured (an
    engine's cold first rounds priced K = 0 rounds too dear at B = 2, and goodput speculated
    where it lost)."""
    zero, spec = self.median(0), self.median(1)
    if k:
      return spec if spec is not None else (zero or 0.0)
    if zero is None:
      return spec or 0.0
    return zero if spec is None else min(zero, spec)

  def stale(self) -> None:
    """Drop group 1's rounds, carrying the value halfway to group 0's median (nothing when
    either group has no rounds)."""
    spec, zero = self.median(1), self.median(0)
    if self._rounds[1] and zero is not None:
      self._prior = (spec + zero) / 2
      self._rounds[1].clear()
      self._medians.pop(1, None)


class LiveCosts:
  """t(K) = d(K) + h(K), what a decode round at K costs as the goodput K policy
  (`jaxspec.engine.goodput.GoodputK`) prices it, in seconds, kept up to date from the rounds
  the engine runs (host side).

  d(K) is the start-up table of the round's row bucket (`set_tables`: idle rows, timed at
  `warm_up`, its K >= 2 entries on their `line_through` line) times the median live / start-up
  ratio of the last `window` live rounds of its group, K = 0 or K >= 1, in that bucket
  (`bucket`, `group_ratios`), made non-decreasing in K (`table`). Live rounds pay what idle
  ones skip (a draft model's extra step after a fully accepted round) and the machine's speed
  drifts; one ratio shared by every K >= 1 keeps the table's ratios among them, and a median
  keeps one slow round from pricing a K out for good (a K not chosen is never measured again).
  Each bucket keeps its own ratios: a small call's fixed costs weigh more, so a batch's tail
  rounds of one row ran 1.72-1.84x their start-up table at B = 4 on the development CPU where
  full rounds ran 1.32-1.34x. Pooled, goodput's K = 0 ratio came almost only from such tail
  rounds while it speculated (its last round of each workload), climbed from 1.0 to 1.82 over
  six workload passes, and priced the full batch's K >= 1 rounds 20-25 % too cheap against
  K = 0 (t(2) / t(0) 1.25-1.40 where the table said 1.62; docs/adaptive_k.md, *Live ratios
  per row bucket*).
  Until a group has `PRIOR_ROUNDS` live rounds in a bucket (at most `window`), pseudo-rounds
  fill in: ratio 1 for K = 0, K = 0's ratio times the carried quotient for K >= 1. h(K) is
  `host` (`HostSeconds`, one for every bucket).

  The first `cold_rounds` live rounds of each group are not counted (an engine's first rounds
  are cold: slower, on device and host, than the rounds after them), nor the first
  `switch_rounds` rounds of each stretch at K >= 1 that follows K = 0 rounds (what they cost
  beyond steady rounds is kept apart, `switch_s`, for a switch's one-time cost): after K = 0
  rounds the draft's weights and the K >= 1 step are cold, and those rounds ran 10-30 % slower
  than the ones after them (B = 4 json on the development CPU: 13.9, 11.9, 11.4, 14.1 ms, then
  ~11.5, against ~11 for an engine that runs K = 2 every round); counted, four of them raised
  d(K >= 1) by a third and sent the policy back to K = 0 where K = 2 paid 1.1x. After `STALE_ROUNDS`
  rounds in a row at K = 0, K >= 1's ratios are dropped (in every bucket) and the square root
  of their quotient to K = 0's is carried, the full batch's when it ran K >= 1 rounds of its
  own (else the carried quotient stays as it was), and K >= 1's host seconds move halfway to
  K = 0's (`HostSeconds.stale`): while the policy stays at K = 0 only
  K = 0's ratio follows the machine, and K >= 1 rounds priced high by a slow stretch (several
  engines sharing the cores, a cold start) would otherwise keep K >= 1 out for good; but live
  K >= 1 rounds cost more against K = 0 than the start-up table says (B = 2 on the development
  CPU: 1.55-1.65x at K = 1 against a table's 1.33x), and forgetting that all at once made the
  policy leave K = 0, pay a catch-up and learn it again after every stretch at K = 0.

  Args:
    window: live rounds per group (>= 1); cold_rounds: uncounted first rounds per group (>= 0);
      switch_rounds: first rounds of a K >= 1 stretch after K = 0 rounds left out of d(K) and
      h(K), their excess measured as `switch_s` (>= 0).
  Attributes:
    idle: {rows: {K: seconds}} the start-up tables (rows None: the full batch's); tables: how
      many times they were set; host: the `HostSeconds`.
  """

  PRIOR_ROUNDS = 3
  STALE_ROUNDS = 16
  SWITCH_WINDOW = 8   # switches whose excess `switch_s` takes the median of

  def __init__(self, window: int, cold_rounds: int, switch_rounds: int = 2):
    self.cold_rounds, self.switch_rounds = cold_rounds, switch_rounds
    self.host = HostSeconds(window, self.PRIOR_ROUNDS)
    self.idle: dict = {}
    self.tables = 0
    self._window = window
    self._full = None                       # the full batch's bucket key (`bucket`)
    self._ratios: dict = {}                 # {bucket: (K = 0's, K >= 1's) live ratios}
    self._fitted: dict = {}                 # {rows: fitted d(K)} (lazily, per change)
    self._group: dict = {}                  # {bucket: `group_ratios`} (lazily)
    self._quotient = 1.0                    # K >= 1 / K = 0 ratio carried past staleness
    self._timed = [0, 0]                    # live rounds reported per group
    self._zero_rounds = 0                   # rounds at K = 0 since the last at K >= 1
    self._spec_rounds = 0                   # rounds at K >= 1 in a row (the current stretch)
    self._after_zero = False                # the current K >= 1 stretch followed K = 0 rounds
    self._switches = collections.deque(maxlen=self.SWITCH_WINDOW)   # `switch_s`'s samples
    self._switch_sum = None                 # the current stretch's excess so far (switching)
    self._switch_median = None              # `switch_s` (lazily, per sample)

  def set_tables(self, tables: dict) -> None:
    """Take the start-up tables {rows: {K: seconds}} (rows None: the full batch's; checked by
    the caller) and drop the live ratios measured against the old ones."""
    self.idle = tables
    self._full = max((r for r in tables if r is not None), default=None)   # `bucket`
    self._ratios.clear()
    self._switches.clear()
    self._switch_sum = self._switch_median = None
    self._quotient = 1.0
    self._moved()
    self.tables += 1

  def table(self, rows) -> dict:
    """The fitted d(K) {K: seconds} of row bucket `rows` (the full batch's if not measured)."""
    rows = rows if rows in self.idle else None
    if rows not in self._fitted:
      zero, spec = self.group_ratios(rows)
      idle = self.idle[rows]
      self._fitted[rows] = dict(zip(idle, nondecreasing(
          [t * (zero if k == 0 else spec) for k, t in idle.items()])))
    return self._fitted[rows]

  def bucket(self, rows):
    """The key under which the live ratios of rounds in row bucket `rows` are kept: `rows` if
    it has a start-up table of its own, else (rows None, or a bucket not timed) the full
    batch's: the largest timed bucket (`Engine.measure_costs` times the full batch's row
    before it sets any table), or None when only the full batch's table is known (a table given
    to the policy serves every bucket, and their rounds share one ratio)."""
    return rows if rows is not None and rows in self.idle else self._full

  def group_ratios(self, rows=None) -> tuple:
    """(K = 0's, K >= 1's) live / start-up ratio of row bucket `rows` (None: the full batch's;
    `bucket`): each group's median over that bucket's rounds, padded with pseudo-rounds up to
    PRIOR_ROUNDS (at most `window`: a group never holds more)."""
    key = self.bucket(rows)
    if key not in self._group:
      zero_ratios, spec_ratios = self._ratios.get(key, ((), ()))
      rounds = min(self.PRIOR_ROUNDS, self._window)
      zero = padded_median(zero_ratios, 1.0, rounds)
      self._group[key] = zero, padded_median(spec_ratios, zero * self._quotient, rounds)
    return self._group[key]

  def unit_s(self) -> float:
    """The start-up seconds of a full round at the smallest K in the tables."""
    full = self.idle[None]
    return full[min(full)]

  def add(self, k: int, rows, device_s: float, host_s: float) -> None:
    """Count one live round at K = k in row bucket `rows`: its device call and host seconds.

    Raises:
      ValueError: a time that is not a finite number >= 0 (one NaN would poison a median).
    """
    if not (0.0 <= device_s < math.inf and 0.0 <= host_s < math.inf):
      raise ValueError(f'round times must be finite seconds >= 0, got device_s={device_s!r}, '
                       f'host_s={host_s!r}')
    group = min(k, 1)
    self._timed[group] += 1
    idle = self.idle.get(rows, self.idle.get(None, {}))
    if group and not self._spec_rounds:      # a stretch at K >= 1 starts: after K = 0 rounds?
      self._after_zero = self._zero_rounds > 0
    switching = group and self._after_zero and self._spec_rounds < self.switch_rounds
    if switching:       # what the round cost beyond a steady one at its K (`switch_s`)
      measured = self._timed[group] > self.cold_rounds and k in idle
      extra = device_s + host_s - self.table(rows)[k] - self.host.of(k) if measured else math.nan
      self._switch_sum = (self._switch_sum or 0.0) + extra    # NaN: a cold round spoils it
    if self._switch_sum is not None and (not switching or
                                         self._spec_rounds + 1 >= self.switch_rounds):
      if not math.isnan(self._switch_sum):      # the switch's rounds are over (or cut short)
        self._switches.append(self._switch_sum)
        self._switch_median = None
      self._switch_sum = None
    if self._timed[group] > self.cold_rounds and not switching:
      self.host.add(k, host_s)
      if k in idle:
        key = self.bucket(rows)
        if key not in self._ratios:
          self._ratios[key] = tuple(collections.deque(maxlen=self._window) for _ in range(2))
        self._ratios[key][group].append(device_s / idle[k])
        self._moved()
    self._spec_rounds = self._spec_rounds + 1 if k else 0
    self._zero_rounds = self._zero_rounds + 1 if k == 0 else 0
    if self._zero_rounds == self.STALE_ROUNDS and any(r[1] for r in self._ratios.values()):
      if self._ratios.get(self._full, ((), ()))[1]:    # the full batch's own K >= 1 rounds
        zero, spec = self.group_ratios()
        self._quotient = math.sqrt(max(spec, 1e-9) / max(zero, 1e-9))
      for ratios in self._ratios.values():
        ratios[1].clear()
      self.host.stale()
      self._moved()

  @property
  def zero_rounds(self) -> int:
    """Rounds at K = 0 since the last at K >= 1 (or since the start)."""
    return self._zero_rounds

  @property
  def switch_s(self) -> float:
    """Seconds a switch from K = 0 rounds to K >= 1 costs beyond the steady rounds' t(K): the
    median over the last `SWITCH_WINDOW` such switches of what their first `switch_rounds`
    rounds took beyond t(K) of their K (d(K) + h(K) as priced then; a stretch cut short counts
    the rounds it ran, one with a cold round or a K not in the tables is left out), at least 0;
    0 before any (not measured with `switch_rounds` 0; dropped with the tables)."""
    if self._switch_median is None:
      self._switch_median = max(0.0, statistics.median(self._switches)) if self._switches else 0.0
    return self._switch_median

  def _moved(self) -> None:
    """Drop what was derived from the tables and ratios (refitted when next read)."""
    self._fitted.clear()
    self._group.clear()
