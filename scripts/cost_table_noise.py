"""How much a warm-up cost table moves between timings on this machine: the goodput K policy's
start-up table d(K) is timed once (`Engine.warm_up`), and the K it picks among K >= 1 follows
the slope of the line through the table's K >= 2 entries (`live_costs.line_through`; K = 1 is
priced as timed), which the live rounds rescale but do not tilt.

    python scripts/cost_table_noise.py [--batch 2] [--tables 10] [--repeats 5] [--block 3]
        [--estimators ratios,min] [--burst_load]

Builds the batching study's engines at B = --batch (`configs/batching.py`,
`experiments.batching.build_engines`: a K = 0 baseline and goodput at K_max = 8), then re-times
the goodput engine's full-batch decode rounds --tables times per estimator, in turn
(`timing.decode_costs`, --repeats rounds of --block timed calls per K): `ratios` (the engine's:
each K >= 1 at its median ratio to K = 0 per round) and `min` (each K's own fastest call). Per
table it prints the row in units of its own K = 0 round and the line's slope (K = 0 rounds per
unit of K) and intercept; then per estimator the mean and standard deviation of c(1) =
t(1)/t(0), the slope and the intercept. --burst_load runs a busy loop in another process
meanwhile, on for 20-300 ms and off for 20-300 ms at random, as other work on a shared machine
comes and goes.
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
from jaxspec.engine import timing
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
  """(slope, intercept) of `line_through(table)`'s K >= 2 entries (the line's; K = 1 stays as
  timed) in units of table[0]; None where the table is kept as timed (fewer than 5 K >= 2
  entries, or not close to a line)."""
  line = line_through(table)
  ks = sorted(k for k in table if k >= 2)
  if line == table or len(ks) < 2:
    return None
  slope = (line[ks[-1]] - line[ks[0]]) / (ks[-1] - ks[0])
  return slope / table[0], (line[ks[0]] - slope * ks[0]) / table[0]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument('--tables', type=int, default=10)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--block', type=int, default=3)
  parser.add_argument('--estimators', default='ratios,min')
  parser.add_argument('--burst_load', action='store_true')
  args = parser.parse_args(argv)
  for name in ('batch', 'tables', 'repeats', 'block'):
    check_int(f'--{name}', getattr(args, name), 1)
  estimators = args.estimators.split(',')
  if not estimators or any(e not in ('ratios', 'min') for e in estimators):
    raise ValueError(f'--estimators must be a comma-separated list of ratios, min; got '
                     f'{args.estimators!r}')
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
  fits = {name: [] for name in estimators}
  try:
    for i in range(args.tables):
      for name in estimators:
        start = time.perf_counter()
        timed = timing.decode_costs(engine, args.repeats, (engine.num_slots,),
                                    ratios=name == 'ratios', block=args.block)
        table = {k: seconds for (_, k), seconds in timed.items()}
        fit = line_of(table)
        entries = ' '.join(f'{table[k] / table[0]:.2f}' for k in sorted(table))
        print(f'{name} table {i}: {entries} (K = 0 {table[0] * 1e3:.2f} ms; '
              f'{time.perf_counter() - start:.1f} s)  ' +
              ('kept as timed' if fit is None else f'slope {fit[0]:.3f} intercept {fit[1]:.3f}'),
              flush=True)
        fits[name].append((table[1] / table[0],) + (fit or (None, None)))
  finally:
    if load is not None:
      load.kill()
  for name, rows in fits.items():
    for j, what in enumerate(('c(1)', 'slope', 'intercept')):
      values = [row[j] for row in rows if row[j] is not None]
      if len(values) >= 2:
        print(f'{name} {what}: mean {statistics.mean(values):.3f}, '
              f'sd {statistics.pstdev(values):.3f} over {len(values)} tables')

if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
