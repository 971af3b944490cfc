"""The continuous-batching engine: requests come and go at any step, each slot of a fixed batch
prefills in chunks or decodes (autoregressively, or by batched speculative decoding), and
tokens stream out per request.

    engine = Engine(target, params, num_slots=8, num_pages=512, draft=draft,
                    draft_params=draft_params, k=4)
    rid = engine.add_request(prompt_ids, max_tokens=64, stop_tokens=[eos])
    for request_id, new_tokens in engine.step(): ...       # or: outputs = engine.run()
    engine.abort(rid)                                      # between steps, if still running

    Engine(target, params, num_slots=8, num_pages=512, drafter='ngram', k=4)   # prompt lookup
    Engine(..., draft=draft, draft_params=draft_params, k=8, k_policy='goodput')  # adaptive K

Host side: `Scheduler` (slots, queue, pages through `PrefixCache`), the drafter
(`jaxspec.engine.drafters`) and the K policy (`jaxspec.engine.k_policy`). Device side: the jitted
steps of `jaxspec.engine.device` and `jaxspec.engine.spec_steps`, compiled once per static shape
(and once per K a policy uses); a step's prefill chunks and decode round are in
`jaxspec.engine.rounds`. With K = 0 the engine is the plain continuous-batching baseline.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Hashable, Optional, Sequence

import jax
import numpy as np

from jaxspec import executables
from jaxspec.cache import PrefixCache, pages_needed
from jaxspec.cache.host import check_host_fits
from jaxspec.cache.paged import check_pool_fits
from jaxspec.checks import check_int, check_seed, seed_key
from jaxspec.decoding.generate import ContextOverflowError, check_request
from jaxspec.decoding.sampling import SamplingParams, check_sampling
from jaxspec.engine import admission, device, draft_sync, rounds, speculation, timing
from jaxspec.engine.drafters import Drafter, plain_round
from jaxspec.engine.k_policy import KPolicy
from jaxspec.engine.live_costs import LiveRatio
from jaxspec.engine.request import Request, RequestMetrics, RequestOutput, State
from jaxspec.engine.scheduler import Scheduler
from jaxspec.models import ModelConfig, cache_for, check_params


# One compiled call per step instead of the ~10 ops of an eager `jax.random.split` (~90 us of
# dispatch on the development CPU, ~2 % of a B = 4 decode round); the same keys.
_split = jax.jit(lambda key: tuple(jax.random.split(key)))


class Engine:
  """Continuous batching over one paged pool, with optional batched speculative decoding.

  Args:
    target, target_params: the target model.
    num_slots: B, requests decoded together (fixed batch; one compile).
    num_pages: device pool size P in pages of `page_size` tokens (page 0 is the null page); the
      draft, when given, has a pool of the same size under the same page tables.
    page_size: L tokens per page.
    chunk_size: C, prefill tokens per request per step (chunked prefill); at most max_seq_len
      (a larger C is taken as max_seq_len: no prompt has more tokens).
    prefill_rows: requests prefilled per step at most (default: num_slots). A step's prefill
      call has the smallest row count in `prefill_buckets` (powers of two below prefill_rows,
      and prefill_rows) that holds its prefilling requests, each compiled once.
    decode_buckets: row counts a decode round is compiled for (each in [1, num_slots], num_slots
      among them); a round runs its busy requests in the smallest that holds them, so when
      few slots are busy (the last requests of a wave, which finish at different rounds under
      speculation) it does not pay for all B rows (vLLM pads a decode batch to the nearest
      captured CUDA-graph size alike). Default: num_slots, num_slots // 4, num_slots // 16, ...
      while >= 1 (B = 8: 8 and 2, no 1-row bucket); (num_slots,): every round runs all B
      slots. Each bucket is one compile per K.
    draft, draft_params: the draft model (for drafter 'model').
    k: speculation length K in [1, MAX_K] (K_max for adaptive policies); K = 0 (no draft, no
      drafter) is plain continuous batching.
    drafter: None ('model' when a draft is given, else no speculation), 'model', 'ngram'
      (prompt lookup, `NGramDrafter()`; no draft model, k >= 1), or a `Drafter` instance.
    k_policy: how each decode round picks its K in {0, ..., k}: 'fixed' (always k), 'schedule'
      (`ScheduleK`), 'goodput' (`GoodputK`), or a `KPolicy` instance (one per engine). Every K
      a policy uses is one compiled step; pages grow by k + 1 slots per round whatever K is.
    sampling: default sampling parameters of a request (greedy); `add_request` may give each
      request its own (one compile serves any mix: they reach the device as per-row arrays).
    host_pages: host-tier capacity of the prefix cache, in pages (0: none).
    prefix_caching: share full prompt pages between requests (vLLM automatic prefix caching).
    max_stop_tokens: stop ids a request may have at most (the static width of the stop table).
    max_seq_len: tokens a request may span at most (prompt + max_tokens + K + 1); default the
      models' context. Attention reads a request's whole page-table row each step, so a
      smaller bound makes every step cheaper.
    seed: PRNG seed of the sampler (a 64-bit int).
  Attributes (besides the arguments):
    outputs: {request_id: RequestOutput} of finished requests.
    k_rounds: collections.Counter {K: decode rounds run at K}.
    row_costs: {rows: {K: seconds}} t(rows, K), a warm idle decode round at K per decode row
      bucket (dispatch, device step, reading the tokens back; `measure_costs`); a round costs
      what its bucket costs, however many rows are busy. Not included: host scheduling and
      prefill chunks (the same at every K), a draft model's extra step after a fully accepted
      round, prompt lookup's host search. Empty until measured.
    prefill_costs: {rows: seconds} one prefill call per row bucket, timed by `warm_up` for a K
      policy that needs a cost table (else empty); prefill_live: the live calls' `LiveRatio` to
      it. Their product is what lock-step admissions save (`speculation.horizon`).
    step_costs: {K: seconds} the full batch's row (`row_costs[num_slots]`), t(K) of a round
      over all B slots.
    drafter: the `Drafter` (None without speculation); policy: the `KPolicy` (None without).
    draft_sync: the lazy draft cache (`jaxspec.engine.draft_sync.DraftSync`) when the drafter
      is a lazy `ModelDrafter` and the policy may choose K = 0 (else None: the draft is
      prefilled with the target and runs every round).
  Raises:
    ValueError: a bad size, K out of range, a draft without K (or K without a draft or drafter),
      an unknown drafter or k_policy, drafter='ngram' with a draft model, an adaptive k_policy
      without speculation, draft and target vocabularies that differ, prefix_caching not a bool
      (or False with host_pages > 0), a seed that is not a 64-bit int, a max_seq_len too short
      for any request (< K + 3), sampling that is not a SamplingParams, a `ModelDrafter` with
      lazy draft cache options set where the engine keeps none, target + draft pools
      past the device's memory, a full host tier past the machine's (`check_host_fits`).
    CheckpointError: target_params (draft_params) that are not the config's params (named).
  Warns:
    RuntimeWarning: when built in a process holding more than `jaxspec.executables.NEAR_LIMIT`
      (half) of the kernel's memory-mapping limit (executables compiled by engines before it):
      JAX's compiled executables were cleared first (`release_near_limit`), and functions
      compiled before then compile again.
  """

  def __init__(self, target: ModelConfig, target_params, *, num_slots: int, num_pages: int,
               page_size: int = 16, chunk_size: int = 32, prefill_rows: Optional[int] = None,
               decode_buckets: Optional[Sequence[int]] = None,
               draft: Optional[ModelConfig] = None, draft_params=None, k: int = 0,
               drafter: Optional[str | Drafter] = None, k_policy: str | KPolicy = 'fixed',
               sampling: SamplingParams = SamplingParams(), host_pages: int = 0,
               prefix_caching: bool = True, max_stop_tokens: int = 8,
               max_seq_len: Optional[int] = None, seed: int = 0):
    num_slots = check_int('num_slots', num_slots, 1)
    num_pages = check_int('num_pages', num_pages, 2)
    page_size = check_int('page_size', page_size, 1)
    chunk_size = check_int('chunk_size', chunk_size, 1)
    max_stop_tokens = check_int('max_stop_tokens', max_stop_tokens, 1)
    host_pages = check_int('host_pages', host_pages, 0)
    prefill_rows = check_int('prefill_rows', num_slots if prefill_rows is None else prefill_rows,
                             1)
    if prefill_rows > num_slots:
      raise ValueError(f'prefill_rows={prefill_rows} exceeds num_slots={num_slots}')
    k = check_int('k', k, 0)
    PrefixCache.check_args(num_pages, page_size, host_pages, prefix_caching)
    self.drafter, self.policy = speculation.setup(drafter, k_policy,
                                                  has_draft_model=draft is not None, k=k)
    with speculation.released_on_error(self.policy):   # a check below fails: policy freed
      check_request(target, [[0]], max_new_tokens=1, draft=draft, draft_params=draft_params,
                    k=k if draft is not None else None)
      check_sampling(sampling)
      seed = check_seed(seed)
      check_params(target, target_params, 'target_params')
      if draft is not None:
        check_params(draft, draft_params, 'draft_params')
      # The jitted steps outlive their engines: near the memory-mapping limit, free them before
      # this engine compiles its own (see jaxspec.executables).
      executables.release_near_limit(what=type(self).__name__)
      self.target, self.target_params = target, target_params
      self.draft, self.draft_params, self.k = draft, draft_params, k
      self.sampling = sampling
      self.num_slots, self.chunk_size, self.prefill_rows = num_slots, chunk_size, prefill_rows
      self.prefill_buckets = device.prefill_buckets(prefill_rows)
      self.decode_buckets = device.decode_buckets(num_slots, decode_buckets)
      self.max_stop_tokens = max_stop_tokens
      self.window = k + 1          # cache slots a decode round writes per request, at most (K_max)
      self.k_rounds: collections.Counter = collections.Counter()
      self.row_costs: dict = {}
      self.prefill_costs: dict = {}
      self.prefill_live = LiveRatio()
      self._schedule_s = 0.0       # host seconds of the last step's scheduling
      configs = [target] if draft is None else [target, draft]
      context = min(c.max_seq_len for c in configs)
      if max_seq_len is not None:
        max_seq_len = check_int('max_seq_len', max_seq_len, 1)
        if max_seq_len > context:
          raise ValueError(f'max_seq_len={max_seq_len} exceeds the models\' context of {context}')
      self.max_seq_len = context if max_seq_len is None else max_seq_len
      if self.max_seq_len < 2 + self.window:      # a 1-token prompt, 1 token, the round's slack
        raise ValueError(f'max_seq_len={self.max_seq_len} admits no request: the shortest spans '
                         f'1 prompt token + max_tokens=1 + K + 1 = {2 + self.window} tokens')
      # No prompt fills a chunk past the context: a larger one only pads every prefill call
      # (chunk_size=2**20 asked for 8.9 GB at a 256-token context).
      self.chunk_size = chunk_size = min(chunk_size, self.max_seq_len)
      self.pages_per_seq = pages_needed(self.max_seq_len, page_size)
      table, _ = device.idle_rows(1, self.pages_per_seq)
      check_pool_fits([(name, (c.num_layers, c.num_kv_heads, num_pages, page_size, c.head_dim),
                        c.dtype) for name, c in zip(('target', 'draft'), configs)],
                      "the engine's KV cache")
      self.caches = [cache_for(c, table, num_pages, page_size) for c in configs]
      if host_pages:
        check_host_fits(host_pages, self.caches)
      # After the pools are known to fit: its free list holds every page (a MemoryError, not a
      # message, for num_pages=10**11 when it came first).
      self.prefix = PrefixCache(num_pages, page_size, host_pages, enabled=prefix_caching)
      self.draft_sync = (draft_sync.DraftSync(self, self.drafter) if
                         speculation.keeps_lazy_draft(self.drafter, self.policy) else None)
      self.scheduler = Scheduler(self.prefix, num_slots=num_slots, chunk_size=chunk_size,
                                 prefill_rows=prefill_rows, apply_plan=self._apply_plan)
      self.outputs: dict[Hashable, RequestOutput] = {}
      self._live: dict[Hashable, Request] = {}
      self._ids, self._arrivals = itertools.count(), itertools.count()
      self._rng = seed_key(seed)
      self.num_steps = 0

  # ---------------------------------------------------------------- requests

  def add_request(self, prompt_tokens: Sequence[int], *, max_tokens: int,
                  stop_tokens: Sequence[int] = (), request_id: Optional[Hashable] = None,
                  salt: bytes | str = b'',
                  sampling: Optional[SamplingParams] = None) -> Hashable:
    """Queue a request; callable at any time, also between steps of a running batch.

    Args:
      prompt_tokens: token ids (>= 1 of them, each in [0, V)).
      max_tokens: tokens to emit at most (>= 1), the first included.
      stop_tokens: ids that end the request (the stop token is emitted); at most
        `max_stop_tokens` of them.
      request_id: any hashable id not in use (live or in `outputs`); default: the next int
        (a refused request uses one up too, so the id in its error is never reused).
      salt: prefix-cache salt (requests of different salts never share pages).
      sampling: this request's `SamplingParams` (temperature, top-k, top-p); default: the
        engine's. Speculative rounds stay exact per request: its draft and target distributions
        are both processed with its own parameters.
    Returns:
      The request id.
    Raises:
      ValueError: naming the request and the bad value: an empty prompt, a token or stop id
        outside the vocabulary, a bool prompt token or a stop id that is not an integer,
        max_tokens < 1, prompt + max_tokens + (K + 1) past the context or `max_seq_len` (a
        `ContextOverflowError`) or past what the pool holds, too many stop ids, an id in use
        or not equal to itself (NaN), a salt that is not str or bytes, sampling that is not a
        SamplingParams. The request is not queued; the engine and its other requests are
        unaffected.
    """
    request_id = admission.request_id(self, request_id)
    try:
      prompt, max_tokens, stop, salt, sampling = admission.check(
          self, prompt_tokens, max_tokens, stop_tokens, salt, sampling)
    except (TypeError, ValueError) as err:   # a prompt past the context keeps its type
      kind = ContextOverflowError if isinstance(err, ContextOverflowError) else ValueError
      raise kind(f'request {request_id!r}: {err}') from err
    metrics = RequestMetrics(arrival_s=time.perf_counter(), prompt_tokens=len(prompt))
    request = Request(request_id, prompt, max_tokens, stop, salt, metrics,
                      order=next(self._arrivals), sampling=sampling)
    self._live[request_id] = request
    self.scheduler.add(request)
    return request_id

  def abort(self, request_id: Hashable) -> RequestOutput:
    """Stop a queued or running request now (a client that went away; vLLM's `abort_request`),
    between steps.

    Its pages go back to the pool (the full pages it computed stay in the prefix cache, as a
    finished request's do), its slot frees for the next admission, and it joins `outputs` with
    finish_reason 'abort' and the tokens emitted so far; the other requests are unaffected.

    Args:
      request_id: the id `add_request` returned.
    Returns:
      Its `RequestOutput`.
    Raises:
      KeyError: no request has that id.
      ValueError: the request already finished (its output is in `outputs`).
    """
    try:
      request = self._live.get(request_id)
    except TypeError:          # unhashable
      raise KeyError(f'no request has id {request_id!r}') from None
    if request is None:
      if request_id in self.outputs:
        raise ValueError(f'request {request_id!r} already finished '
                         f'({self.outputs[request_id].finish_reason!r})')
      raise KeyError(f'no request has id {request_id!r}')
    self._finish(request, 'abort', time.perf_counter())
    return self.outputs[request_id]

  def has_unfinished(self) -> bool:
    """Whether any request is queued or running."""
    return self.scheduler.has_work()

  # ---------------------------------------------------------------- stepping

  def step(self) -> list:
    """One step: schedule, one prefill chunk per prefilling request, one decode round for all.

    Returns:
      [(request_id, new token ids)] for every request that emitted tokens in this step
      (streaming); finished requests also appear in `outputs`.
    """
    start = time.perf_counter()
    prefills, decodes = self.scheduler.schedule(self.window)
    self._schedule_s = time.perf_counter() - start
    emitted: dict = {}
    if prefills:
      rounds.prefill_chunks(self, prefills, emitted)
    if decodes:
      rounds.decode_round(self, decodes, emitted)
    self.num_steps += 1
    return list(emitted.items())

  def run(self, max_steps: Optional[int] = None) -> dict:
    """Step until no request is queued or running (or `max_steps` steps).

    Returns:
      {request_id: RequestOutput} of the requests that finished during this call.
    Raises:
      ValueError: max_steps not None and not an int >= 0.
    """
    if max_steps is not None:
      max_steps = check_int('max_steps', max_steps, 0)
    before, steps = set(self.outputs), 0
    while self.has_unfinished() and (max_steps is None or steps < max_steps):
      self.step()
      steps += 1
    return {rid: out for rid, out in self.outputs.items() if rid not in before}

  def warm_up(self, cost_repeats: int = 5, decode_rounds: int = 40,
              decode_budget_s: Optional[float] = 20.0) -> None:
    """Compile every device step with idle rows only (nothing is written but the null page):
    prefill per row bucket, the decode round at every K the policy may choose and every decode
    row bucket, and the host-tier copies when there is a host tier, so that timed steps do not
    compile; then measure `row_costs` (and `prefill_costs` for a policy that needs costs).
    The requests' PRNG key stream is left as it was: sampled outputs of a seed are the same
    with or without a warm-up (or `measure_costs`), whenever it runs.

    Args:
      cost_repeats: timing rounds per prefill bucket and catch-up call (>= 1; `timing.fastest`).
      decode_rounds, decode_budget_s: `measure_costs`'s repeats and budget_s (seconds).
    Raises:
      ValueError: a bad argument, named (before compiling anything).
    """
    rng = self._rng                  # the timed calls draw keys: put the requests' stream back,
    try:                             # so sampled outputs do not depend on when costs were timed
      timing.warm_up(self, cost_repeats, decode_rounds, decode_budget_s)
    finally:
      self._rng = rng

  @property
  def step_costs(self) -> dict:
    return self.row_costs.get(self.num_slots, {})

  def measure_costs(self, repeats: int = 40, widths: Optional[Sequence[int]] = None,
                    catch_up_repeats: int = 5, budget_s: Optional[float] = 20.0) -> dict:
    """Time one decode round at every K the policy may choose and every decode row bucket
    (compiled first if needed) over idle rows into `row_costs`: the smallest K's fastest round,
    each other K at that times its median ratio to it within a round (`timing.decode_costs`);
    give them to a policy that needs a cost table; with a lazy draft cache, time its catch-up
    calls too (`draft_sync.costs`, the fastest of `catch_up_repeats` rounds).

    Args:
      repeats: rounds of back-to-back timed calls per (rows, K), >= 1 (at 40, a B = 2 table's
        t(1)/t(0) moved +- 0.017 between timings; `scripts/cost_table_noise.py`).
      widths: the row buckets to time (default every one of `decode_buckets`); a policy that
        needs a cost table gets one once the full batch's row (num_slots) is timed.
      catch_up_repeats: rounds of timed catch-up calls, >= 1 (`timing.fastest`).
      budget_s: seconds (> 0; None: no bound) after which no new round starts, once 5 have.
    Returns:
      `step_costs` {K: seconds} (the full batch's row; {} until it is timed).
    Raises:
      ValueError: a bad argument, named.
    """
    rng = self._rng                  # as `warm_up`: the requests' key stream is left as it was
    try:
      return timing.measure_costs(self, repeats, widths, catch_up_repeats, budget_s)
    finally:
      self._rng = rng

  # ---------------------------------------------------------------- internals

  def _next_rng(self):
    self._rng, rng = _split(self._rng)
    return rng

  def _request_pages(self, span: int) -> int:
    """Pages a request spanning `span` tokens may hold at most (hook: fixed under eviction)."""
    return pages_needed(span, self.prefix.page_size)

  def _prefill_row(self, index: int, request: Request) -> int:
    """Row of the prefill call for the index-th prefilling request (hook: its slot under
    eviction, where per-slot state lives on device)."""
    return index

  def _apply_plan(self, plan) -> None:
    self.caches = self.prefix.apply(plan, self.caches)

  def _decode_layout(self, decodes) -> tuple:
    """(rows of the round's call: the smallest decode bucket holding `decodes`, [each request's
    row]) (hook: its slot under eviction, where per-slot state lives on device)."""
    return min(b for b in self.decode_buckets if b >= len(decodes)), list(range(len(decodes)))

  def _call_prefill(self, table, lengths, tokens, counts, sampling, drafted=False):
    """(first tokens [R] int32, max_p [R] float32 or None without a lazy draft). A lazy draft
    runs only if `drafted` (`DraftSync.fills_prefill`); one kept in sync always runs."""
    draft = self.draft if self.draft_sync is None or drafted else None
    caches = device.bind([self.caches[0], self.caches[1] if draft else None], table, lengths)
    first, max_p, target_cache, draft_cache = device.prefill_chunk(
        self.target, draft, self.target_params, self.draft_params, caches[0], caches[1],
        tokens, counts, self._next_rng(), sampling)
    self.caches = [target_cache] + ([draft_cache] if draft else self.caches[1:])
    return device.fetch((first, max_p if self.draft_sync is not None else None))

  def _call_decode(self, table, lengths, pending, room, stop, sampling, k=0, caps=None,
                   contexts=None, meanwhile=None):
    """One decode round at K = k with per-row sampling (`RowSampling`), caps [B] (default k)
    and contexts [B] (token lists or None; the drafters that read them need them for busy
    rows); `meanwhile()` runs while a plain round's device call does. Returns a Round."""
    # A lazy draft sits out K = 0 rounds: bind (and donate) the target's cache only.
    plain = self.drafter is None or (self.draft_sync is not None and k == 0)
    caches = device.bind(self.caches[:1 if plain else None], table, lengths)
    rng = self._next_rng()
    if plain:      # the target alone (what the drafter would run too), straight away
      result, caches = plain_round(self, caches, pending, room, stop, rng, sampling, meanwhile)
      self.caches = caches + self.caches[1:]
      return result
    rows = pending.shape[0]
    caps = np.full((rows,), k, np.int32) if caps is None else caps
    contexts = [None] * rows if contexts is None else contexts
    result, caches = self.drafter.decode(self, caches, k=k, pending=pending, room=room,
                                         stop=stop, caps=caps, contexts=contexts, rng=rng,
                                         sampling=sampling)
    self.caches = caches + self.caches[len(caches):]
    return result

  def _finish(self, request: Request, reason: str, now: float, error: str | None = None) -> None:
    if self.policy is not None:
      self.policy.forget(request.id)
    self.scheduler.remove(request, failed=reason == 'error')
    request.state = State.FINISHED
    request.finish_reason = reason
    request.metrics.finish_s = now
    del self._live[request.id]
    self.outputs[request.id] = RequestOutput(request.id, request.prompt, list(request.output),
                                             reason, request.metrics, error)

