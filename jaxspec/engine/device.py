"""The engine's device steps: pure functions over the shared page pools, jitted once per static
shape (rows, chunk size, K) and never per request.

The host binds each call's page table and lengths to the caches (`bind`), so the scheduler's
integers are the single source of truth and a request can move between slots freely. Rows with
nothing to do get the null page table row and length 0 (`idle_rows`): whatever they compute is
written to the null page 0 and discarded, so they never touch pages holding live data.

Built from `jaxspec.decoding`: `prefill` (each row starts at its cache length; rows with zero new
tokens are padding), `decode_step`, `speculative_round` (draft K, verify K+1 in one target pass,
`rejection_sample`), `probabilities` / `sample`, and `cut_lengths` (stop tokens, max tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import NULL_PAGE
from jaxspec.decoding.autoregressive import decode_step, prefill_logits
from jaxspec.decoding.output import cut_lengths
from jaxspec.decoding.sampling import RowSampling, probabilities, sample
from jaxspec.decoding.speculative import speculative_round
from jaxspec.models import ModelConfig


def bind(caches, page_table: np.ndarray, lengths: np.ndarray) -> list:
  """Give each cache (target, draft) its own device copy of this call's page table and lengths
  (each call donates them).

  Args:
    page_table: [R, pages_per_seq] int32; lengths: [R] int32 tokens cached per row.
  """
  return [None if c is None else c.replace(page_table=jnp.asarray(page_table, jnp.int32),
                                           lengths=jnp.asarray(lengths, jnp.int32))
          for c in caches]


def idle_rows(rows: int, pages_per_seq: int):
  """(page_table [rows, pages_per_seq], lengths [rows]) of rows that do nothing: the null page."""
  return (np.full((rows, pages_per_seq), NULL_PAGE, np.int32), np.zeros((rows,), np.int32))


@functools.partial(jax.jit, static_argnames=('target', 'draft'),
                   donate_argnames=('target_cache', 'draft_cache'))
def prefill_chunk(target: ModelConfig, draft, target_params, draft_params, target_cache,
                  draft_cache, tokens, counts, rng, sampling: RowSampling):
  """One chunk of prefill for up to R requests, in the target and (when given) the draft.

  Args:
    target, draft: static configs (draft None: no draft cache).
    target_cache, draft_cache: bound caches (donated); row r holds lengths[r] tokens already.
    tokens: [R, C] int32 new tokens, right-padded; counts: [R] int32 real tokens per row (0: an
      idle row, which must be bound to the null page).
    rng: PRNG key.
    sampling: each row's request's parameters ([R] arrays; traced, so any mix shares a compile).
  Returns:
    (next_token [R] int32 drawn from the target at each row's last new token: the request's first
    token when this chunk ends its prompt; target_cache, draft_cache).
  """
  last, target_cache = prefill_logits(target, target_params, target_cache, tokens, counts)
  if draft is not None:
    _, draft_cache = prefill_logits(draft, draft_params, draft_cache, tokens, counts)
  return sample(rng, probabilities(last, sampling)), target_cache, draft_cache


@functools.partial(jax.jit, static_argnames=('target',), donate_argnames=('target_cache',))
def decode_round(target: ModelConfig, target_params, target_cache, pending, room, stop, rng,
                 sampling: RowSampling):
  """One autoregressive step for every row (the K = 0 baseline of continuous batching).

  Args:
    target_cache: bound cache (donated); row b holds every committed token but `pending[b]`.
    pending: [B] int32 last committed token per row (input of this step).
    room: [B] int32 tokens each row may still emit; 0 marks an idle row (bound to the null page).
    stop: [B, S] int32 stop ids per row, -1 padded.
    sampling: [B] per-row parameters (traced).
  Returns:
    (window [B, 1] int32 the sampled token, emitted [B] int32 0 or 1, target_cache).
  """
  logits, target_cache = decode_step(target, target_params, target_cache, pending)
  window = sample(rng, probabilities(logits, sampling))[:, None]
  emitted, _ = cut_lengths(window, jnp.ones_like(room), stop, room)
  return window, emitted, target_cache


@functools.partial(jax.jit, static_argnames=('target', 'draft', 'k'),
                   donate_argnames=('target_cache', 'draft_cache'))
def speculative_step(target: ModelConfig, draft: ModelConfig, target_params, draft_params,
                     target_cache, draft_cache, pending, room, stop, rng, sampling: RowSampling,
                     *, k: int):
  """Batched speculative decoding: every row drafts K, one target pass verifies all rows, each row
  accepts its own count (Leviathan et al. 2023, Alg. 1), then stop tokens and max tokens cut
  each row's run.

  Keeps the invariant of `jaxspec.decoding.speculative`: afterwards both caches hold, for each
  row, its committed tokens up to lengths + emitted (the host rolls lengths back to that), and
  the last emitted token is the next pending one. The draft wrote pending, x_1..x_{K-1}; rows
  that emit all K+1 also need x_K, written by one more draft step (skipped when no row does).

  Args:
    target_cache, draft_cache: bound caches (donated), same page tables and lengths.
    pending, room, stop, sampling: as `decode_round` (draft and target both process their
      logits with the row's parameters, as exact speculative sampling needs).
    k: static K >= 1.
  Returns:
    window: [B, K+1] int32 x_1..x_n then the correction/bonus token; num_accepted: [B] int32 n
    before cuts; emitted: [B] int32 tokens to emit after cuts (0 for idle rows);
    target_cache, draft_cache.
  """
  window, n, target_cache, draft_cache = speculative_round(
      target, draft, target_params, draft_params, target_cache, draft_cache, pending, rng,
      k=k, sampling=sampling)
  emitted, _ = cut_lengths(window, n + 1, stop, room)
  draft_cache = jax.lax.cond(
      jnp.any(emitted == k + 1),
      lambda c: decode_step(draft, draft_params, c, window[:, k - 1])[1],
      lambda c: c, draft_cache)
  return window, n, emitted, target_cache, draft_cache


def compile_counts() -> dict:
  """Compiled variants of each device step in this process (the jit caches' sizes): a test
  checks that new requests of new lengths add none."""
  return {f.__name__: f._cache_size() for f in (prefill_chunk, decode_round, speculative_step)}
