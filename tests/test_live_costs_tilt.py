"""`LiveCosts.tilt`: live K >= 1 rounds at two or more K tilt the shared K >= 1 ratio along K
(the start-up line's slope is timed once and may be off), shrunk while few rounds back it, held
flat past one K beyond the measured ones, dropped with new tables and after a stale stretch; and
the goodput policy follows the tilted table."""

import pytest

from jaxspec.engine.acceptance import AlphaTracker
from jaxspec.engine.goodput import GoodputK
from jaxspec.engine.live_costs import LiveCosts

IDLE = {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5, 4: 3.0, 5: 3.5, 6: 4.0}


def _live(window=16):
  live = LiveCosts(window, cold_rounds=0)
  live.set_tables({None: dict(IDLE)})
  return live


def test_rounds_at_one_k_leave_the_lines_ratios_among_k():
  live = _live()
  for _ in range(40):
    live.add(2, None, 1.5 * IDLE[2], 0.0)
  assert live.tilt() == (0.0, 0.0, 0, 0)
  table = live.table(None)
  assert all(table[k] == pytest.approx(1.5 * IDLE[k]) for k in range(1, 7))


def test_rounds_at_two_k_tilt_the_ratio_about_their_mean_k():
  live = _live()
  for _ in range(20):
    live.add(2, None, 1.0 * IDLE[2], 0.0)      # K = 2 live at the line's time
    live.add(3, None, 0.8 * IDLE[3], 0.0)      # K = 3 at 0.8 of it: the line is too steep
  slope, center, low, high = live.tilt()
  raw = (0.8 - 1.0) / 0.9                      # per K, relative to the mean ratio
  assert (center, low, high) == (2.5, 2, 3)
  assert slope == pytest.approx(raw * 40 / (40 + LiveCosts.TILT_PRIOR))
  spec = live.group_ratios()[1]
  table = live.table(None)
  for k in range(1, 5):
    assert table[k] == pytest.approx(IDLE[k] * spec * (1 + slope * (k - 2.5)))
  # Past one K beyond the measured ones the ratio stays where it got to.
  assert table[6] / IDLE[6] == pytest.approx(table[4] / IDLE[4])
  assert table[5] / IDLE[5] == pytest.approx(table[4] / IDLE[4])


def test_the_tilt_grows_toward_the_measured_one_with_more_rounds():
  live, slopes = _live(), []
  for _ in range(3):
    for _ in range(8):
      live.add(2, None, 1.0 * IDLE[2], 0.0)
      live.add(3, None, 0.8 * IDLE[3], 0.0)
    slopes.append(live.tilt()[0])
  assert slopes[0] < 0 and slopes[2] < slopes[1] < slopes[0]
  assert slopes[2] > (0.8 - 1.0) / 0.9                # still shrunk


def test_a_k_with_too_few_rounds_does_not_count():
  live = _live()
  for _ in range(20):
    live.add(2, None, IDLE[2], 0.0)
  for _ in range(LiveCosts.TILT_MIN - 1):
    live.add(5, None, 0.5 * IDLE[5], 0.0)
  assert live.tilt()[0] == 0.0
  live.add(5, None, 0.5 * IDLE[5], 0.0)
  assert live.tilt()[0] < 0.0


def test_the_tilt_is_dropped_with_new_tables_and_after_a_stale_stretch():
  live = _live()
  for _ in range(20):
    live.add(2, None, IDLE[2], 0.0)
    live.add(3, None, 0.8 * IDLE[3], 0.0)
  assert live.tilt()[0] < 0.0
  live.set_tables({None: dict(IDLE)})
  assert live.tilt() == (0.0, 0.0, 0, 0)
  for _ in range(20):
    live.add(2, None, IDLE[2], 0.0)
    live.add(3, None, 0.8 * IDLE[3], 0.0)
  for _ in range(LiveCosts.STALE_ROUNDS):
    live.add(0, None, IDLE[0], 0.0)
  assert live.tilt() == (0.0, 0.0, 0, 0)


def test_goodput_picks_the_larger_k_the_live_rounds_show_cheaper():
  # α = β = 0.8 everywhere. The start-up line prices K = 2 best (2.44 tokens / 2.0 against
  # 2.95 / 2.5 at K = 3); live rounds at K = 2 and 3 show K = 3 costing 0.84 of its line time,
  # and the tilted table makes K = 4 the best.
  def policy(tilt: bool):
    p = GoodputK(tracker=AlphaTracker(prior=0.8), costs=dict(IDLE), cold_rounds=0,
                 spec_margin=0.0)
    p.setup(6)
    if not tilt:
      p.live.TILT_MIN = 10 ** 9
    for _ in range(20):
      p.round_timing(2, IDLE[2], 0.0)
      p.round_timing(3, 0.84 * IDLE[3], 0.0)
    return p

  assert policy(tilt=False).choose(['a'])[0] == 2
  assert policy(tilt=True).choose(['a'])[0] == 4
