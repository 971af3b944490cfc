"""How much a warm-up cost table moves between timings on this machine: the goodput K policy's
start-up table d(K) is timed once (`Engine.warm_up`), and the K it picks among K >= 1 follows
the slope of the line through the table's K >= 1 entries (`live_costs.line_through`), which the
live rounds rescale but do not tilt.

    python scripts/cost_table_noise.py [--batch 2] [--tables 10] [--repeats 5] [--burst_load]

Builds the batching study's engines at B = --batch (`configs/batching.py`,
`experiments.batching.build_engines`: a K = 0 baseline and goodput at K_max = 8), then re-times
the goodput engine's decode rounds --tables times (`Engine.measure_costs(--repeats)`). Per table
it prints the full batch's row in units of its own K = 0 round and the line's slope (K = 0 rounds
per unit of K) and intercept; then their means and standard deviations. --burst_load runs a busy
loop in another process meanwhile, on for 20-300 ms and off for 20-300 ms at random, as other
work on a shared machine comes and goes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pathlib
import random
import statistics
import sys
import time

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import batching as batching_config
from experiments import batching
from experiments.speculative import load_pair
from jaxspec.checks import check_int
from jaxspec.engine.live_costs import line_through


def _bursts(seed: int) -> None:
  """Busy for 20-300 ms, idle for 20-300 ms, at random, until killed."""
  rng = random.Random(seed)
  while True:
    end = time.perf_counter() + rng.uniform(0.02, 0.3)
    while time.perf_counter() < end:
      pass
    time.sleep(rng.uniform(0.02, 0.3))


def line_of(table: dict) -> tuple:
  """(slope, intercept) of `line_through(table)`'s K >= 1 entries in units of table[0]; None
  where the table is kept as timed (fewer than 5 K >= 1 entries, or not close to a line)."""
  line = line_through(table)
  ks = sorted(k for k in table if k >= 1)
  if line == table or len(ks) < 2:
    return None
  slope = (line[ks[-1]] - line[ks[0]]) / (ks[-1] - ks[0])
  return slope / table[0], (line[ks[0]] - slope * ks[0]) / table[0]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument('--tables', type=int, default=10)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--burst_load', action='store_true')
  args = parser.parse_args(argv)
  for name in ('batch', 'tables', 'repeats'):
    check_int(f'--{name}', getattr(args, name), 1)
  config = batching_config.get_config()
  config.batch_size, config.settings = args.batch, 'k0=k:0;goodput=k:8,k_policy:goodput'
  batching.validate(config)
  target, target_params, draft, draft_params, _ = load_pair(config)
  engines = batching.build_engines(config, batching.parse_settings(config.settings), target,
                                   target_params, draft, draft_params)
  engine = engines['goodput'][0]
  load = None
  if args.burst_load:
    load = multiprocessing.Process(target=_bursts, args=(0,), daemon=True)
    load.start()
  try:
    lines = []
    for i in range(args.tables):
      start = time.perf_counter()
      table = dict(engine.measure_costs(args.repeats))
      fit = line_of(table)
      entries = ' '.join(f'{table[k] / table[0]:.2f}' for k in sorted(table))
      print(f'table {i}: {entries} (K = 0 {table[0] * 1e3:.2f} ms; '
            f'{time.perf_counter() - start:.1f} s)  ' +
            ('kept as timed' if fit is None else f'slope {fit[0]:.3f} intercept {fit[1]:.3f}'),
            flush=True)
      if fit is not None:
        lines.append(fit)
  finally:
    if load is not None:
      load.kill()
  if len(lines) >= 2:
    for name, values in (('slope', [s for s, _ in lines]), ('intercept', [c for _, c in lines])):
      print(f'{name}: mean {statistics.mean(values):.3f}, sd {statistics.pstdev(values):.3f} '
            f'over {len(values)} tables')


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
