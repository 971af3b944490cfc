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
how many runs the fraction reached the aim. Each run is given once (a path naming a file given
before, e.g. a sweep directory and its results.jsonl, is refused).

    python -m experiments.batching_runs --tables docs/batching/*/*.jsonl.gz [--off 0.1]

With --tables it prints instead how far each adaptive engine's warm-up cost table stood from
its run's idle rounds (`table_errors`): c(1) = t(1) / t(0) of the table `warm_up` timed over
c(1) of the idle rounds the study timed with the settings interleaved (the static K = 1
setting's `idle_round_cost`), per engine (a sweep case's adaptive setting), their median and
10th / 90th percentiles, and the engines off by more than --off.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys

from experiments.batching_report import analyze
from experiments.records import read_run
from jaxspec.checks import check_real


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


def table_errors(runs: list[tuple[str, list[dict]]]) -> tuple[list[dict], list[str]]:
  """How far each adaptive engine's warm-up table stood from its run's idle rounds.

  An engine is a (run, sweep case, setting) of a non-fixed K policy with the draft model and
  `warmup_step_costs` for K = 0 and 1; its case's idle c(1) is the `idle_round_cost` of the
  case's static K = 1 setting with the draft model and no k_policy or drafter options (the
  study's `k1`; of several such, the one named `k1`, else the case is left out: records do not
  keep the other Engine options a setting may set, such as chunk_size).

  Args:
    runs: (name, records) of each run.
  Returns:
    (rows, left): a row per engine whose case has an idle c(1): 'run', 'case', 'batch_size',
    'setting', 'warm' (the table's t(1) / t(0)), 'idle' (the idle rounds' median ratio) and
    'quotient' (warm / idle), in run order; left: a line per case left out, and why.
  Raises:
    ValueError: a value used that is not a finite number > 0 (named with its run, case and
      setting).
  """
  def positive(name, r, field, value):
    return check_real(f"{name}: case {r.get('case_id')!r} setting {r.get('setting')!r}: "
                      f'{field}', value, 0.0, math.inf, low_open=True, high_open=True)

  rows, left = [], []
  for name, records in runs:
    idle, warm = collections.defaultdict(dict), {}
    for r in records:
      if r.get('drafter') != 'model':
        continue
      case = (r.get('case_id'), r.get('batch_size'))
      if r.get('k_policy') == 'fixed' and r.get('k') == 1 and \
          not r.get('k_policy_options') and not r.get('drafter_options') and \
          r.get('idle_round_cost') is not None:
        idle[case].setdefault(r.get('setting'),
                              positive(name, r, 'idle_round_cost', r['idle_round_cost']))
      costs = r.get('warmup_step_costs')
      if r.get('k_policy') != 'fixed' and isinstance(costs, dict) and '0' in costs and \
          '1' in costs and (case, r.get('setting')) not in warm:
        warm[case, r.get('setting')] = (
            positive(name, r, "warmup_step_costs['1']", costs['1']) /
            positive(name, r, "warmup_step_costs['0']", costs['0']))
    for case, settings in idle.items():
      if len(settings) > 1 and 'k1' not in settings:
        left.append(f'{name} case {case[0]!r}: static K = 1 settings {sorted(settings)}, '
                    f'none named k1')
    for (case, setting), c1 in warm.items():
      settings = idle.get(case, {})
      base = next(iter(settings.values())) if len(settings) == 1 else settings.get('k1')
      if base is not None:
        rows.append(dict(run=name, case=case[0], batch_size=case[1], setting=setting, warm=c1,
                         idle=base, quotient=c1 / base))
  return rows, left


def errors_table(rows: list[dict], off: float) -> str:
  """The text `--tables` prints: how many engines of how many files and cases, the median and
  10th / 90th percentiles of their quotients, and a line per engine off 1 by more than `off`.

  Args:
    rows: `table_errors` rows (at least one); off: a fraction, e.g. 0.1.
  Returns:
    The lines, each ending in a newline.
  Raises:
    ValueError: no rows.
  """
  if not rows:
    raise ValueError('errors_table needs at least one row')
  quotients = sorted(r['quotient'] for r in rows)
  files, cases = len({r['run'] for r in rows}), len({(r['run'], r['case']) for r in rows})
  lines = [f'{len(rows)} engines of {cases} case{"s" * (cases != 1)} in {files} '
           f'file{"s" * (files != 1)}: warm-up c(1) / idle c(1) median '
           f'{statistics.median(quotients):.3f}']
  if len(quotients) > 1:
    deciles = statistics.quantiles(quotients, n=10, method='inclusive')
    lines[0] += f', 10th-90th percentiles {deciles[0]:.3f}-{deciles[-1]:.3f}'
  far = [r for r in rows if abs(r['quotient'] - 1) > off]
  lines.append(f'{len(far)} off by more than {off * 100:g}%' + (':' if far else ''))
  lines += [f"  {r['run']} B = {r['batch_size']}"
            + ('' if r['case'] is None else f" (case {r['case']!r})")
            + f" {r['setting']}: warm-up c(1) {r['warm']:.3f}, idle {r['idle']:.3f}, "
            f"quotient {r['quotient']:.3f}" for r in far]
  return '\n'.join(lines) + '\n'


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
  parser.add_argument('--aim', type=float, default=None,
                      help='the fraction of the best static setting each run is held against '
                           '(default 0.95; not with --tables)')
  parser.add_argument('--tables', action='store_true',
                      help="instead of the fractions: each adaptive engine's warm-up c(1) = "
                           "t(1) / t(0) over its run's idle rounds (`table_errors`), their "
                           'median and deciles, and the engines off by more than --off')
  parser.add_argument('--off', type=float, default=None,
                      help='with --tables: list the engines whose quotient is off 1 by more '
                           'than this fraction, in (0, 1) (default 0.1)')
  args = parser.parse_args(argv)
  if args.tables and args.aim is not None:
    parser.error('--aim applies to the fractions, not to --tables')
  if not args.tables and args.off is not None:
    parser.error('--off applies to --tables only')
  aim = 0.95 if args.aim is None else args.aim
  off = 0.1 if args.off is None else args.off
  if not 0 < aim <= 2:
    parser.error(f'--aim must be in (0, 2], got {aim}')
  if not 0 < off < 1:
    parser.error(f'--off must be in (0, 1), got {off}')
  runs, files = [], {}
  for path in args.runs:
    try:
      file, records, _ = read_run(path)    # a sweep's: its finished cases (`read_run`)
    except ValueError as error:
      parser.error(str(error))
    if file.resolve() in files:
      parser.error(f'{path!r} is the run {files[file.resolve()]!r} again: give each run once')
    files[file.resolve()] = path
    runs.append(records)
  if args.tables:
    try:
      errors, left = table_errors(list(zip(args.runs, runs)))
    except ValueError as error:
      parser.error(str(error))
    for line in left:
      print(f'left out: {line}')
    if not errors:
      print('No adaptive engine with a warm-up table beside a static K = 1 setting: nothing '
            'to compare.')
      return 1
    print(errors_table(errors, off), end='')
    return 0
  try:
    rows = across_runs(runs)
  except ValueError as error:
    parser.error(str(error))
  if not rows:
    print('No adaptive setting beside a static one in these records: nothing to compare.')
    return 1
  print(table(rows, aim), end='')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
