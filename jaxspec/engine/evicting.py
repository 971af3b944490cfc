"""Continuous batching with every request's KV cache under an eviction budget: each request holds
a fixed number of pages whatever its length, so the same KV memory runs more requests at once
than the plain engine, at some cost in quality.

    policy = make_policy('h2o', 128)                    # 128 live tokens per request and layer
    engine = EvictingEngine(target, params, policy=policy, num_slots=16, num_pages=129)
    rid = engine.add_request(prompt_ids, max_tokens=64)  # prompts longer than the budget are fine
    outputs = engine.run()

Policies (`jaxspec.cache.eviction`): sliding window, attention sinks + window (StreamingLLM,
Xiao et al. 2023), heavy hitters (H2O, Zhang et al. 2023; raw or normalised accumulated
attention), TOVA (Oren et al. 2024).

Pages: a request spanning `span` tokens (prompt + max_tokens + K + 1, K = 0 without speculation)
holds
min(ceil(span / L), ceil((budget + reuse_delay) / L)) pages from admission to finish, taken all at
admission; nothing grows, so the scheduler never preempts for growth and admission needs only that
fixed count. `max_seq_len` bounds positions (RoPE), not memory.

Device state: one `EvictionState` row per batch slot lives on device across steps (prefill rows
= slots); a slot's row is reset when a request is admitted into it. Preemption by recomputation
(`Scheduler.preempt`) still resumes exactly: prefilling prompt + output one token at a time
retraces the same eviction decisions.

Speculation: prompt lookup (`drafter='ngram'`, a fixed K >= 1) verifies each slot's proposals in
one target call under eviction (`device_evicting.lookup_round_evicting`); the policy's
`reuse_delay` must be >= K + 1 (a slot evicted during a round is not rewritten in it), and the
greedy output equals the request decoded alone at K = 0 under the same policy.

Not supported under eviction (ValueError at construction): a draft model (its cache would need
the whole sequence's pages beside the target's budget), an adaptive K policy, prefix caching and
the host tier (a request's pages are rewritten in place as slots are reused,
so sharing them would need copy-on-write), prefill_rows other than num_slots, the 'full' policy
(use `Engine`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from jaxspec.cache import EvictionPolicy, init_eviction, pages_needed
from jaxspec.cache.eviction import check_no_sliding_window
from jaxspec.checks import check_int, is_int_in
from jaxspec.decoding.sampling import SamplingParams
from jaxspec.engine import device, speculation
from jaxspec.engine import device_evicting
from jaxspec.engine.drafters import NGramDrafter, Round, observation
from jaxspec.engine.engine import Engine
from jaxspec.engine.k_policy import FixedK
from jaxspec.engine.request import Request
from jaxspec.engine.scheduler import Scheduler
from jaxspec.models import ModelConfig


class EvictingScheduler(Scheduler):
  """`Scheduler` with a fixed page count per request: admission takes `pages_of(request)` pages
  at once, nothing grows, nothing is registered for sharing.

  Args:
    prefix: the `PrefixCache` over the device pool (caching disabled: only its accounting).
    pages_of: request -> pages it holds while admitted.
    **kwargs: as `Scheduler`.
  """

  def __init__(self, prefix, *, pages_of, **kwargs):
    if prefix.enabled or prefix.host is not None:
      raise ValueError('eviction needs prefix caching and the host tier off')
    super().__init__(prefix, **kwargs)
    self._pages_of = pages_of

  def _take_pages(self, request: Request):
    # With caching off the handle's tokens only label it; reserve sets the page count.
    reserve = self._pages_of(request) * self.prefix.page_size
    return self.prefix.admit(request.prefill_tokens[:reserve], reserve=reserve,
                             salt=request.salt)

  def _fits_with_headroom(self, request: Request) -> bool:
    return True   # nothing grows, so no watermark is needed; `admit` decides

  def _grow(self, request: Request, tokens: int) -> None:
    return None   # every page a request will write was taken at admission

  def commit(self, request: Request) -> None:
    return None   # pages are rewritten in place as slots are reused: nothing is shareable


def _one_bucket(buckets, num_slots) -> bool:
  """Whether `buckets` is the one decode bucket (num_slots,)."""
  try:
    made = tuple(buckets)
  except TypeError:
    return False
  return len(made) == 1 and is_int_in(made[0], num_slots, num_slots)


class EvictingEngine(Engine):
  """Continuous batching with each request's target cache under `policy`, at K = 0 or with
  prompt lookup at a fixed K.

  Args:
    target, target_params: the model.
    policy: an `EvictionPolicy` with a budget (`jaxspec.cache.make_policy`, not 'full').
    num_slots: B, requests decoded together.
    num_pages: device pool size P in pages of `page_size` tokens (page 0 is the null page).
    page_size, chunk_size, sampling, max_stop_tokens, max_seq_len, seed: as `Engine` (and, as
      there, `add_request(..., sampling=)` gives a request its own sampling parameters).
    use_kernel, interpret: Pallas kernels for selection and attention instead of their jnp
      references; interpret None = compiled on a GPU, interpreted elsewhere
      (`jaxspec.cache.init_eviction`).
    prefill_group: tokens per model call inside a prefill chunk (must divide chunk_size; default
      its largest divisor up to 4). Compile time grows with it (the eviction step is unrolled
      over those tokens and the layers), weight reads per chunk shrink; outputs do not change.
    k, drafter: K = 0 and None (no speculation), or K >= 1 with drafter 'ngram' (or an
      `NGramDrafter`): prompt lookup verified under eviction, K every round; needs
      policy.reuse_delay >= K + 1.
    draft, draft_params, k_policy, prefix_caching, host_pages, prefill_rows, decode_buckets:
      accepted only at their defaults (None, None, 'fixed', False, 0, None = num_slots,
      None = (num_slots,): row b of every call is slot b); see the module docstring.
      k_policy may also be a `FixedK` instance (at K = 0 it means no speculation, as in `Engine`,
      which leaves it unused and unbound).
  Attributes:
    eviction_policy: the `EvictionPolicy` (`policy` is the base class's K policy: None at K = 0,
      a `FixedK` with prompt lookup).
    request_pages: pages a request longer than the budget holds (ceil(policy.slots / L)).
    eviction: the device `EvictionState`, arrays [layers, B, request_pages * L].
  Raises:
    ValueError: naming the value: a policy that is not an EvictionPolicy or has no budget; a
      draft model, a drafter other than prompt lookup, an adaptive K policy, prompt lookup with
      reuse_delay < K + 1, prefix caching, a host tier, prefill_rows != num_slots or decode
      buckets other than (num_slots,); a prefill_group
      that does not divide chunk_size; a budget whose pages exceed the pool; and everything
      `Engine` refuses.
  """

  def __init__(self, target: ModelConfig, target_params, *, policy: EvictionPolicy,
               num_slots: int, num_pages: int, page_size: int = 16, chunk_size: int = 32,
               sampling: SamplingParams = SamplingParams(), max_stop_tokens: int = 8,
               max_seq_len: Optional[int] = None, seed: int = 0, use_kernel: bool = False,
               interpret: Optional[bool] = None, draft: Optional[ModelConfig] = None,
               draft_params=None,
               k: int = 0, drafter=None, k_policy='fixed', prefix_caching: bool = False,
               host_pages: int = 0, prefill_rows: Optional[int] = None,
               decode_buckets: Optional[Sequence[int]] = None,
               prefill_group: Optional[int] = None):
    # As ints from here on (numpy integers and 0-d arrays are ints; `Engine` checks the same).
    num_slots = check_int('num_slots', num_slots, 1)
    num_pages = check_int('num_pages', num_pages, 2)
    page_size = check_int('page_size', page_size, 1)
    chunk_size = check_int('chunk_size', chunk_size, 1)
    if not isinstance(policy, EvictionPolicy):
      raise ValueError(f'policy must be an EvictionPolicy (jaxspec.cache.make_policy), '
                       f'got {policy!r}')
    if isinstance(target, ModelConfig):
      check_no_sliding_window(target)
    if policy.slots is None:
      raise ValueError(f"policy {policy.kind!r} has no budget; use Engine for a full cache")
    fixed = isinstance(k_policy, FixedK) or (isinstance(k_policy, str) and k_policy == 'fixed')
    lookup = isinstance(drafter, NGramDrafter) or (isinstance(drafter, str) and
                                                   drafter == 'ngram')
    if draft is not None or draft_params is not None or not fixed or \
        not ((drafter is None and k == 0) or lookup):
      raise ValueError(f'EvictingEngine speculates with prompt lookup at a fixed K only '
                       f"(drafter='ngram', k >= 1, k_policy 'fixed' or a FixedK; or K = 0), got "
                       f'k={k!r}, draft={"None" if draft is None else "a model"}, '
                       f'drafter={drafter!r}, k_policy={k_policy!r}')
    if lookup and is_int_in(k, 1, math.inf) and policy.reuse_delay < k + 1:
      raise ValueError(f'prompt lookup at K = {k} under eviction needs the policy\'s reuse_delay '
                       f'>= K + 1 = {k + 1} (make_policy(..., reuse_delay={k + 1})), got '
                       f'{policy.reuse_delay}')
    if not isinstance(prefix_caching, (bool, np.bool_)) or prefix_caching:
      raise ValueError(f'prefix_caching={prefix_caching!r}: prefix caching is not supported under '
                       'eviction (pages are rewritten in place; sharing them would need '
                       'copy-on-write); pass False')
    if not is_int_in(host_pages, 0, 0):
      raise ValueError(f'host_pages={host_pages!r}: the host tier is not supported under '
                       'eviction (it holds prefix-cache pages); pass 0')
    if prefill_rows is not None and not (is_int_in(num_slots, 1, math.inf) and
                                         is_int_in(prefill_rows, num_slots, num_slots)):
      raise ValueError(f'prefill_rows={prefill_rows!r} must equal num_slots={num_slots!r} '
                       'under eviction (prefill row b is slot b)')
    if decode_buckets is not None and not _one_bucket(decode_buckets, num_slots):
      raise ValueError(f'decode_buckets={decode_buckets!r} must be None or (num_slots,) = '
                       f'({num_slots!r},) under eviction (decode row b is slot b)')
    super().__init__(target, target_params, num_slots=num_slots, num_pages=num_pages,
                     page_size=page_size, chunk_size=chunk_size, sampling=sampling,
                     prefix_caching=False, max_stop_tokens=max_stop_tokens,
                     max_seq_len=max_seq_len, seed=seed, k=k, drafter=drafter,
                     k_policy=k_policy)
    with speculation.released_on_error(self.policy):   # a check below fails: policy freed
      if prefill_group is None:   # the largest divisor of the chunk up to 4
        prefill_group = next(g for g in range(min(chunk_size, 4), 0, -1) if chunk_size % g == 0)
      if not is_int_in(prefill_group, 1, chunk_size) or chunk_size % prefill_group:
        raise ValueError(f'prefill_group must be an int >= 1 dividing chunk_size={chunk_size}, '
                         f'got {prefill_group!r}')
      self.prefill_group = int(prefill_group)
      # Engine took a chunk past the context as max_seq_len; here it stays a multiple of the group.
      self.chunk_size = chunk_size = min(chunk_size, -(-self.max_seq_len // self.prefill_group)
                                         * self.prefill_group)
      self.eviction_policy = policy
      self.request_pages = pages_needed(policy.slots, page_size)
      if self.request_pages > num_pages - 1:
        raise ValueError(f'budget {policy.budget} + reuse_delay {policy.reuse_delay} needs '
                         f'{self.request_pages} pages of {page_size} per request, the pool has '
                         f'num_pages - 1 = {num_pages - 1}')
      self.pages_per_seq = self.request_pages      # page-table width: attention reads S slots
      self.prefill_buckets = (num_slots,)           # prefill row b is slot b: every call B rows
      self.decode_buckets = (num_slots,)            # and so is decode row b
      self.scheduler = EvictingScheduler(self.prefix, pages_of=self._pages_of,
                                         num_slots=num_slots, chunk_size=chunk_size,
                                         prefill_rows=num_slots, apply_plan=self._apply_plan)
      table, lengths = device.idle_rows(num_slots, self.pages_per_seq)
      bound = device.bind(self.caches, table, lengths)[0]
      self.eviction = init_eviction(policy, bound, use_kernel=use_kernel, interpret=interpret)

  # ---------------------------------------------------------------- hooks of Engine

  def _request_pages(self, span: int) -> int:
    return min(pages_needed(span, self.prefix.page_size), self.request_pages)

  def _pages_of(self, request: Request) -> int:
    return self._request_pages(len(request.prompt) + request.max_tokens + self.window)

  def _prefill_row(self, index: int, request: Request) -> int:
    return request.slot

  def _decode_layout(self, decodes) -> tuple:
    return self.num_slots, [r.slot for r in decodes]

  def _call_prefill(self, table, lengths, tokens, counts, sampling, drafted=False):
    del drafted                       # no draft model: prompt lookup or K = 0
    cache = device.bind(self.caches, table, lengths)[0]
    first, cache, self.eviction = device_evicting.prefill_chunk_evicting(
        self.target, self.target_params, cache, self.eviction, np.asarray(tokens, np.int32),
        np.asarray(counts, np.int32), self._next_rng(), sampling, group=self.prefill_group)
    self.caches = [cache]
    return device.fetch((first,))[0], None

  def _call_decode(self, table, lengths, pending, room, stop, sampling, k=0, caps=None,
                   contexts=None, meanwhile=None):
    """A decode round under eviction: K = 0, or K = the engine's k with prompt lookup (caps [B]
    proposals each row may accept, default K; contexts [B] token lists or None for idle rows;
    meanwhile: as `Engine._call_decode`, run after a K = 0 call is dispatched). Returns a
    `drafters.Round`."""
    if k not in (0, self.k):
      raise ValueError(f'EvictingEngine decodes at K = 0 or its k={self.k}, got k={k!r}')
    cache = device.bind(self.caches, table, lengths)[0]
    b = self.num_slots
    if k:
      caps = np.full((b,), k, np.int32) if caps is None else np.asarray(caps, np.int32)
      proposals, num = self.drafter.propose([None] * b if contexts is None else contexts, caps, k)
      window, n, emitted, cache, self.eviction = device_evicting.lookup_round_evicting(
          self.target, self.target_params, cache, self.eviction, np.asarray(pending, np.int32),
          np.asarray(proposals, np.int32), np.asarray(num, np.int32), np.asarray(room, np.int32),
          np.asarray(stop, np.int32), self._next_rng(), sampling)
      self.caches = [cache]
      window, n, emitted = device.fetch((window, n, emitted))
      successes, trials = observation(n, caps, np.asarray(room) > 0)
      return Round(window, n, emitted, num, successes, trials)
    window, emitted, cache, self.eviction = device_evicting.decode_round_evicting(
        self.target, self.target_params, cache, self.eviction, np.asarray(pending, np.int32),
        np.asarray(room, np.int32), np.asarray(stop, np.int32), self._next_rng(), sampling)
    self.caches = [cache]
    if meanwhile is not None:
      meanwhile()
    window, emitted = device.fetch((window, emitted))
    zeros = np.zeros((b,), np.int32)
    return Round(window, zeros, emitted, zeros, np.zeros((b,)), np.zeros((b,)))
