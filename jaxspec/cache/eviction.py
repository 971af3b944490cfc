"""KV-cache eviction under a token budget: full cache, sliding window, attention sinks + window
(StreamingLLM, Xiao et al. 2023), heavy hitters (H2O, Zhang et al. 2023; raw and normalised
accumulated attention) and TOVA (Oren et al. 2024), behind one interface and one budget
accounting: at most `budget` live tokens per sequence and layer, the newest token included.

Every policy runs the same step per layer and per new token (`attend_and_evict`):

    priority = policy's keep score of every cached slot
    evict the lowest-priority slot outside sinks and recent window if `budget` are live
    write the new key/value into the lowest free slot; attend by *position*; add its mass

Keys are cached after RoPE and each slot records the absolute position of its token, so eviction
never re-rotates a kept key and new tokens keep their true positions (slot order stops following
position order once slots are reused; attention masks by position, not slot).

The eviction state lives beside the paged cache (`EvictionState`: per layer, sequence and slot the
position, the first position allowed to reuse the slot, and the score), decisions are per layer
with scores summed over KV heads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import paged
from jaxspec.checks import check_int, concrete, is_int_in
from jaxspec.kernels.evict_select import (INT32_MAX, SelectParams, select_slots,
                                          select_slots_reference)
from jaxspec.kernels.paged_attention import (attention_with_mass, check_compiled_sizes,
                                             paged_attention_with_mass)

POLICIES = ('full', 'window', 'sinks', 'h2o', 'h2o_norm', 'tova')
STREAMING_SINKS = 4   # StreamingLLM keeps the first four tokens


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
  """What to keep under a budget (static; hashable, so jitted functions specialise on it).

  Attributes:
    kind: one of POLICIES.
    budget: live tokens per sequence and layer, the newest included (tokens); None for 'full'
      (bounded only by the cache's slots: like the loops without eviction, nothing inside a
      jitted loop checks that the sequence fits; a token with no free slot goes to the null page
      and is lost, so size a 'full' cache for the whole sequence).
    sinks: first positions never evicted.
    window: most recent positions (before the new token) never evicted.
    reuse_delay: positions an evicted slot waits before reuse; >= K+1 for speculative decoding
      (`jaxspec.decoding.evicting`), 0 otherwise. The cache needs budget + reuse_delay slots.

  Raises:
    ValueError: unknown kind; a budget, or sinks or window other than 0, given to 'full' (it
      never evicts: it would hold values it never uses); for the others a budget missing, zero,
      negative or not an int; budget smaller than sinks + window + 1 (no token would ever be
      evictable); negative or non-int sinks / window / delay; fields adding up past int32
      (slots and positions are int32 on device). Checked at construction, so a
      policy built directly is held to what `make_policy` checks (a budget of 0 stalled every
      engine step; one below sinks + window + 1 kept more than budget tokens live).
  """

  kind: str
  budget: Optional[int]
  sinks: int = 0
  window: int = 0
  reuse_delay: int = 0

  def __post_init__(self):
    kind = self.kind
    if not isinstance(kind, str) or kind not in POLICIES:
      raise ValueError(f'unknown eviction policy {kind!r}; known: {POLICIES}')
    fields = dict(reuse_delay=check_int('reuse_delay', self.reuse_delay, 0),
                  sinks=check_int('sinks', self.sinks, 0),
                  window=check_int('window', self.window, 0))
    if kind == 'full':
      if self.budget is not None:
        raise ValueError(f"policy 'full' keeps every token and takes no budget, got "
                         f'budget={self.budget!r} (size its cache for the whole sequence)')
      for name in ('sinks', 'window'):
        if fields[name]:
          raise ValueError(f"policy 'full' keeps every token and takes no {name}, got "
                           f'{name}={getattr(self, name)!r}')
    else:
      if self.budget is None:
        raise ValueError(f'eviction policy {kind!r} needs a budget (tokens), got None')
      fields['budget'] = check_int('budget', self.budget, 1)
      if fields['budget'] < fields['sinks'] + fields['window'] + 1:
        raise ValueError(f'budget={self.budget} is smaller than sinks ({self.sinks}) + window '
                         f'({self.window}) + 1: no cached token could ever be evicted')
    if fields.get('budget', 0) + fields['reuse_delay'] > INT32_MAX:   # its slots (sinks and
      raise ValueError(f'eviction policy {kind!r}: {fields} add up past int32 ({INT32_MAX}): '
                       f'slots and positions are int32 on device')     # window are in budget)
    for name, value in fields.items():      # numpy ints stored as Python ints (hash alike)
      object.__setattr__(self, name, value)

  @property
  def slots(self) -> Optional[int]:
    """Slots per sequence the cache needs (tokens): budget + reuse_delay (None for 'full')."""
    return None if self.budget is None else self.budget + self.reuse_delay

  def select_params(self, num_slots: int) -> SelectParams:
    # 'full' never evicts: a budget above the slot count is never reached.
    budget = num_slots + 1 if self.kind == 'full' else self.budget
    return SelectParams(budget=budget, sinks=self.sinks, window=self.window,
                        reuse_delay=self.reuse_delay)


def make_policy(kind: str, budget: Optional[int] = None, *, sinks: Optional[int] = None,
                window: Optional[int] = None, reuse_delay: int = 0) -> EvictionPolicy:
  """A policy with each kind's defaults: window: no sinks; sinks (StreamingLLM): 4 sinks; h2o and
  h2o_norm: half the budget as recent window (H2O's heavy/recent split), no sinks; tova: neither.
  window and sinks evict the oldest non-sink token, so their `window` stays 0.

  Raises:
    ValueError: as `EvictionPolicy` (which checks every policy, however built).
  """
  if kind == 'full' or kind not in POLICIES or budget is None:   # its checks name the problem
    return EvictionPolicy(kind, budget, 0 if sinks is None else sinks,
                          0 if window is None else window, reuse_delay)
  if sinks is None:
    sinks = STREAMING_SINKS if kind == 'sinks' else 0
  if window is None:
    window = check_int('budget', budget) // 2 if kind in ('h2o', 'h2o_norm') and \
        is_int_in(budget, 1, math.inf) else 0
  return EvictionPolicy(kind, budget, sinks, window, reuse_delay)


@flax.struct.dataclass
class EvictionState:
  """Per-slot eviction bookkeeping beside a `PagedKVCache` (slot s of sequence b is the cache's
  slot s: page_table[b, s // L], offset s % L).

  Fields:
    key_pos: [layers, B, S] int32 absolute position of the token in each slot, -1 = empty.
    free_from: [layers, B, S] int32 first position allowed to write each empty slot.
    scores: [layers, B, S] float32 attention mass summed over all N query heads (each KV head's
      G query heads, then the K KV heads), so one query adds up to N: accumulated over every
      query so far (H2O), or the last query's (TOVA).
    policy: static `EvictionPolicy`.
    use_kernel: static; Pallas kernels (True) or their jnp references (False).
    interpret: static; run the kernels in the Pallas interpreter (CPU, TPU) or compiled (GPU).
  """

  key_pos: jax.Array
  free_from: jax.Array
  scores: jax.Array
  policy: EvictionPolicy = flax.struct.field(pytree_node=False)
  use_kernel: bool = flax.struct.field(pytree_node=False, default=False)
  interpret: bool = flax.struct.field(pytree_node=False, default=True)

  @property
  def num_live(self):
    """[layers, B] int32 tokens currently cached."""
    return (self.key_pos >= 0).sum(axis=-1, dtype=jnp.int32)


def init_eviction(policy: EvictionPolicy, cache: paged.PagedKVCache, *, use_kernel: bool = False,
                  interpret: Optional[bool] = None) -> EvictionState:
  """An empty eviction state for `cache` (every slot free).

  Args:
    use_kernel: the Pallas kernels (`jaxspec.kernels`) for attention and selection instead of
      their jnp references.
    interpret: run those kernels in the Pallas interpreter; None (default) = compiled (Pallas'
      Triton backend) when JAX's default backend is a GPU, interpreted otherwise.
  Raises:
    ValueError: policy not an `EvictionPolicy` (build one with `make_policy`); the cache has
      fewer slots per sequence than budget + reuse_delay; use_kernel not a bool or interpret
      not a bool or None; compiled kernels (use_kernel, interpret=False) on a backend other than
      a GPU (the kernels are written for Pallas' Triton backend) or with a page size or head_dim
      that is not a power of two (refused here, not at the first step).
  """
  if not isinstance(policy, EvictionPolicy):
    raise ValueError(f'init_eviction needs an EvictionPolicy (from make_policy), got {policy!r}')
  if not isinstance(use_kernel, (bool, np.bool_)):
    raise ValueError(f'use_kernel must be True or False, got {use_kernel!r}')
  if interpret is not None and not isinstance(interpret, (bool, np.bool_)):
    raise ValueError(f'interpret must be True, False or None, got {interpret!r}')
  backend = jax.default_backend()
  interpret = backend != 'gpu' if interpret is None else bool(interpret)
  if use_kernel and not interpret and backend != 'gpu':
    raise ValueError(f'use_kernel=True with interpret=False needs a GPU backend (the kernels '
                     f'target Pallas\' Triton backend), JAX\'s default backend is {backend!r}: '
                     'use interpret=True or None')
  if use_kernel and not interpret:
    check_compiled_sizes(cache.page_size, cache.k_pages.shape[-1])
  slots = cache.capacity
  if policy.slots is not None and slots < policy.slots:
    raise ValueError(f'cache holds {slots} slots per sequence, policy {policy.kind!r} needs '
                     f'budget {policy.budget} + reuse_delay {policy.reuse_delay} = {policy.slots}')
  shape = (cache.num_layers, cache.batch, slots)
  return EvictionState(key_pos=jnp.full(shape, -1, jnp.int32),
                       free_from=jnp.zeros(shape, jnp.int32),
                       scores=jnp.zeros(shape, jnp.float32),
                       policy=policy, use_kernel=use_kernel, interpret=interpret)


def priority(policy: EvictionPolicy, scores, key_pos, position):
  """Keep priority of every slot (higher = keep) for a new token at `position`.

  Args:
    scores: [B, S] float32; key_pos: [B, S] int32; position: [B] int32.
  Returns:
    [B, S] float32: position for window / sinks (the oldest goes first); accumulated mass for
    h2o; accumulated mass ÷ the number of queries that have seen the key (position - key_pos,
    queries key_pos .. position-1) for h2o_norm, since raw sums favour early tokens; the last
    query's mass for tova.
  """
  if policy.kind in ('window', 'sinks', 'full'):
    return key_pos.astype(jnp.float32)
  if policy.kind == 'h2o_norm':
    seen = jnp.maximum(position[:, None] - key_pos, 1).astype(jnp.float32)
    return scores / seen
  return scores


def check_no_sliding_window(config) -> None:
  """Refuses a model (a `ModelConfig`) whose sliding window takes effect, under eviction.

  `attend_and_evict` masks slots by position causally only: a Mistral / Qwen2 window would be
  dropped silently (full attention over the kept slots, other logits than the model's). A window
  of at least the model's max_seq_len masks nothing and passes.

  Raises:
    ValueError: naming the window and the context, when sliding_window < max_seq_len.
  """
  window = config.sliding_window
  if window is not None and window < config.max_seq_len:
    raise ValueError(f'the model has sliding_window={window} < max_seq_len={config.max_seq_len}: '
                     f'eviction does not apply a window (its attention masks kept slots by '
                     f'causality only); load it with max_seq_len <= {window} (the window then '
                     f'masks nothing) or run it without an eviction policy')


def attend_and_evict(q, k, v, positions, cache: paged.PagedKVCache, state: EvictionState,
                     layer: int):
  """One layer's attention under eviction, one new token at a time (in order).

  For each token t: select (evict + choose a slot), write its key/value there, attend over the
  slots by position, and update the scores with the mass its query gave every key.

  Args:
    q: [B, T, N, H] queries, k, v: [B, T, K, H] new keys (after RoPE) / values.
    positions: [B, T] int32 absolute positions (-1 = padding).
    cache: the paged cache; state: the eviction state; layer: static layer index.
  Returns:
    out [B, T, N, H]; the cache with the new keys/values written; and (key_pos, free_from,
    scores), each [T, B, S]: this layer's eviction state after each of the T tokens (so a
    speculative round can keep the state after its accepted tokens only).
  """
  policy = state.policy
  num_slots = state.key_pos.shape[-1]
  params = policy.select_params(num_slots)
  key_pos, free_from, scores = state.key_pos[layer], state.free_from[layer], state.scores[layer]
  idx = jnp.arange(num_slots, dtype=jnp.int32)[None, :]
  outs, history = [], []
  for t in range(q.shape[1]):
    pos_t = positions[:, t]
    prio = priority(policy, scores, key_pos, pos_t)
    if state.use_kernel:
      key_pos, free_from, _, slot = select_slots(prio, key_pos, free_from, pos_t, params,
                                                 interpret=state.interpret)
    else:
      key_pos, free_from, _, slot = select_slots_reference(prio, key_pos, free_from, pos_t, params)
    scores = jnp.where(idx == slot[:, None], 0.0, scores)
    pages, offsets = paged.slot_address(cache.page_table, slot[:, None], cache.page_size)
    k_pages, v_pages = paged.write_keys_values(cache.k_pages, cache.v_pages, layer, pages,
                                               offsets, k[:, t:t + 1], v[:, t:t + 1])
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages)
    if state.use_kernel:
      out, mass = paged_attention_with_mass(
          q[:, t:t + 1], cache.k_pages[layer], cache.v_pages[layer], cache.page_table, key_pos,
          pos_t[:, None], interpret=state.interpret)
    else:
      out, mass = attention_with_mass(
          q[:, t:t + 1], paged.gather_kv(cache.k_pages, layer, cache.page_table),
          paged.gather_kv(cache.v_pages, layer, cache.page_table), key_pos, pos_t[:, None])
    mass = mass.sum(axis=1)                                               # [B, S] over KV heads
    if policy.kind == 'tova':   # a padding query (position -1) leaves the last real one's mass
      scores = jnp.where((pos_t >= 0)[:, None], mass, scores)
    else:
      scores = scores + mass
    outs.append(out)
    history.append((key_pos, free_from, scores))
  stacked = tuple(jnp.stack(h) for h in zip(*history))
  return jnp.concatenate(outs, axis=1), cache, stacked


def after_tokens(before: EvictionState, history: EvictionState, num_tokens) -> EvictionState:
  """The eviction state once only the first `num_tokens[b]` tokens of a call are kept.

  Args:
    before: the state passed to the model call.
    history: the model call's per-token states (arrays [T, layers, B, S]).
    num_tokens: [B] integer array, each in [0, T]; 0 keeps `before`, T the state after every
      token. Concrete values outside [0, T] raise; traced ones (inside jit, as the decode loops
      call it) cannot be checked and are clamped to [0, T].
  Returns:
    EvictionState (arrays [layers, B, S]). Rejected speculative tokens thereby leave no trace:
    their scores, evictions and slots are those of the state before them.
  Raises:
    ValueError: num_tokens not a [B] integer array, or (when concrete) a value outside [0, T].
  """
  t, b = history.key_pos.shape[0], before.key_pos.shape[1]
  shape, dtype = jnp.shape(num_tokens), jnp.result_type(num_tokens)
  if shape != (b,) or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f'num_tokens must be a [B] = [{b}] integer array, got shape {shape} dtype '
                     f'{dtype}')
  values = concrete(num_tokens)
  if values is not None and b and (values.min() < 0 or values.max() > t):
    raise ValueError(f'num_tokens must lie in [0, T] = [0, {t}], got {values.tolist()}')
  n = jnp.clip(jnp.asarray(num_tokens, jnp.int32), 0, t)

  def pick(b, h):
    row = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[None, None, :, None], axis=0)[0]
    return jnp.where((n > 0)[None, :, None], row, b)

  return before.replace(key_pos=pick(before.key_pos, history.key_pos),
                        free_from=pick(before.free_from, history.free_from),
                        scores=pick(before.scores, history.scores))


def last_token(history: EvictionState) -> EvictionState:
  """The state after every token of the call (arrays [layers, B, S])."""
  return history.replace(key_pos=history.key_pos[-1], free_from=history.free_from[-1],
                         scores=history.scores[-1])
