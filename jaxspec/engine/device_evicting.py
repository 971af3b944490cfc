"""The evicting engine's device steps: `jaxspec.engine.device`'s prefill chunk and decode round,
and `spec_steps.lookup_step`'s verification of host proposals (prompt lookup), with the
target's cache under an eviction policy (`jaxspec.cache.eviction`).

Row b of every call is batch slot b (the evicting engine prefills with rows = slots), so the
per-slot `EvictionState` ([layers, B, S] arrays) stays on device from step to step and is passed
in and out whole. Rows with nothing to do get positions -1: the eviction step treats them as
padding (no slot chosen, no score added, nothing written but the null page), so a slot that is
prefilling is untouched by the decode round and vice versa.

Inside each model call the tokens of a row enter one at a time (`attend_and_evict`), so a
prefill chunk makes exactly the decisions of the same tokens fed one per step: chunk size and
chunk boundaries change nothing, and a request prefilled again after a preemption (prompt +
output) retraces its eviction decisions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.cache import EvictionState, after_tokens, last_token
from jaxspec.decoding.output import cut_lengths
from jaxspec.decoding.sampling import RowSampling, probabilities, sample
from jaxspec.decoding.speculative import accept
from jaxspec.engine.spec_steps import host_q
from jaxspec.models import ModelConfig, Transformer


def reset_rows(eviction: EvictionState, reset) -> EvictionState:
  """`eviction` with the rows (slots) where `reset` holds emptied: every slot free, no scores.

  Args:
    reset: [B] bool.
  """
  r = reset[None, :, None]
  return eviction.replace(key_pos=jnp.where(r, -1, eviction.key_pos),
                          free_from=jnp.where(r, 0, eviction.free_from),
                          scores=jnp.where(r, 0.0, eviction.scores))


@functools.partial(jax.jit, static_argnames=('target', 'group'),
                   donate_argnames=('target_cache', 'eviction'))
def prefill_chunk_evicting(target: ModelConfig, target_params, target_cache, eviction, tokens,
                           counts, rng, sampling: RowSampling, *, group: int):
  """One prefill chunk per slot under eviction, as a `lax.scan` over groups of `group` tokens.

  A row starting at length 0 with new tokens is a fresh admission: its eviction row is reset
  first (its previous occupant's slots and scores are forgotten; its pages were rewritten anyway).
  Each scan step is one model call over [B, group] tokens; inside it the eviction step runs token
  by token (unrolled), so `group` trades compile time (grows with group x layers) against weight
  reads (one per group); it never changes a decision.

  Args:
    target: static config.
    target_cache: bound cache (donated); row b holds lengths[b] tokens (positions) already, in
      the slots its eviction row records.
    eviction: EvictionState [layers, B, S] (donated), one row per batch slot.
    tokens: [B, C] int32 new tokens, right-padded; counts: [B] int32 real tokens per row (0: an
      idle row, bound to the null page).
    rng: PRNG key.
    sampling: each row's request's parameters ([B] arrays; traced, so any mix shares a compile).
    group: static tokens per model call; must divide C.
  Returns:
    (next_token [B] int32 drawn at each row's last new token, target_cache, eviction).
  """
  b, c = tokens.shape
  eviction = reset_rows(eviction, (counts > 0) & (target_cache.lengths == 0))
  start = target_cache.lengths

  def step(carry, g):
    cache, eviction, last = carry
    t = g * group + jnp.arange(group, dtype=jnp.int32)[None, :]                  # [1, group]
    positions = jnp.where(t < counts[:, None], start[:, None] + t, -1)
    chunk = jax.lax.dynamic_slice_in_dim(tokens, g * group, group, axis=1)
    logits, cache, history = Transformer(target).apply(target_params, chunk, positions, cache,
                                                       eviction)
    # Padding leaves the state as it was, so the state after the group's last token is each row's.
    at = counts - 1 - g * group                                                 # [B]
    here = jnp.take_along_axis(logits, jnp.clip(at, 0, group - 1)[:, None, None], axis=1)[:, 0]
    last = jnp.where(((at >= 0) & (at < group))[:, None], here, last)
    return (cache, last_token(history), last), None

  init = (target_cache, eviction, jnp.zeros((b, target.vocab_size), jnp.float32))
  (target_cache, eviction, last), _ = jax.lax.scan(step, init,
                                                   jnp.arange(c // group, dtype=jnp.int32))
  return sample(rng, probabilities(last, sampling)), target_cache, eviction


@functools.partial(jax.jit, static_argnames=('target',),
                   donate_argnames=('target_cache', 'eviction'))
def decode_round_evicting(target: ModelConfig, target_params, target_cache, eviction, pending,
                          room, stop, rng, sampling: RowSampling):
  """One autoregressive step for every decoding slot under eviction (K = 0).

  Args:
    target_cache: bound cache (donated); row b holds every committed token but `pending[b]`.
    eviction: EvictionState [layers, B, S] (donated).
    pending: [B] int32 last committed token per row (input of this step).
    room: [B] int32 tokens each row may still emit; 0 marks an idle row (position -1: its
      eviction row is left as it was).
    stop: [B, S_stop] int32 stop ids per row, -1 padded.
    sampling: [B] per-row parameters (traced).
  Returns:
    (window [B, 1] int32 the sampled token, emitted [B] int32 0 or 1, target_cache, eviction).
  """
  positions = jnp.where(room > 0, target_cache.lengths, -1)[:, None]
  logits, target_cache, history = Transformer(target).apply(target_params, pending[:, None],
                                                            positions, target_cache, eviction)
  window = sample(rng, probabilities(logits[:, 0], sampling))[:, None]
  emitted, _ = cut_lengths(window, jnp.ones_like(room), stop, room)
  return window, emitted, target_cache, last_token(history)


@functools.partial(jax.jit, static_argnames=('target',),
                   donate_argnames=('target_cache', 'eviction'))
def lookup_round_evicting(target: ModelConfig, target_params, target_cache, eviction, pending,
                          proposals, num_proposed, room, stop, rng, sampling: RowSampling):
  """One speculative round under eviction with host proposals (prompt lookup): the target
  verifies [pending, x_1..x_K] per decoding slot in one call, the eviction steps running token
  by token inside it, and modified rejection sampling with one-hot q (Leviathan et al. 2023;
  `spec_steps.lookup_step` without eviction) accepts each row's own n <= num_proposed[b]. Only
  the eviction state after each row's committed tokens is kept (`after_tokens`: pending and
  the first emitted - 1 new tokens), so rejected proposals leave no score, eviction or slot
  behind; this needs the policy's reuse_delay >= K + 1 (checked by the engine), as in
  `jaxspec.decoding.evicting.decode_speculative_evicting`.

  Args:
    target_cache: bound cache (donated); row b holds every committed token but `pending[b]`.
    eviction: EvictionState [layers, B, S] (donated).
    pending: [B] int32; room: [B] int32 (0: an idle row, positions -1, its eviction row left
      as it was); stop: [B, S_stop] int32 (-1 padded); sampling: [B] per-row parameters.
    proposals: [B, K] int32 (any id in [0, V) past num_proposed); num_proposed: [B] int32 in
      [0, K]. K (static) is proposals.shape[1] >= 1.
  Returns:
    (window [B, K+1] int32, num_accepted [B] int32, emitted [B] int32, target_cache, eviction).
  """
  k = proposals.shape[1]
  tokens = jnp.concatenate([pending[:, None], proposals], axis=1)               # [B, K+1]
  offsets = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  positions = jnp.where((room > 0)[:, None], target_cache.lengths[:, None] + offsets, -1)
  logits, target_cache, history = Transformer(target).apply(target_params, tokens, positions,
                                                            target_cache, eviction)
  window, n = accept(rng, proposals, host_q(proposals, num_proposed, target.vocab_size),
                     probabilities(logits, sampling))
  emitted, _ = cut_lengths(window, n + 1, stop, room)
  return window, n, emitted, target_cache, after_tokens(eviction, history, emitted)


def compile_counts() -> dict:
  """Compiled variants of each evicting device step in this process (the jit caches' sizes)."""
  return {f.__name__: f._cache_size()
          for f in (prefill_chunk_evicting, decode_round_evicting, lookup_round_evicting)}
