"""The continuous-batching scheduler: host-side Python over ints, no device arrays.

Each step (vLLM's scheduler, in brief; Kwon et al. 2023, Yu et al. 2022 "Orca"):

1. Growth: every decoding request gets the pages its next round may write (K + 1 slots past its
   cache length), oldest first. When the pool runs out, the newest admitted request is
   preempted by recomputation: its computed full pages are committed to the prefix cache, its
   pages released (they stay cached, or go to the host tier when reclaimed), and it goes back to
   the front of the queue with prompt + everything it emitted; a later admission prefills that
   again (hitting whatever is still cached) and decoding resumes exactly where it stopped.
2. Admission: while a slot is free, the request at the head of the queue (first come, first
   served) is admitted if `PrefixCache.admit` finds pages for its prefill tokens and a page per
   decoding request is left over (a watermark against preempting it again at once); prefill
   then starts at the cached length.
3. Work: up to `prefill_rows` prefilling requests (oldest first) get a chunk of at most
   `chunk_size` tokens each; every decoding request takes part in the decode round.

Page growth is lazy (a decoding request holds only the pages it has written plus one round's
worth), so more requests run at once than with a worst-case reservation; preemption is the price.
A request that could not fit the pool on its own is refused by the engine at `add_request`, so
the oldest request always makes progress.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

from jaxspec.cache import OutOfPagesError, PrefixCache, pages_needed
from jaxspec.engine.request import Request, State


class Scheduler:
  """Slots, queue, pages.

  Args:
    prefix: the `PrefixCache` over the device pool (its allocator hands out the pages).
    num_slots: batch slots B.
    chunk_size: prefill tokens per request per step (C).
    prefill_rows: requests prefilled per step at most (R <= B).
    apply_plan: called with every non-empty `Plan` that admit / extend return (host-tier copies);
      it must run `prefix.apply` on the device caches before anything else touches the pool.
  """

  def __init__(self, prefix: PrefixCache, *, num_slots: int, chunk_size: int, prefill_rows: int,
               apply_plan: Callable):
    self.prefix = prefix
    self.num_slots = num_slots
    self.chunk_size = chunk_size
    self.prefill_rows = prefill_rows
    self._apply_plan = apply_plan
    self.slots: list[Optional[Request]] = [None] * num_slots
    self.waiting: collections.deque[Request] = collections.deque()
    self.num_preemptions = 0

  # ---------------------------------------------------------------- queries

  @property
  def running(self) -> list[Request]:
    """Admitted requests (prefilling or decoding), oldest first."""
    return sorted((r for r in self.slots if r is not None), key=lambda r: r.order)

  def has_work(self) -> bool:
    return bool(self.waiting) or any(r is not None for r in self.slots)

  # ---------------------------------------------------------------- lifecycle

  def add(self, request: Request) -> None:
    """Queue a validated request (at the back)."""
    request.state = State.WAITING
    self.waiting.append(request)

  def schedule(self, window: int):
    """Plan one step.

    Args:
      window: slots a decode round writes per request (K + 1; 1 without speculation).
    Returns:
      (prefills: list of (request, chunk token ids), decodes: list of decoding requests).
    """
    for request in self.running:
      if request.state is State.DECODE and request.slot is not None:
        self._grow(request, request.num_computed + window)
    self._admit()
    prefilling = [r for r in self.running if r.state is State.PREFILL][:self.prefill_rows]
    prefills = []
    for request in prefilling:
      start = request.num_computed
      prefills.append((request, request.prefill_tokens[start:start + self.chunk_size]))
    decodes = [r for r in self.running if r.state is State.DECODE]
    return prefills, decodes

  def commit(self, request: Request) -> None:
    """Register the request's computed full pages in the prefix cache (later requests, and
    this one after a preemption, can hit them)."""
    self.prefix.commit(request.handle, request.context[:request.num_computed])

  def release(self, request: Request, failed: bool = False) -> None:
    """Commit what the request computed and give its pages and slot back; failed (its model
    produced NaN or +inf): commit nothing, and take its pages no one else holds out of the
    prefix cache."""
    if not failed:
      self.commit(request)
    self.prefix.finish(request.handle, keep=not failed)
    self.slots[request.slot] = None
    request.slot, request.handle = None, None

  def remove(self, request: Request, failed: bool = False) -> None:
    """Take a finished or aborted request out: `release` if admitted (`failed`: see there),
    else out of the queue."""
    if request.slot is None:   # by identity: dataclass equality would compare every field
      self.waiting = collections.deque(r for r in self.waiting if r is not request)
    else:
      self.release(request, failed)

  def preempt(self, request: Request) -> None:
    """Preempt by recomputation: release its pages and requeue it at the front."""
    self.release(request)
    request.state = State.WAITING
    request.num_computed = 0
    request.metrics.preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(request)

  # ---------------------------------------------------------------- internals

  def _grow(self, request: Request, tokens: int) -> None:
    while request.slot is not None:
      try:
        plan = self.prefix.extend(request.handle, tokens)
      except OutOfPagesError:
        running = self.running
        if len(running) == 1:
          raise RuntimeError(f'request {request.id!r} alone does not fit the pool (the engine '
                             f'should have refused it at add_request)') from None
        self.preempt(running[-1])  # the newest; may be `request` itself
        continue
      if plan:
        self._apply_plan(plan)
      return

  def _admit(self) -> None:
    while self.waiting and None in self.slots:
      request = self.waiting[0]
      if not self._fits_with_headroom(request):
        return
      try:
        handle, plan = self._take_pages(request)
      except OutOfPagesError:
        return
      if plan:
        self._apply_plan(plan)
      self.waiting.popleft()
      slot = self.slots.index(None)
      self.slots[slot] = request
      request.slot, request.handle = slot, handle
      request.num_computed = handle.num_cached
      request.draft_computed = 0        # a lazy draft cache: shared pages' draft half unknown
      request.metrics.cached_tokens += handle.num_cached
      request.state = State.PREFILL

  def _take_pages(self, request: Request):
    """(handle, plan) of the pages an admission takes: its prefill tokens' (hook: a fixed
    count under eviction). Raises OutOfPagesError when they do not fit."""
    return self.prefix.admit(request.prefill_tokens, salt=request.salt)

  def _fits_with_headroom(self, request: Request) -> bool:
    """Whether admitting `request` leaves a page per decoding request for its next growth (a
    watermark, as vLLM keeps): without it a new admission is often preempted at the next step.
    With nothing decoding the head request is always admitted if it fits (`admit` decides)."""
    decoding = sum(1 for r in self.slots if r is not None and r.state is State.DECODE)
    if not decoding:
      return True
    tokens = request.prefill_tokens
    device, _ = self.prefix.match(tokens, request.salt)
    fresh = pages_needed(len(tokens), self.prefix.page_size) - len(device)
    available = self.prefix.num_free + self.prefix.num_cached - len(device)
    return fresh + decoding <= available
