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


def spec_key(policy, request_ids, queue: tuple, k: int) -> Key:
  """What a hold of K = k >= 1 requires unchanged (`GoodputK.choose`): the policy's batch, row
  bucket, catch-up and split seconds and cost tables as set for this choice, and its rooms as
  far as they cap K + 1."""
  rooms = None if policy.rooms is None else tuple(min(r, k + 2) for r in policy.rooms)
  return Key(tuple(request_ids), queue, policy.rows, sync_s=policy.sync_s,
             split_s=policy.split_s, tables=policy.live.tables, rooms=rooms)


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

  def spec_stands(self, request_ids, rows, queued, rooms, slots) -> bool:
    """Whether a K >= 1 hold may be repeated for a round of `request_ids` in row bucket `rows`
    with `queued` requests waiting or prefilling and the decoding requests' `rooms` (tokens),
    `slots` the engine's batch slots (None: unknown): the same row bucket; the batch changed only
    by finishes and, with more than one slot, by admissions from the queue (`admitted_only`:
    the choice priced the queued requests, at the global estimates; with one slot each request
    gets its own K, so the batch and queue must be unchanged); some room at least K + 2 (K and
    K + 1 not capped by it); and, while requests wait, no two rooms equal unless the choice
    priced a split (an admission split apart may cost anew, `speculation.split_cost`)."""
    key = self.key
    same = key.request_ids == tuple(request_ids) and key.queue[0] == queued
    if key.rows != rows or not rooms or max(rooms) < self.k + 2 or \
        not (same or ((slots or 0) > 1 and
                      admitted_only(key.request_ids, key.queue[0], request_ids, queued))):
      return False
    return not (queued and not key.split_s and len(set(rooms)) < len(rooms))


def admitted_only(held_ids, held_queued, request_ids, queued) -> bool:
  """Whether the batch `request_ids` can differ from `held_ids` by finishes and by admissions
  from the queue alone, by count: the requests new to it are as many as the queue (`queued`,
  `held_queued`: requests waiting or prefilling) shrank by since. An arrival makes the count
  differ (False), unless a request left the queue unadmitted (an abort) in the same span; an
  unknown queue: False."""
  if held_queued is None or queued is None:
    return False
  return held_queued - queued == len(set(request_ids).difference(held_ids))
