"""Matplotlib for the reports: the Agg backend (no display on the machines that run sweeps) and
the one way a figure is written."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

__all__ = ['plt', 'save_figure']


def save_figure(fig, path) -> pathlib.Path:
  """Lay out `fig`, write it to `path` (PNG at 120 dpi) and close it. Returns the path."""
  path = pathlib.Path(path)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
