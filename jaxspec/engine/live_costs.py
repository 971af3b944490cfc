"""What the goodput K policy (`jaxspec.engine.goodput`) measures while the engine runs, host
side: medians over a window of recent rounds, padded with a prior while there are few of them
(`padded_median`), the host seconds per round of each kind of round (`HostSeconds`), and the
least-squares non-decreasing fit of a cost table (`nondecreasing`)."""

from __future__ import annotations

import collections
import statistics
from typing import Optional, Sequence


def padded_median(samples, prior: float, rounds: int) -> float:
  """The median of `samples` padded with copies of `prior` up to `rounds` values."""
  return statistics.median(list(samples) + [prior] * max(0, rounds - len(samples)))


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
    measured while the policy speculates, so it keeps whatever its last rounds measured: at
    B = 2 on the development CPU the warm-up pass's cold rounds (~420 us where ~130 us is
    usual) priced K = 0 rounds 13 % too dear, and goodput speculated where it lost."""
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
