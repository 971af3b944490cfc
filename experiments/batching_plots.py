"""The batching study's plots: speedup vs batch size and the α threshold vs batch size (records
of experiments/batching.py, analysed by `experiments.batching_report.analyze`)."""

from __future__ import annotations

import math
import pathlib

from experiments.batching_report import analyze


def plot_batching(records: list[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
  """speedup_vs_batch.png (a column per workload; rows: end-to-end and decode-only speedup; a
  line per setting) and alpha_threshold_vs_batch.png (α* and each K's α-to-pay vs B, with each
  workload's i.i.d.-equivalent α, mean over the fixed K). Returns the PNG paths written (none
  without batch-size records)."""
  from experiments.figures import plt, save_figure  # pylint: disable=g-import-not-at-top
  result = analyze(records)
  rows = [r for r in result['settings'] if r['speedup'] is not None
          and not (r['k'] == 0 and r['k_policy'] in (None, 'fixed'))]   # all but baselines
  paths = []
  workloads = list(dict.fromkeys(r['workload'] for r in rows))
  if workloads:
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.5 * len(workloads), 7), squeeze=False,
                             sharex=True)
    for col, workload in enumerate(workloads):
      for row, metric in enumerate(('speedup', 'decode_speedup')):
        ax = axes[row][col]
        for setting in dict.fromkeys(r['setting'] for r in rows if r['workload'] == workload):
          pts = sorted((r['batch_size'], r[metric]) for r in rows if r['workload'] == workload
                       and r['setting'] == setting and r[metric] is not None)
          if pts:
            ax.plot(*zip(*pts), marker='o', label=setting)
        ax.axhline(1.0, color='gray', linestyle='--', linewidth=0.8)
        ax.set_xscale('log', base=2)
        bs = sorted({r['batch_size'] for r in rows})
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.grid(alpha=0.3)
        ax.set_title(f'{workload}: {"end to end" if row == 0 else "decode rounds only"}')
        ax.set_ylabel('speedup over K = 0 (×)')
        if row == 1:
          ax.set_xlabel('batch size B (slots)')
    axes[0][-1].legend(title='setting', fontsize='small')
    paths.append(save_figure(fig, out_dir / 'speedup_vs_batch.png'))
  if result['thresholds']:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    bs = [t['batch_size'] for t in result['thresholds']]
    ks = sorted({k for t in result['costs'].values() for k in t if k})
    for k in ks:
      pts = [(t['batch_size'], t.get(f'alpha_to_pay_k{k}')) for t in result['thresholds']]
      pts = [(b, a) for b, a in pts if a is not None and math.isfinite(a)]
      if pts:
        ax.plot(*zip(*pts), linestyle=':', marker='.', label=f'K={k} pays above')
    star = [(b, t['alpha_star']) for b, t in zip(bs, result['thresholds'])
            if math.isfinite(t['alpha_star'])]
    if star:
      ax.plot(*zip(*star), color='black', marker='o', linewidth=2, label='α* (best K)')
    for workload in dict.fromkeys(r['workload'] for r in result['settings']):
      alphas = [r['alpha_equivalent'] for r in result['settings'] if r['workload'] == workload
                and r.get('alpha_equivalent') is not None]
      if alphas:
        ax.axhline(sum(alphas) / len(alphas), linestyle='--', linewidth=0.8,
                   color='tab:gray', alpha=0.7)
        ax.annotate(f'α_eq {workload}', (bs[0], sum(alphas) / len(alphas)), fontsize='small',
                    va='bottom')
    ax.set_xscale('log', base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel('batch size B (slots)')
    ax.set_ylabel('acceptance rate α')
    ax.set_title('speculation pays above the line')
    ax.grid(alpha=0.3)
    ax.legend(fontsize='small')
    paths.append(save_figure(fig, out_dir / 'alpha_threshold_vs_batch.png'))
  return paths
