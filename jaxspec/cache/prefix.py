"""Automatic prefix caching over the paged pool (vLLM's automatic prefix caching; SGLang's
RadixAttention shares prefixes the same way, with a radix tree in place of a hash chain).

Only full pages are shared, each named by a SHA-256 chain key that names the page and
everything before it, salted per tenant (`jaxspec.cache.page_hash`).

Page states (every pool page is in exactly one):

* free: on the allocator's free list, ref count 0;
* held: one or more live requests hold it (ref count = holders, + 1 if it is registered);
* cached: registered under a key but held by no request (ref count 1, the index's own), kept in
  an LRU and reused on a hit, or reclaimed when the pool runs out.

The index holds one reference on every registered page, which is how the plain `PageAllocator`
keeps cached pages off its free list. When a request finishes its pages enter the LRU last page
first, so a reclaim takes the tail of the longest prefix before its head.

With a host tier, a reclaimed cached page is demoted to host memory instead of being forgotten and
promoted back to a fresh device page on a later hit. Moving the data is the caller's part (see
`PrefixCache.apply`): this module plans, `jaxspec.cache.host` copies.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import numpy as np

from jaxspec.cache.allocator import OutOfPagesError, PageAllocator, check_num_pages
from jaxspec.cache.host import HostTier, check_caches, move_pages
from jaxspec.cache.page_hash import page_keys_unchecked, salt_bytes
from jaxspec.cache.paged import pages_needed
from jaxspec.cache.plan import Plan, Request
from jaxspec.checks import check_int, is_int_in, token_ids

class PrefixCache:
  """Page allocator + hash-chained prefix index + LRU of cached pages (+ optional host tier).

  Plain Python over integers and keys; device arrays are touched only in `apply`.

  Args:
    num_pages: device pool size P (page 0 is the null page, so P - 1 usable).
    page_size: L, tokens per page.
    host_pages: capacity of the host tier in pages (0 = no host tier).
    enabled: False turns matching and registration off (every request recomputes everything);
      the accounting is otherwise the same, so timings compare like with like.
  Raises:
    ValueError: num_pages < 2, page_size < 1, host_pages < 0 (each must be an int), enabled
      not a bool (named as prefix_caching, the engines' argument), host_pages > 0 with enabled
      False. `match`, `admit` and
      `commit` refuse token ids that are not ints in [0, 2**63) (`jaxspec.checks.token_ids`).
  """

  @staticmethod
  def check_args(num_pages: int, page_size: int, host_pages: int = 0,
                 enabled: bool = True) -> tuple:
    """The constructor's arguments checked (the errors above), as (num_pages, page_size,
    host_pages, enabled): for callers that allocate pools of num_pages before building one."""
    num_pages = check_num_pages(num_pages)
    page_size = check_int('page_size', page_size, 1)
    host_pages = check_int('host_pages', host_pages, 0)
    if not isinstance(enabled, (bool, np.bool_)):     # 'off' is truthy: caching would stay on
      raise ValueError(f'prefix_caching must be True or False, got {enabled!r}')
    if host_pages and not enabled:
      raise ValueError(f'host_pages={host_pages} needs prefix caching on: the host tier holds '
                       f'reclaimed prefix-cache pages, and with caching off nothing is demoted')
    return num_pages, page_size, host_pages, bool(enabled)

  def __init__(self, num_pages: int, page_size: int, host_pages: int = 0, enabled: bool = True):
    num_pages, page_size, host_pages, enabled = self.check_args(num_pages, page_size, host_pages,
                                                                enabled)
    self.allocator = PageAllocator(num_pages)
    self.page_size = page_size
    self.enabled = enabled
    self.host = HostTier(host_pages) if host_pages else None
    self._page_of_key: dict[bytes, int] = {}
    self._key_of_page: dict[int, bytes] = {}
    self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
    self._holders = [0] * num_pages
    self._requests: dict[int, Request] = {}
    self._next_id = 0
    self._pending: Optional[Plan] = None
    self.stats = collections.Counter()

  # ---------------------------------------------------------------- queries

  @property
  def num_pages(self) -> int:
    return self.allocator.num_pages

  @property
  def num_free(self) -> int:
    """Pages on the free list."""
    return self.allocator.num_free

  @property
  def num_cached(self) -> int:
    """Registered pages no request holds (reclaimable)."""
    return len(self._lru)

  @property
  def num_held(self) -> int:
    """Pages at least one live request holds."""
    return sum(1 for h in self._holders if h)

  def holders(self, page: int) -> int:
    """Live requests holding `page`. ValueError: page not an int in [0, num_pages)."""
    if not is_int_in(page, 0, self.num_pages - 1):
      raise ValueError(f'page must be an int in [0, {self.num_pages}), got {page!r}')
    return self._holders[int(page)]

  def key_of(self, page: int) -> Optional[bytes]:
    """The key `page` is registered under, or None."""
    return self._key_of_page.get(page)

  def cached_pages(self) -> list[int]:
    """Cached pages, least recently used first."""
    return list(self._lru)

  def match(self, tokens: Sequence[int], salt: bytes | str = b'') -> tuple[list, list]:
    """The longest cached prefix of `tokens`, without taking it.

    At most (len(tokens) - 1) // L pages match, so at least the last prompt token is computed
    (its logits are needed even when the whole prompt is cached).

    Returns:
      (device_pages, host_keys): device pages of the leading matched pages, then keys of the
      pages after them found only in the host tier.
    """
    tokens = token_ids(tokens)
    if not self.enabled or not tokens:
      return [], []
    keys = page_keys_unchecked(tokens, self.page_size, salt_bytes(salt))[
        :(len(tokens) - 1) // self.page_size]
    device, host = [], []
    for key in keys:
      page = self._page_of_key.get(key)
      if page is not None:
        if host:  # keep device hits a leading run; the rest is recomputed (rare)
          break
        device.append(page)
      elif self.host is not None and key in self.host:
        host.append(key)
      else:
        break
    return device, host

  # ---------------------------------------------------------------- lifecycle

  def admit(self, tokens: Sequence[int], *, reserve: Optional[int] = None,
            salt: bytes | str = b'') -> tuple[Request, Plan]:
    """Take pages for a new request: the cached prefix (shared) plus fresh pages.

    Args:
      tokens: the prompt ids (>= 1).
      reserve: tokens the request may grow to (prompt + new tokens + slack); pages for all of
        them are taken now. Defaults to len(tokens).
      salt: cache salt of the request's tenant.
    Returns:
      (Request, Plan). Run the plan with `apply` before prefill and before the next `admit`.
    Raises:
      OutOfPagesError: the request does not fit even after reclaiming every cached page; the
        cache's state is unchanged then.
      ValueError: an empty prompt or bad token ids, reserve not an int >= len(tokens), or an
        unapplied plan pending.
    """
    self._check_no_pending()
    tokens = token_ids(tokens, 'prompt')
    salt = salt_bytes(salt)
    reserve = len(tokens) if reserve is None else check_int('reserve', reserve, 1)
    if not tokens:
      raise ValueError('cannot admit an empty prompt')
    if reserve < len(tokens):
      raise ValueError(f'reserve={reserve} is smaller than the prompt ({len(tokens)} tokens)')
    device, host_keys = self.match(tokens, salt)
    total = pages_needed(reserve, self.page_size)
    fresh = total - len(device)
    hits = set(device)
    reclaimable = sum(1 for p in self._lru if p not in hits)
    if fresh > self.allocator.num_free + reclaimable:
      raise OutOfPagesError(
          f'cache out of pages: request needs {fresh} new pages for {reserve} tokens '
          f'({len(device)} cached), {self.allocator.num_free} free + {reclaimable} reclaimable '
          f'of {self.num_pages - 1}')
    plan = Plan(pinned=set(host_keys))
    for page in device:  # Hits are held before any reclaim, so they cannot be reclaimed.
      self._hold(page)
    for key in host_keys:
      self.host.touch(key)
    self._reclaim(fresh - self.allocator.num_free, plan)
    new = self.allocator.allocate(fresh)
    for page in new:
      self._holders[page] = 1
    for key, page in zip(host_keys, new):
      self._register(page, key)
      plan.promote.append((key, page))
    request = Request(self._next_id, tokens, salt, device + new,
                      num_cached=(len(device) + len(host_keys)) * self.page_size,
                      num_promoted=len(host_keys) * self.page_size)
    self._requests[request.id] = request
    self._next_id += 1
    self.stats['admitted'] += 1
    self.stats['prompt_tokens'] += len(tokens)
    self.stats['cached_tokens'] += request.num_cached
    self.stats['promoted_pages'] += len(plan.promote)
    if plan:
      self._pending = plan
    return request, plan

  def extend(self, request: Request, reserve: int) -> Plan:
    """Grow a request's reservation to `reserve` tokens (fresh pages, reclaiming if needed).

    Raises:
      OutOfPagesError: not enough pages even after reclaiming; nothing changes then.
      ValueError: reserve not an int >= 0.
    """
    self._check_live(request)
    self._check_no_pending()
    more = pages_needed(check_int('reserve', reserve, 0), self.page_size) - len(request.pages)
    if more <= 0:
      return Plan()
    if more > self.allocator.num_free + len(self._lru):
      raise OutOfPagesError(
          f'cache out of pages: request {request.id} needs {more} more pages, '
          f'{self.allocator.num_free} free + {len(self._lru)} reclaimable')
    plan = Plan()
    self._reclaim(more - self.allocator.num_free, plan)
    new = self.allocator.allocate(more)
    for page in new:
      self._holders[page] = 1
    request.pages.extend(new)
    if plan:
      self._pending = plan
    return plan

  def commit(self, request: Request, tokens: Sequence[int]) -> int:
    """Record that the device cache now holds keys/values of `tokens` (the request's sequence
    from its start: prompt + generated tokens that were fed to the model), and register every
    full page of them so later requests can hit it.

    Returns:
      Pages newly registered. A page whose key another page already has stays unregistered.
    Raises:
      ValueError: `tokens` and the request's prompt disagree on their common length (a shorter
        prefix of the prompt is fine), or `tokens` outgrow the request's pages.
    """
    self._check_live(request)
    tokens = token_ids(tokens)
    if tokens[:len(request.tokens)] != request.tokens and request.tokens[:len(tokens)] != tokens:
      raise ValueError(f'request {request.id}: committed tokens diverge from its prompt')
    if len(tokens) > len(request.pages) * self.page_size:
      raise ValueError(f'request {request.id}: {len(tokens)} tokens exceed its '
                       f'{len(request.pages)} pages of {self.page_size}')
    if len(tokens) > len(request.tokens):
      request.tokens = tokens
    if not self.enabled:
      return 0
    added = 0
    for page, key in zip(request.pages, page_keys_unchecked(tokens, self.page_size, request.salt)):
      if page in self._key_of_page or key in self._page_of_key:
        continue
      self._register(page, key)
      added += 1
    return added

  def finish(self, request: Request, keep: bool = True) -> None:
    """Release a request's pages: registered ones become cached (tail page reclaimed first),
    the rest return to the free list.

    keep=False (a request whose model produced NaN or +inf, `jaxspec.engine`): first unregister
    every registered page that no other request holds, so none is served from the cache (a
    page it computed may hold NaN keys/values even for healthy tokens; one it hit is only
    recomputed later).

    Raises:
      ValueError: keep not a bool ('no' kept the pages cached); a request not live here.
    """
    if not isinstance(keep, (bool, np.bool_)):
      raise ValueError(f'keep must be True or False, got {keep!r}')
    self._check_live(request)
    request.finished = True
    del self._requests[request.id]
    if not keep:
      for page in request.pages:
        if self._holders[page] == 1 and page in self._key_of_page:
          self._unregister(page)
          self.allocator.free([page])           # the index's own reference
    for page in reversed(request.pages):
      self._holders[page] -= 1
      self.allocator.free([page])
      if self._holders[page] == 0 and page in self._key_of_page:
        self._lru[page] = None
        self._lru.move_to_end(page)

  def reclaim(self, n: int) -> Plan:
    """Return up to `n` cached pages (least recently used first) to the free list, demoting them
    to the host tier if there is one. Returns the plan to `apply`. ValueError: n not an int
    >= 0."""
    self._check_no_pending()
    plan = Plan()
    self._reclaim(min(check_int('n', n, 0), len(self._lru)), plan)
    if plan:
      self._pending = plan
    return plan

  def reset(self) -> None:
    """Forget every cached prefix in both tiers: cached pages return to the free list, pages held
    by live requests lose their keys (they are freed when those requests finish), the host tier
    is emptied. Nothing cached before a reset can be hit after it.

    Raises:
      ValueError: while a plan is pending (apply it first: a live request counts on its copies).
    """
    self._check_no_pending()
    for page in list(self._lru):
      self._unregister(page)
      self.allocator.free([page])
    self._lru.clear()
    for page in list(self._key_of_page):
      self._unregister(page)
      self.allocator.free([page])
    if self.host is not None:
      self.host.clear()

  def apply(self, plan: Plan, caches: Sequence) -> list:
    """Carry out a plan's data movement on the device caches (one per model sharing the page
    table, e.g. target and draft): demoted pages are copied to host memory first, then promoted
    pages are written from host memory into their new device pages.

    Args:
      plan: from `admit` / `extend` / `reclaim`.
      caches: PagedKVCache per model (donated: use the returned ones).
    Returns:
      The updated caches, same order.
    Raises:
      ValueError: `plan` is not the pending one; a plan that moves pages with no caches, or
        with another number of caches than its promoted pages were demoted from (the plan
        stays pending: apply it again with the right caches). An error while moving data (e.g.
        host memory exhausted) is raised as is, after undoing what counted on it: the
        promoted pages lose their keys (a later request misses instead of reading a page whose
        data never arrived), demoted pages whose copy arrived stay in the tier and count in
        stats['demoted_pages'], and the plan stops being pending.
    """
    if plan is not self._pending and (plan or self._pending is not None):
      raise ValueError('this plan is not the pending one (apply each plan once, in order)')
    caches = list(caches)
    if self.host is not None:                   # checked while the plan is still pending
      check_caches(self.host, plan.demote, plan.promote, caches)
      # A reserved key may hold data already (`HostTier.reserve` keeps it): only a key that
      # gains data here counts as demoted if the move fails.
      had = {key for _, key in plan.demote if self.host.has_data(key)}
    try:
      if not plan or self.host is None:
        return caches
      caches, demoted = move_pages(self.host, plan.demote, plan.promote, caches)
      self.stats['demoted_pages'] += demoted
      return caches
    except BaseException:
      # Nothing may count on data that never arrived: promoted pages lose their keys (their
      # request frees them at `finish`), host entries still waiting for data are dropped; the
      # plan is no longer pending, so the cache keeps serving. Pages whose copy did arrive (the
      # demotes run first) stay in the tier and are counted.
      if self.host is not None:
        self.stats['demoted_pages'] += sum(self.host.has_data(key) and key not in had
                                           for _, key in plan.demote)
      for _, page in plan.promote:
        if page in self._key_of_page:
          self._unregister(page)
          self.allocator.free([page])           # the index's reference
      for _, key in plan.demote:
        if self.host is not None and not self.host.has_data(key):
          self.host.discard(key)
      raise
    finally:
      self._pending = None

  # ---------------------------------------------------------------- internals

  def _hold(self, page: int) -> None:
    self._holders[page] += 1
    self.allocator.share([page])
    self._lru.pop(page, None)
    self._touch(page)

  def _touch(self, page: int) -> None:
    key = self._key_of_page.get(page)
    if key is not None and self.host is not None and key in self.host:
      self.host.touch(key)

  def _register(self, page: int, key: bytes) -> None:
    self._page_of_key[key] = page
    self._key_of_page[page] = key
    self.allocator.share([page])  # the index's own reference

  def _unregister(self, page: int) -> None:
    key = self._key_of_page.pop(page)
    del self._page_of_key[key]

  def _reclaim(self, n: int, plan: Plan) -> None:
    for _ in range(max(n, 0)):
      page, _ = self._lru.popitem(last=False)
      key = self._key_of_page[page]
      self._unregister(page)
      self.allocator.free([page])
      self.stats['reclaimed_pages'] += 1
      if self.host is not None and key not in self.host and self.host.reserve(key, plan.pinned):
        plan.demote.append((page, key))

  def _check_live(self, request: Request) -> None:
    if request.finished or self._requests.get(request.id) is not request:
      raise ValueError(f'request {request.id} is not live (finished twice?)')

  def _check_no_pending(self) -> None:
    if self._pending is not None:
      raise ValueError('a plan is pending: run PrefixCache.apply(plan, caches) first')
