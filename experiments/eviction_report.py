"""Plots of the eviction experiment (registered in experiments.report.PLOTS as 'eviction')."""

from __future__ import annotations

import collections
import pathlib

import numpy as np

from experiments.figures import plt, save_figure

_PANELS = [('agreement', 'next-token agreement with the full cache'),
           ('perplexity_increase_pct', 'perplexity increase over the full cache (%)')]


def plot_eviction(records: list[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
  """quality_vs_budget.png: agreement and perplexity increase vs budget (% of the sequence), a
  column per workload, a line per policy (the mean of the records at a point);
  worker_memory.png: cached tokens and KV bytes vs tokens generated in worker mode. Returns the
  PNG paths written."""
  paths = []
  quality = [r for r in records if r.get('agreement') is not None and r.get('policy')]
  if quality:
    workloads = sorted({r['workload'] for r in quality})
    fig, axes = plt.subplots(len(_PANELS), len(workloads), squeeze=False,
                             figsize=(5 * len(workloads), 3.6 * len(_PANELS)))
    for col, workload in enumerate(workloads):
      lines = collections.defaultdict(lambda: collections.defaultdict(list))
      for r in quality:      # records of one point (repeats, other cases) are averaged
        if r['workload'] == workload:
          lines[r['policy']][100 * r['budget_frac']].append(r)
      for row, (metric, label) in enumerate(_PANELS):
        ax = axes[row][col]
        for policy in sorted(lines):
          xs = sorted(lines[policy])
          ax.plot(xs, [np.mean([r[metric] for r in lines[policy][x]]) for x in xs], marker='o',
                  label=policy)
        ax.set_xscale('log')
        ax.set_xticks([5, 10, 20, 50, 100], ['5', '10', '20', '50', '100'])
        ax.set_xlabel('KV budget (% of the sequence)')
        ax.set_ylabel(label)
        if metric == 'perplexity_increase_pct':
          ax.set_yscale('symlog', linthresh=0.1)
        ax.set_title(workload)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(title='policy', fontsize='small')
    paths.append(save_figure(fig, out_dir / 'quality_vs_budget.png'))
  worker = sorted((r for r in records if r.get('mode') == 'worker'),
                  key=lambda r: r['tokens_generated'])
  if worker:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [r['tokens_generated'] for r in worker]
    ax.plot(xs, [r['kv_bytes'] / 2**20 for r in worker], marker='o',
            label=f"KV allocated, {worker[0]['policy']} at {worker[0]['budget_tokens']} tokens")
    ax.plot(xs, [r['kv_bytes_full_cache'] / 2**20 for r in worker], linestyle='--',
            label='full cache of the same context')
    ax.set_xlabel('tokens generated')
    ax.set_ylabel('KV cache (MiB)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize='small')
    paths.append(save_figure(fig, out_dir / 'worker_memory.png'))
  return paths
