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
  """(memory mappings this process holds, the kernel's per-process limit), or None where they
  cannot be counted: /proc/PID/maps or /proc/sys/vm/max_map_count unreadable (not Linux), or a
  limit that is not a positive integer.

  Costs one read of /proc/PID/maps: ~1 ms per thousand mappings on the development CPU (3 ms at
  3,400, 33 ms at 30,000).
  """
  try:
    with open(f'/proc/{os.getpid()}/maps', 'rb') as maps:   # bytes: a mapped file's path
      held = sum(1 for _ in maps)                          # need not be UTF-8
    with open(MAX_MAP_COUNT, 'rb') as limit:
      text = limit.read().strip()
  except OSError:
    return None
  return (held, int(text)) if text.isdigit() and int(text) > 0 else None


_after_last_clear: Optional[int] = None   # mappings left by the last clear (None: none yet)


def release_near_limit(fraction: Optional[float] = None, *, what: str = 'this process') -> bool:
  """Clear JAX's caches of compiled executables (`gc.collect()`, then `jax.clear_caches()`) if
  the process holds more than `fraction` of the kernel's memory-mapping limit.

  Functions compiled before then compile again at their next call (a few seconds for an engine
  step): correct, but a timed region that runs one measures the compile, and so does any cost
  an engine learns from timed calls (its K policy's tables and ratios are medians, which one
  such call does not move). It warns (RuntimeWarning, pointing at the first line outside jaxspec
  that led here, e.g. the user's `Engine(...)`) with the counts when it clears, so a benchmark's
  log shows why. `Engine` calls it when built, after checking its arguments.

  When a clear leaves the process past the threshold (what holds the mappings is not JAX's:
  other libraries, mapped files), the next clear waits until the mappings have grown by half the
  room left below the limit, so that every new Engine does not throw away the compiled steps of
  the engines still in use; the warning says the clear freed too little.

  Args:
    fraction: the threshold in (0, 1] of vm.max_map_count; None: `NEAR_LIMIT` (read at the call).
    what: who asks, for the warning (e.g. 'Engine').
  Returns:
    Whether the caches were cleared (False where `memory_mappings` counts nothing).
  Raises:
    ValueError: fraction (or NEAR_LIMIT, when fraction is None) not a number in (0, 1].
  """
  global _after_last_clear
  name = 'NEAR_LIMIT' if fraction is None else 'fraction'
  fraction = check_real(name, NEAR_LIMIT if fraction is None else fraction, 0.0, 1.0,
                        low_open=True)
  counts = memory_mappings()
  if counts is None or counts[0] <= fraction * counts[1]:
    return False
  held, limit = counts
  floor = _after_last_clear
  if floor is not None and floor > fraction * limit and held <= floor + (limit - floor) / 2:
    return False                  # the last clear could not get below it; not grown enough since
  gc.collect()
  jax.clear_caches()
  after = memory_mappings()
  _after_last_clear = after[0] if after else None
  still = (f'; still past {fraction:g} of it: what holds them is not JAX\'s executables, and the '
           f'next clear waits until they grow by half the room left'
           if after and after[0] > fraction * limit else '')
  warnings.warn(
      f'{what}: {held} memory mappings held, past {fraction:g} of the kernel\'s limit of {limit} '
      f'({MAX_MAP_COUNT}), at which XLA\'s compiles crash; cleared JAX\'s compiled executables '
      f'({after[0] if after else "?"} mappings left{still}): functions compiled before this '
      f'compile again at their next call', RuntimeWarning, stacklevel=_outside_jaxspec())
  return True
