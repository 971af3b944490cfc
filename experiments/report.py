"""Summary tables and plots of results records (a sweep's, or any run's results.jsonl).

    python -m experiments.report runs/speculative/sweep/results.jsonl
    python -m experiments.report runs/speculative/20250101-120000/results.jsonl --out /tmp/report
    python -m experiments.report results.jsonl --experiment=speculative

Writes summary.md and summary.csv (one row per record; case_id and the overrides come first as
they lead each record, then the metrics) and the experiment's plots (PNG) under OUT/plots.
An experiment gets plots by adding a function to PLOTS, and files of its own beside summary.md
(e.g. batching's threshold.md) by adding one to SUMMARIES.
"""

from __future__ import annotations

import collections
import csv
import json
import pathlib
import sys
from typing import Callable, Optional

import matplotlib.ticker

from experiments.figures import plt, save_figure

# pylint: disable-next=g-import-not-at-top
from experiments.batching_plots import plot_batching
from experiments.batching_report import write_summary as summarize_batching  # pylint: disable=all
from experiments.eviction_report import plot_eviction  # pylint: disable=g-import-not-at-top


def columns(records: list[dict]) -> list[str]:
  """Every field of the records in first-seen order, with case_id (if any) first."""
  names = list(dict.fromkeys(key for record in records for key in record))
  return sorted(names, key=lambda name: name != 'case_id')


def _cell(value) -> str:
  """A markdown cell: floats at 4 significant digits, None empty, lists joined."""
  if value is None:
    return ''
  if isinstance(value, float):
    return f'{value:.4g}'
  if isinstance(value, (list, dict)):
    value = json.dumps(value)
  return str(value).replace('|', '\\|').replace('\n', ' ')


