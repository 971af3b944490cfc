"""Adaptive K against the best static setting across independent runs of the batching study.

    python -m experiments.batching_runs RUN_A/results.jsonl RUN_B/results.jsonl ... [--aim 0.95]
    python -m experiments.batching_runs RUN_A RUN_B ...      # run or sweep directories

Each path is one run (or one sweep: each batch size is its own run there), with fresh engines.
The passes of one run share its engines, their warm-up cost tables and where a policy's
estimates stand, so a run can settle in one regime for all its passes: runs differ by more than
the per-pass error `threshold.md` gives (two nine-pass runs of B = 2 code, same code, 40 minutes
apart on the development CPU: goodput 0.938 and 0.982 of the best static setting, per-pass
errors 0.012 and 0.004; docs/adaptive_k.md). An aim such as issue 6's ("within 5 % of the best
static setting at every batch size, so turning it on never loses") asks both for a policy's
expected fraction and for how often a single run, one deployment, falls short of it; only
independent runs measure either.

Per (B, workload, adaptive setting) it prints each run's fraction of the best static setting
(`batching_report.analyze`: mean tokens/s over that run's passes, the best static chosen in that
run), their mean, the standard deviation between runs and the standard error of the mean, and in
how many runs the fraction reached the aim.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys

from experiments.batching_report import analyze
from experiments.records import read_run


def across_runs(runs: list[list[dict]]) -> list[dict]:
  """The adaptive settings' fractions of the best static setting, run by run.

  Args:
    runs: each run's batching records (one results.jsonl each).
  Returns:
    [row per (B, workload, setting), sorted by them: 'fractions' (one per run that has the cell,
    in run order), 'mean', 'sd' (between runs; None with one run), 'se' (sd / sqrt(runs))].
  Raises:
    ValueError: a run whose records `analyze` refuses (several sweep cases of one cell).
  """
  cells = collections.defaultdict(list)
  for records in runs:
    for a in analyze(records)['adaptive']:
      cells[(a['batch_size'], a['workload'], a['setting'])].append(a['fraction_of_best_static'])
  rows = []
  for (b, workload, setting), fractions in sorted(cells.items()):
    sd = statistics.stdev(fractions) if len(fractions) > 1 else None
    rows.append(dict(batch_size=b, workload=workload, setting=setting, fractions=fractions,
                     mean=statistics.mean(fractions), sd=sd,
                     se=None if sd is None else sd / math.sqrt(len(fractions))))
  return rows


def table(rows: list[dict], aim: float) -> str:
  """The rows as markdown, with each cell's count of runs at or above `aim`."""
  def fmt(x):
    return '' if x is None else f'{x:.3f}'
  lines = ['| B | workload | setting | runs | per run | mean | sd | ± se | runs ≥ aim |',
           '|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    met = sum(f >= aim for f in r['fractions'])
    lines.append(f"| {r['batch_size']} | {r['workload']} | {r['setting']} | "
                 f"{len(r['fractions'])} | {' '.join(fmt(f) for f in r['fractions'])} | "
                 f"{fmt(r['mean'])} | {fmt(r['sd'])} | {fmt(r['se'])} | {met} |")
  return '\n'.join(lines) + '\n'


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('runs', nargs='+', help='results.jsonl files, or the run / sweep '
                      'directories holding them: one per independent run')
  parser.add_argument('--aim', type=float, default=0.95,
                      help='the fraction of the best static setting each run is held against')
  args = parser.parse_args(argv)
  if not 0 < args.aim <= 2:
    parser.error(f'--aim must be in (0, 2], got {args.aim}')
  runs = []
  for path in args.runs:
    try:
      runs.append(read_run(path)[1])       # a sweep's: its finished cases (`read_run`)
    except ValueError as error:
      parser.error(str(error))
  try:
    rows = across_runs(runs)
  except ValueError as error:
    parser.error(str(error))
  if not rows:
    print('No adaptive setting beside a static one in these records: nothing to compare.')
    return 1
  print(table(rows, args.aim), end='')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
