"""Prefill and the autoregressive decode loop, compiled whole (a `lax.while_loop`, as gemma's
sampler does), so a measured speedup comes from model cost, not Python dispatch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.cache import rollback
from jaxspec.decoding.output import Output, commit
from jaxspec.decoding.sampling import SamplingParams, probabilities, sample
from jaxspec.models import ModelConfig, Transformer


def prompt_positions(prompt_lengths, width: int):
  """[B, width] int32 positions 0..len-1 per row and -1 on the right padding."""
  pos = jnp.arange(width, dtype=jnp.int32)[None, :]
  return jnp.where(pos < prompt_lengths[:, None], pos, -1)


@functools.partial(jax.jit, static_argnames=('config', 'sampling'), donate_argnames=('cache',))
def prefill(config: ModelConfig, params, cache, tokens, prompt_lengths, rng, *,
            sampling: SamplingParams):
  """Run the prompts (or the uncached rest of them) through the model and draw the first token.

  Args:
    config: static model config.
    params: model params.
    cache: a `PagedKVCache` (donated) already holding cache.lengths[b] tokens of row b: 0 for an
      empty cache, the cached prefix after a prefix-cache hit. The new tokens go at positions
      cache.lengths[b] + t.
    tokens: [B, P] int32 right-padded new tokens; prompt_lengths: [B] int32 (>= 1) real new
      tokens per row.
    rng: PRNG key.
  Returns:
    (first_token [B] int32, INVALID_TOKEN for a row whose logits were not finite; cache holding
    the prompts).
  """
  last, cache = prefill_logits(config, params, cache, tokens, prompt_lengths)
  return sample(rng, probabilities(last, sampling)), cache


def prefill_logits(config: ModelConfig, params, cache, tokens, prompt_lengths):
  """`prefill` up to the logits (not jitted: for callers that jit their own step, e.g. with
  per-row `RowSampling`, which cannot be a static argument).

  Args:
    as `prefill`.
  Returns:
    (logits [B, V] float32 at each row's last new token, cache holding the new tokens).
  """
  logits, cache = chunk_logits(config, params, cache, tokens, prompt_lengths,
                               (prompt_lengths - 1)[:, None])
  return logits[:, 0], cache


def chunk_logits(config: ModelConfig, params, cache, tokens, counts, logits_at):
  """Write a chunk of new tokens per row to the cache and return logits at chosen tokens only
  (not jitted).

  Args:
    cache: a `PagedKVCache` holding cache.lengths[b] tokens of row b; the new tokens go at
      positions cache.lengths[b] + t.
    tokens: [B, T] int32 right-padded; counts: [B] int32 real new tokens per row (0: padding
      only).
    logits_at: [B, n] int32 indexes into T of the tokens whose logits are wanted (negative
      indexes count from T, as in numpy).
  Returns:
    (logits [B, n, V] float32, the next-token logits after each chosen token; cache holding the
    new tokens).
  """
  positions = cache.lengths[:, None] + prompt_positions(counts, tokens.shape[1])
  positions = jnp.where(positions >= cache.lengths[:, None], positions, -1)
  return Transformer(config).apply(params, tokens, positions, cache,
                                   logits_at=logits_at % tokens.shape[1])


def decode_step(config: ModelConfig, params, cache, token):
  """One token per row through the model at position cache.lengths.

  Args:
    token: [B] int32.
  Returns:
    (logits [B, V] float32, cache with lengths + 1).
  """
  logits, cache = Transformer(config).apply(params, token[:, None], cache.lengths[:, None], cache)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=('config', 'sampling', 'max_new_tokens'),
                   donate_argnames=('cache',))
def decode_autoregressive(config: ModelConfig, params, cache, first_token, rng, stop_tokens, *,
                          sampling: SamplingParams, max_new_tokens: int):
  """Plain autoregressive decoding until every row is done.

  Args:
    cache: the prefilled cache (donated); first_token: [B] int32 from `prefill`.
      The capacity is not checked inside the jitted loop (a too-small cache sends the writes
      past its pages to the null page, where they are lost); `generate` sizes and checks it.
    stop_tokens: [S] int32.
    max_new_tokens: static; counts the first token.
  Returns:
    (Output, cache); a row whose logits were not finite ends with INVALID_TOKEN (see
    `output.check_valid`).
  """
  b = first_token.shape[0]
  out, _ = commit(Output.empty(b, max_new_tokens + 1), first_token[:, None],
                  jnp.ones((b,), jnp.int32), stop_tokens, max_new_tokens)

  def body(state):
    cache, out, pending, rng = state
    rng, step_rng = jax.random.split(rng)
    old_lengths = cache.lengths
    logits, cache = decode_step(config, params, cache, pending)
    token = sample(step_rng, probabilities(logits, sampling))
    out, n = commit(out, token[:, None], jnp.ones((b,), jnp.int32), stop_tokens, max_new_tokens)
    # Finished rows keep their length, so their idle writes never outgrow the allocated pages.
    cache = rollback(cache, old_lengths + jnp.minimum(n, 1))
    return cache, out, jnp.where(n > 0, token, pending), rng

  cache, out, _, _ = jax.lax.while_loop(lambda s: ~jnp.all(s[1].done), body,
                                        (cache, out, first_token, rng))
  return out, cache