def summarize(records: list[dict], path_md, path_csv) -> None:
  """Writes one row per record as a markdown table (`path_md`) and as CSV (`path_csv`).

  Args:
    records: result dicts; fields missing from a record are left empty.
    path_md: markdown file (floats rounded to 4 significant digits, for reading); records of
      several kinds (a `kind` field, e.g. hydration's turn / summary / alpha) get one table per
      kind, each with the columns of its own records.
    path_csv: CSV file (full precision, None as empty, for other tools).
  """
  cols = columns(records)
  with open(path_csv, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(cols)
    for record in records:
      writer.writerow(['' if record.get(c) is None else record[c] for c in cols])
  lines = [f'{len(records)} records', '']
  kinds = collections.defaultdict(list)
  for r in records:
    kinds[r.get('kind')].append(r)
  for kind, group in kinds.items():
    if len(kinds) > 1:
      lines += [f'## kind = {kind} ({len(group)} record{"s" * (len(group) != 1)})', '']
    cols = columns(group)
    lines += ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
    lines += ['| ' + ' | '.join(_cell(r.get(c)) for c in cols) + ' |' for r in group] + ['']
  pathlib.Path(path_md).write_text('\n'.join(lines).rstrip('\n') + '\n')


def _mean_by(records, keys: tuple, metric: str) -> dict:
  """{tuple of `keys` values: mean of `metric`} over records where the metric is not None."""
  groups = collections.defaultdict(list)
  for r in records:
    if r.get(metric) is not None and all(r.get(k) is not None for k in keys):
      groups[tuple(r[k] for k in keys)].append(float(r[metric]))
  return {key: sum(v) / len(v) for key, v in groups.items()}


def plot_speculative(records: list[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
  """Acceptance rate α vs K and speedup vs K: a panel per temperature, a line per workload.

  Records with equal (temperature, workload, k) (e.g. from a sweep over another field) are
  averaged. Returns the PNG paths written (none if no record has workload, k and temperature).
  """
  panels = [
      ('acceptance_rate', 'acceptance rate α (fraction of draft tokens)', 'acceptance_vs_k.png'),
      ('speedup', 'speedup over autoregressive (×)', 'speedup_vs_k.png'),
  ]
  paths = []
  for metric, ylabel, name in panels:
    means = _mean_by(records, ('temperature', 'workload', 'k'), metric)
    if not means:
      continue
    temps = sorted({t for t, _, _ in means})
    workloads = list(dict.fromkeys(w for _, w, _ in means))
    ks = sorted({k for _, _, k in means})
    fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 3.6), squeeze=False,
                             sharey=True)
    for ax, temp in zip(axes[0], temps):
      for workload in workloads:
        pts = sorted((k, v) for (t, w, k), v in means.items() if t == temp and w == workload)
        if pts:
          ax.plot([k for k, _ in pts], [v for _, v in pts], marker='o', label=workload)
      if metric == 'speedup':
        ax.axhline(1.0, color='gray', linestyle='--', linewidth=0.8)
      else:
        ax.set_ylim(0.0, 1.02)
      if all(k > 0 for k in ks):
        ax.set_xscale('log', base=2)
      ax.set_xticks(ks, [str(k) for k in ks])
      ax.set_xlabel('K (draft tokens per round)')
      ax.set_title(f'temperature {temp:g}')
      ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(title='workload', fontsize='small')
    paths.append(save_figure(fig, out_dir / name))
  return paths


def plot_prefix_cache(records: list[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
  """TTFT vs turn and tokens prefilled vs turn, a line per setting (means over conversations of
  the per-turn records). Returns the PNG path written (none without per-turn records)."""
  rows = [r for r in records if r.get('record') == 'turn']
  if not rows:
    return []
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for ax, metric, ylabel in ((axes[0], 'ttft_s', 'TTFT (ms)'),
                             (axes[1], 'prefill_tokens', 'tokens prefilled')):
    means = _mean_by(rows, ('setting', 'turn'), metric)
    for setting in dict.fromkeys(r['setting'] for r in rows):
      pts = sorted((t, v) for (s, t), v in means.items() if s == setting)
      scale = 1000.0 if metric == 'ttft_s' else 1.0
      ax.plot([t for t, _ in pts], [v * scale for _, v in pts], marker='o', label=setting)
    ax.set_xlabel('turn')
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_yscale('log')
    ax.grid(alpha=0.3)
  axes[0].set_title('time to first token')
  axes[1].set_title('prompt tokens computed by prefill')
  axes[1].legend(title='setting', fontsize='small')
  return [save_figure(fig, out_dir / 'ttft_vs_turn.png')]


def _plot_hydration(records, out_dir):
  from experiments.hydration import plot_hydration  # pylint: disable=g-import-not-at-top
  return plot_hydration(records, out_dir)


def _plot_eviction_batching(records, out_dir):
  from experiments.eviction_batching import plot_eviction_batching  # pylint: disable=all
  return plot_eviction_batching(records, out_dir)


PLOTS: dict[str, Callable[[list[dict], pathlib.Path], list[pathlib.Path]]] = {
    'speculative': plot_speculative,
    'hydration': _plot_hydration,
    'prefix_cache': plot_prefix_cache,
    'eviction': plot_eviction,
    'eviction_batching': _plot_eviction_batching,
    'batching': plot_batching,
}

# Experiment-specific summaries beside summary.md: fn(records, out_dir) -> paths written.
SUMMARIES: dict[str, Callable[[list[dict], pathlib.Path], list[pathlib.Path]]] = {
    'batching': summarize_batching,
}


def experiment_summary(records: list[dict], out_dir, experiment: Optional[str]
                       ) -> list[pathlib.Path]:
  """Writes the SUMMARIES entry of `experiment` (if any) into `out_dir`; returns its files."""
  fn = SUMMARIES.get(experiment or '')
  return [] if fn is None else fn(records, pathlib.Path(out_dir))


def plot(records: list[dict], out_dir, experiment: Optional[str]) -> list[pathlib.Path]:
  """Draws the plots registered in PLOTS for `experiment` into `out_dir` (created).

  Returns:
    The PNG paths written; [] for an experiment without plots (tables still cover it).
  """
  fn = PLOTS.get(experiment or '')
  if fn is None:
    return []
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  return fn(records, out_dir)


def guess_experiment(results_path) -> Optional[str]:
  """The `experiment` field of the config.json beside a results file, else None."""
  config = pathlib.Path(results_path).parent / 'config.json'
  try:
    return json.loads(config.read_text()).get('experiment')
  except (OSError, ValueError, AttributeError):
    return None


def main(argv) -> None:
  """CLI: `python -m experiments.report RESULTS_JSONL [--out DIR] [--experiment NAME]`."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from experiments.records import read_run  # pylint: disable=g-import-not-at-top
  if len(argv) != 2:
    raise app.UsageError('usage: python -m experiments.report RESULTS_JSONL [--out DIR]')
  try:
    path, records, left_out = read_run(argv[1])
  except ValueError as error:
    sys.exit(f'FATAL: {error}')
  if left_out:
    print(f'{left_out} records of unfinished cases or cases no longer in sweep.json left out')
  if not records:                                     # never overwrite a report with nothing
    sys.exit(f'FATAL: no result records in {str(path)!r} (is it a results.jsonl?); nothing '
             f'written')
  out = pathlib.Path(flags.FLAGS.out or path.parent)
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as error:          # a file in the way, no permission, read-only
    sys.exit(f'FATAL: cannot use --out={out}: {error}')
  experiment = flags.FLAGS.experiment or guess_experiment(path)
  configs = pathlib.Path(__file__).parent.parent / 'configs'      # experiments with a config
  known = sorted(p.stem for p in configs.glob('*.py') if p.stem != '__init__')
  if flags.FLAGS.experiment and experiment not in PLOTS and experiment not in known:
    sys.exit(f'FATAL: --experiment={experiment!r} names no experiment; those with plots: '  # a typo
             f'{sorted(PLOTS)} (leave the flag out to read it from the config.json beside the '
             f'results)')
  summarize(records, out / 'summary.md', out / 'summary.csv')
  try:
    pngs = plot(records, out / 'plots', experiment)
    extras = experiment_summary(records, out, experiment)
  except (TypeError, ValueError, KeyError) as error:   # e.g. a hand-edited record's k as a string
    sys.exit(f'FATAL: the {experiment!r} plots / summary cannot read these records '
             f'({type(error).__name__}: {error}); is a field of another type than the experiment '
             f'writes? The tables {out / "summary.md"} and {out / "summary.csv"} were written.')
  for extra in extras:
    print(f'{experiment} summary -> {extra}')
  print(f'{len(records)} record{"s" * (len(records) != 1)} -> {out / "summary.md"}, '
        f'{out / "summary.csv"}; {len(pngs)} plot{"s" * (len(pngs) != 1)} for experiment '
        f'{experiment!r}')


if __name__ == '__main__':
  from absl import app as _app, flags as _flags  # pylint: disable=g-import-not-at-top
  _flags.DEFINE_string('out', None, 'Output directory (default: beside RESULTS_JSONL).')
  _flags.DEFINE_string('experiment', None, 'Which PLOTS entry to draw (default: config.json).')
  _app.run(main)
