"""The record of a K choice the goodput policy (`jaxspec.engine.goodput.GoodputK`) keeps without
scoring it again: what it was made on and how many rounds it has served (host side)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

DRIFT = 0.1        # |log| change of the K >= 1 / K = 0 live cost ratio that ends a hold
LEVEL_DRIFT = 0.3  # |log| change of K = 0's live cost ratio that ends one (a slow stretch)


class Key(NamedTuple):
  """What a held choice requires unchanged (`GoodputK.choose`): the batch's request ids, the
  queue (queued count, slots, the queue's rooms), the row bucket, and for K = 0 the estimates'
  version; for K >= 1 the catch-up and split seconds, the cost tables' version and the rooms as
  far as they cap K + 1."""

  request_ids: tuple
  queue: tuple
  rows: Optional[int]
  version: Optional[int] = None
  sync_s: float = 0.0
  split_s: float = 0.0
  tables: int = 0
  rooms: Optional[tuple] = None


class Hold:
  """A kept choice: its key (what must stay unchanged), the live cost ratios (K = 0's, K >= 1's)
  it was scored with, K, and for K = 0 the limits of what may move: `limit` rounds, the host
  seconds per round in start-up K = 0 rounds (`host`), the tokens left (`left`), the catch-up
  and split seconds (`sync_s`, `split_s`). `rounds` counts the rounds served (1 at the choice).
  """

  def __init__(self, key, ratios, *, k=0, limit=0, host=0.0, left=math.inf, sync_s=0.0,
               split_s=0.0):
    self.key, self.ratios, self.k, self.limit, self.rounds = key, ratios, k, limit, 1
    self.host, self.left, self.sync_s, self.split_s = host, left, sync_s, split_s

  def steady(self, ratios) -> bool:
    """Whether the live cost ratios (K = 0's, K >= 1's) moved little since the hold began: their
    quotient, which sets what a K >= 1 round costs against a K = 0 one, by at most `DRIFT` in
    |log|, and their common level (K = 0's), which only weighs the round against the host and
    catch-up seconds, by at most `LEVEL_DRIFT`."""
    (zero, spec), (zero0, spec0) = (tuple(max(v, 1e-9) for v in r) for r in (ratios, self.ratios))
    return abs(math.log(spec * zero0 / (zero * spec0))) <= DRIFT and \
        abs(math.log(zero / zero0)) <= LEVEL_DRIFT
