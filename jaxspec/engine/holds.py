"""The record of a K choice the goodput policy (`jaxspec.engine.goodput.GoodputK`) keeps without
scoring it again: what it was made on and how many rounds it has served, and when a held choice
is repeated (`repeat`; host side)."""

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


def repeat(policy, request_ids, rows, queued, rooms=None):
  """`GoodputK.repeat`: the held K = 0 choice (`GoodputK.choose`) while the batch, its row
  bucket, the queue's length and the estimates are unchanged and the cost ratios and host time
  have not moved (None otherwise; the confidences, which move every round, are not checked).
  The rest `GoodputK.choose` checks cannot move against K = 0 meanwhile: with the same requests
  decoding at K = 0 and no catch-up (no probe was due, `KPolicy.repeat`), rooms only shrink,
  the draft's lag and its catch-up seconds only grow, and the queue and the split stay as they
  were. The cost ratios and host time are checked every `GoodputK.CHECK_EVERY` rounds of the
  hold. A held K >= 1 choice is kept under its own rules (`_repeat_spec`).

  Returns:
    (K, caps) of the held choice, or None (the policy must score).
  """
  if policy._spec_held is not None:
    return _repeat_spec(policy, request_ids, rows, queued, rooms)
  held = policy._held
  if held is None or held.key.request_ids != tuple(request_ids) or held.key.rows != rows or \
      held.key.queue[0] != queued or held.key.version != policy._version or \
      held.rounds >= held.limit:
    return None
  if held.rounds % policy.CHECK_EVERY == 0 and not policy._k0_stands(
      held, policy.live.group_ratios(rows), policy.host.of(0) / policy.live.unit_s()):
    return None
  policy.rows, policy.queued = rows, queued
  held.rounds += 1
  return 0, [0] * len(request_ids)


def _repeat_spec(policy, request_ids, rows, queued, rooms):
  """The held K >= 1 choice while it has rounds left (`GoodputK._spec_hold_rounds`), its batch
  and rooms still allow it (`Hold.spec_stands`) and, checked every `GoodputK.CHECK_EVERY`
  rounds, the cost ratios held steady; else None. What `GoodputK.choose` would also check
  cannot move against the held K: the draft is in sync after a round at K >= 1 (a catch-up
  before the choice is paid, so its seconds fall to 0), and the split can cost anew only when
  two decoding requests' rooms become equal (`speculation.split_cost`; why not rescore:
  docs/adaptive_k.md)."""
  spec = policy._spec_held
  if spec.rounds >= spec.limit or spec.key.tables != policy.live.tables or \
      not spec.spec_stands(request_ids, rows, queued, rooms, policy.slots):
    return None
  if spec.rounds % policy.CHECK_EVERY == 0 and \
      not spec.steady(policy.live.group_ratios(rows)):
    return None
  policy.rows, policy.queued = rows, queued
  spec.rounds += 1
  return spec.k, [spec.k] * len(request_ids)
