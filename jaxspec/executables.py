"""Compiled executables and the process's memory mappings.

JAX keeps every function it compiled in module-level caches for the process's life, and jaxspec's
jitted steps are module-level functions, so an `Engine` (or `generate` call) leaves its compiled
steps behind when it is dropped. On the CPU every live XLA executable holds memory mappings (~6
for a one-op function, hundreds for an engine step; `python scripts/memory_mappings.py` prints
what engines of several shapes leave), and once a process reaches the kernel's
`vm.max_map_count` (65,530 by default) XLA's next compile dies with a segmentation fault or an
abort, losing whatever the process had not written out. `jax.clear_caches()` frees them; the
functions here count the mappings and clear the caches before that limit.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from typing import Optional

import jax

from jaxspec.checks import check_real

MAX_MAP_COUNT = '/proc/sys/vm/max_map_count'

# `release_near_limit`'s default threshold, as a fraction of vm.max_map_count: one engine of the
# shipped models leaves at most a few thousand mappings, so half the limit leaves ample room to
# build and compile the next one.
NEAR_LIMIT = 0.5

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_jaxspec() -> int:
  """The stacklevel at which a warning issued in `release_near_limit` points at the innermost
  frame outside this package (the user's line, not jaxspec's)."""
  frame, level = sys._getframe(2), 2      # pylint: disable=protected-access
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
    frame, level = frame.f_back, level + 1
  return level


def memory_mappings() -> Optional[tuple[int, int]]:
  """(memory mappings this process holds, the kernel's per-process limit), or None where
  /proc/PID/maps or /proc/sys/vm/max_map_count cannot be read (not Linux).

  Costs one read of /proc/PID/maps: ~1 ms per thousand mappings on the development CPU (3 ms at
  3,400, 33 ms at 30,000).
  """
  try:
    with open(f'/proc/{os.getpid()}/maps') as maps, open(MAX_MAP_COUNT) as limit:
      return sum(1 for _ in maps), int(limit.read())
  except (OSError, ValueError):
    return None


def release_near_limit(fraction: Optional[float] = None, *, what: str = 'this process') -> bool:
  """Clear JAX's caches of compiled executables (`gc.collect()`, then `jax.clear_caches()`) if
  the process holds more than `fraction` of the kernel's memory-mapping limit.

  Functions compiled before then compile again at their next call (a few seconds for an engine
  step): correct, but a timed region that runs one measures the compile. It warns (RuntimeWarning)
  with the counts when it clears, so a benchmark's log shows why. `Engine` calls it when built.

  Args:
    fraction: the threshold in (0, 1] of vm.max_map_count; None: `NEAR_LIMIT` (read at the call).
    what: who asks, for the warning (e.g. 'Engine'); the warning points at the first line outside
      jaxspec that led here (e.g. the user's `Engine(...)`).
  Returns:
    Whether the caches were cleared (False off Linux, where nothing is counted).
  Raises:
    ValueError: fraction not a number in (0, 1].
  """
  fraction = check_real('fraction', NEAR_LIMIT if fraction is None else fraction, 0.0, 1.0,
                        low_open=True)
  counts = memory_mappings()
  if counts is None or counts[0] <= fraction * counts[1]:
    return False
  gc.collect()
  jax.clear_caches()
  after = memory_mappings()
  warnings.warn(
      f'{what}: {counts[0]} memory mappings held, past {fraction:g} of the kernel\'s limit of '
      f'{counts[1]} ({MAX_MAP_COUNT}), at which XLA\'s compiles crash; cleared JAX\'s compiled '
      f'executables ({after[0] if after else "?"} mappings left): functions compiled before this '
      f'compile again at their next call', RuntimeWarning, stacklevel=_outside_jaxspec())
  return True
