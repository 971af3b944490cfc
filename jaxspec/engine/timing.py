"""Timing device calls for the engine's cost tables (`Engine.step_costs`, the lazy draft's
catch-up costs): host side, wall clock."""

from __future__ import annotations

import time
from typing import Callable, Hashable, Mapping


def fastest(calls: Mapping[Hashable, Callable[[], object]], repeats: int) -> dict:
  """The fastest of `repeats` timed calls of each function, after one untimed call of each (it
  compiles). The functions are called in turn, round by round, so a drift in the machine's load
  hits every key alike; the minimum is kept because timing noise on a shared machine only adds.

  Args:
    calls: {key: function of no arguments that returns once its results are on the host}.
    repeats: timed calls per key (>= 1).
  Returns:
    {key: seconds}.
  Raises:
    ValueError: repeats not an int >= 1.
  """
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f'repeats must be an int >= 1, got {repeats!r}')
  times = {key: [] for key in calls}
  for r in range(repeats + 1):
    for key, call in calls.items():
      start = time.perf_counter()
      call()
      if r:
        times[key].append(time.perf_counter() - start)
  return {key: min(t) for key, t in times.items()}
