"""Memory mappings that engines of different shapes leave behind in one process (CPU).

    python scripts/memory_mappings.py [--slots 2,3,4] [--pages 16,32,64] [--k 0]

For each (slots, pages) pair in turn: clear JAX's caches, build a test-tiny `Engine` of that
shape, run one request of 5 prompt tokens and 4 new tokens, drop the engine, collect garbage and
count the process's mappings (/proc/PID/maps). The difference is what one engine compiled from
nothing keeps: JAX's jit caches hold its steps for the process's life. Engines built one after
another without clearing share the executables whose shapes they share (e.g. those that depend
only on the pool size), so this is what each engine costs when it shares none. `--k 4` gives each
engine test-tiny as its own draft (K = 4). Prints each engine's count, how many such engines
would reach the kernel's vm.max_map_count, and the count after a final `jax.clear_caches()`. The
README's counts per engine come from this script (default and `--k 4`). Linux only; `Engine`
clears the caches itself past half the limit (`jaxspec.executables.release_near_limit`), and
this script stays far below it.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax

from jaxspec.decoding.generate import MAX_K
from jaxspec.engine import Engine
from jaxspec.executables import memory_mappings
from jaxspec.models import ModelConfig
from jaxspec.training import init_params


def _ints(text: str, flag: str, minimum: int) -> list[int]:
  """A comma-separated list of distinct ints >= minimum (ValueError naming the flag otherwise)."""
  try:
    values = [int(x) for x in text.split(',') if x.strip()]
  except ValueError:
    values = []
  if not values or min(values) < minimum or len(set(values)) < len(values):
    raise ValueError(f'{flag} takes distinct comma-separated ints >= {minimum}, got {text!r}')
  return values


def _held() -> int:
  """Mappings this process holds after a garbage collection."""
  gc.collect()
  return memory_mappings()[0]


def _span(low: int, high: int) -> str:
  """'low-high', or 'low' when they are equal."""
  return f'{low}' if low == high else f'{low}-{high}'


def main():
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--slots', default='2,3,4', help='slot counts B, comma-separated')
  parser.add_argument('--pages', default='16,32,64', help='pool sizes in pages, comma-separated')
  parser.add_argument('--k', type=int, default=0, help='K (0: no draft; else a self-draft)')
  args = parser.parse_args()
  slots = _ints(args.slots, '--slots', 1)
  pages = _ints(args.pages, '--pages', 4)       # 4-token pages: a request spans 3 of them
  k = args.k
  if not 0 <= k <= MAX_K:
    raise ValueError(f'--k: speculation length K must be in [0, {MAX_K}], got {k}')
  if memory_mappings() is None:
    raise ValueError('this count needs /proc/PID/maps and /proc/sys/vm/max_map_count (Linux)')
  config = ModelConfig.from_name('test-tiny')
  params = init_params(config, 0)
  draft = dict(draft=config, draft_params=params, k=k) if k else {}
  limit = memory_mappings()[1]
  start = _held()
  print(f'test-tiny engines, one request each (5 prompt tokens, 4 new), K = {k}; '
        f'{start} mappings at the start, limit {limit}')
  kept = []
  for b in slots:
    for p in pages:
      jax.clear_caches()                      # compiled from nothing: nothing shared
      before = _held()
      engine = Engine(config, params, num_slots=b, num_pages=p, page_size=4, chunk_size=4, **draft)
      engine.add_request([3, 1, 4, 1, 5], max_tokens=4)
      engine.run()
      del engine
      kept.append(_held() - before)
      print(f'  {b} slots, {p:3d} pages: {kept[-1]:5d} mappings kept')
  low, high = min(kept), max(kept)
  print(f'per engine: {_span(low, high)} mappings, so '
        f'{_span(limit // max(high, 1), limit // max(low, 1))} engines that share no executables '
        f'reach the limit of {limit}')
  total = _held()
  jax.clear_caches()
  print(f'after jax.clear_caches(): {_held()} mappings (before: {total})')


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
