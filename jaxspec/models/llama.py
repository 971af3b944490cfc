"""Llama-family decoder in Flax Linen (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Applied as a pure function with one code path for prefill chunks, single-token decode and K+1-token
verification:

    logits, cache = Transformer(config).apply(params, tokens, positions, cache)

tokens, positions: [B, T] int32; positions < 0 mark right padding. New tokens go to slots
cache.lengths[b] + t; the returned cache has lengths advanced by the number of real tokens.
With cache=None the call is plain causal attention over the T tokens (training).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec.cache import paged
from jaxspec.cache.eviction import attend_and_evict, check_no_sliding_window
from jaxspec.kernels import attention
from jaxspec.models import rope
from jaxspec.models.config import ModelConfig


# Row counts up to which XLA:CPU's matrix-matrix kernel rounds every row the same way (measured
# on the shapes of the shipped models); see `matmul_rows`.
EXACT_ROWS = 32


def matmul_rows(x, kernel, exact: bool = False):
  """x @ kernel over the last axis.

  With `exact`, each row is rounded the same way whatever the batch shape. XLA:CPU picks its
  matmul kernel (and so its summation order) from the row count: one row goes to a matrix-vector
  kernel, 2..32 rows share one blocking, more rows another. One-token decode and (K+1)-token
  verification would then differ in the last bits and could flip a greedy near-tie. In exact mode
  a call of at most EXACT_ROWS tokens per sequence pads a lone row to two and cuts more than
  EXACT_ROWS rows into blocks of EXACT_ROWS; longer calls (prefill) use one plain matmul. Exact
  mode makes single-token decode slower (the two-row kernel repacks the weights), so timings are
  taken with exact=False.

  Args:
    x: [B, T, D_in]; kernel: [D_in, D_out]; exact: static.
  Returns:
    [B, T, D_out].
  """
  lead = x.shape[:-1]
  rows = x.reshape(-1, x.shape[-1])
  if not exact or x.shape[-2] > EXACT_ROWS:
    out = rows @ kernel
  else:
    blocks = []
    for start in range(0, rows.shape[0], EXACT_ROWS):
      block = rows[start:start + EXACT_ROWS]
      if block.shape[0] == 1:
        blocks.append((jnp.concatenate([block, block]) @ kernel)[:1])
      else:
        blocks.append(block @ kernel)
    out = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks)
  return out.reshape(*lead, kernel.shape[-1])


def check_cache(config: ModelConfig, cache: paged.PagedKVCache) -> None:
  """At trace time: the cache was built for this model (`jaxspec.models.cache_for`).

  Raises:
    ValueError: pages of another shape ([layers, kv heads, P, L, head_dim]: another model's
      cache, e.g. the draft's, wrote past its layers silently) or another dtype than
      config.dtype (a float32 cache under a bfloat16 model doubled the KV bytes a benchmark
      moves, and a bfloat16 cache under a float32 model rounded every key), named.
  """
  pages = cache.k_pages
  want = (config.num_layers, config.num_kv_heads, config.head_dim)
  got = (pages.shape[0], pages.shape[1], pages.shape[-1]) if pages.ndim == 5 else None
  if got != want or cache.v_pages.shape != pages.shape:
    raise ValueError(f'the cache\'s pages {tuple(pages.shape)} / {tuple(cache.v_pages.shape)} '
                     f'are not this model\'s [layers={want[0]}, kv_heads={want[1]}, P, L, '
                     f'head_dim={want[2]}] (build it with jaxspec.models.cache_for(config, ...))')
  if pages.dtype != jnp.dtype(config.dtype) or cache.v_pages.dtype != pages.dtype:
    raise ValueError(f'the cache\'s pages are {pages.dtype} / {cache.v_pages.dtype}, the model\'s '
                     f'dtype is {config.dtype} (build it with jaxspec.models.cache_for(config, '
                     f'...), or init_cache(..., dtype=config.dtype))')


def exact_per_token(config, x, cache) -> bool:
  """Whether a [B, T, D] call's attention must run one query at a time so that it rounds
  exactly like T single-token decode steps: exact mode, a cached call of 2..EXACT_ROWS tokens
  (verification)."""
  return exact_norm(config, x, cache) and x.shape[1] > 1


def exact_norm(config, x, cache) -> bool:
  """Whether a [B, T, D] call's norms must sum in `RMSNorm`'s fixed tree so that they round
  alike for every T: exact mode, a cached call of at most EXACT_ROWS tokens (one-token decode
  and verification)."""
  return config.exact_verify and cache is not None and x.shape[1] <= EXACT_ROWS


class Linear(nn.Module):
  """Dense layer without bias by default; params {'kernel': [D_in, D_out]} (+ 'bias')."""

  features: int
  use_bias: bool = False
  dtype: str = 'float32'
  exact: bool = False

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.normal(x.shape[-1] ** -0.5),
                        (x.shape[-1], self.features), jnp.float32)
    y = matmul_rows(x.astype(self.dtype), kernel.astype(self.dtype), self.exact)
    if self.use_bias:
      y = y + self.param('bias', nn.initializers.zeros, (self.features,)).astype(self.dtype)
    return y


class RMSNorm(nn.Module):
  """x / rms(x) * scale, computed in float32 (Zhang & Sennrich 2019).

  With `exact=True` (`exact_norm`) the mean of squares over the feature axis is summed as a
  fixed binary tree of elementwise adds (the axis zero-padded to a power of two), the same
  order for every token whatever T is: XLA:CPU's row reduction changes its summation order with
  the number of rows, so this is how (K+1)-token verification rounds exactly like single-token
  decode (see `matmul_rows`). Each token normalised on its own, unrolled over T, was T copies
  to compile (`scripts/exact_compile_time.py` times the exact call); a `lax.map` over T did
  not round like decode at -O2. x: [..., D] of any float dtype; returns the same shape and dtype.
  """

  eps: float = 1e-5

  @nn.compact
  def __call__(self, x, exact: bool = False):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))

    if x.dtype in (jnp.bfloat16, jnp.float16):
      # Round the norm's input (the residual stream) to its dtype: XLA:CPU's excess precision
      # otherwise fuses the low-precision residual add into this float32 cast without rounding,
      # and fuses it differently for T = 1 and T = K + 1, so verification and decode disagreed
      # (bfloat16).
      info = jnp.finfo(x.dtype)
      x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)

    x32 = x.astype(jnp.float32)
    if exact:
      squares = x32 * x32
      d = squares.shape[-1]
      width = 1 << (d - 1).bit_length()
      if width != d:
        squares = jnp.pad(squares, [(0, 0)] * (squares.ndim - 1) + [(0, width - d)])
      while squares.shape[-1] > 1:
        half = squares.shape[-1] // 2
        squares = squares[..., :half] + squares[..., half:]
      mean = squares / d
    else:
      mean = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(mean + self.eps)
    return (y * scale).astype(x.dtype)


def apply_rope(x, positions, theta: float, scaling: tuple = ()):
  """Rotary position embedding, half-split convention (as Hugging Face Llama, Su et al. 2021).

  Args:
    x: [B, T, heads, H]; positions: [B, T] int32 absolute positions.
    theta: base; scaling: () or a normalized rope_scaling (see `jaxspec.models.rope`).
  Returns:
    [B, T, heads, H] rotated, in x's dtype.
  """
  inv_freq = rope.inverse_frequencies(x.shape[-1], theta, scaling)    # [H/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq        # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


class Attention(nn.Module):
  config: ModelConfig
  layer: int

  @nn.compact
  def __call__(self, x, positions, slots, cache, eviction=None):
    c = self.config
    b, t, _ = x.shape
    q = Linear(c.num_heads * c.head_dim, c.qkv_bias, c.dtype, c.exact_verify, name='q')(x)
    k = Linear(c.num_kv_heads * c.head_dim, c.qkv_bias, c.dtype, c.exact_verify, name='k')(x)
    v = Linear(c.num_kv_heads * c.head_dim, c.qkv_bias, c.dtype, c.exact_verify, name='v')(x)
    q = apply_rope(q.reshape(b, t, c.num_heads, c.head_dim), positions, c.rope_theta,
                   c.rope_scaling)
    k = apply_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), positions, c.rope_theta,
                   c.rope_scaling)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if eviction is not None:  # slots chosen by the eviction policy, attention masked by position
      check_no_sliding_window(c)      # at trace time: before any output
      out, cache, history = attend_and_evict(q, k, v, positions, cache, eviction, self.layer)
      out = Linear(c.d_model, dtype=c.dtype, exact=c.exact_verify, name='o')(out.reshape(b, t, -1))
      return out, cache, history
    if cache is None:
      keys, values = k, v
    else:
      pages, offsets = paged.slot_address(cache.page_table, slots, cache.page_size)
      k_pages, v_pages = paged.write_keys_values(cache.k_pages, cache.v_pages, self.layer, pages,
                                                 offsets, k, v)
      cache = cache.replace(k_pages=k_pages, v_pages=v_pages)
      keys = paged.gather_kv(cache.k_pages, self.layer, cache.page_table)
      values = paged.gather_kv(cache.v_pages, self.layer, cache.page_table)
    mask = attention.slot_causal_mask(slots, keys.shape[1], c.sliding_window)
    if exact_per_token(c, x, cache):
      # Verification: attend one query at a time with the very computation of a decode step, so
      # both round identically (see matmul_rows).
      out = attention.gqa_attention_per_query(q, keys, values, mask)
    else:
      out = attention.gqa_attention(q, keys, values, mask)
    out = Linear(c.d_model, dtype=c.dtype, exact=c.exact_verify, name='o')(out.reshape(b, t, -1))
    return out, cache, None


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    gate = Linear(c.d_ff, dtype=c.dtype, exact=c.exact_verify, name='gate')(x)
    up = Linear(c.d_ff, dtype=c.dtype, exact=c.exact_verify, name='up')(x)
    down = Linear(c.d_model, dtype=c.dtype, exact=c.exact_verify, name='down')
    return down(jax.nn.silu(gate) * up)


class Block(nn.Module):
  config: ModelConfig
  layer: int

  @nn.compact
  def __call__(self, x, positions, slots, cache, eviction=None):
    c = self.config
    exact = exact_norm(c, x, cache)
    h, cache, history = Attention(c, self.layer, name='attn')(
        RMSNorm(c.norm_eps, name='attn_norm')(x, exact), positions, slots, cache, eviction)
    x = x + h
    x = x + MLP(c, name='mlp')(RMSNorm(c.norm_eps, name='mlp_norm')(x, exact))
    return x, cache, history


class Transformer(nn.Module):
  """The decoder. `__call__(tokens, positions, cache) -> (logits [B, T, V] float32, cache)`.

  Args (of __call__):
    tokens: [B, T] int32 token ids.
    positions: [B, T] int32 absolute positions for RoPE; -1 marks padding. Real tokens must come
      first in each row (right padding).
    cache: a `PagedKVCache` whose lengths give where each row's new tokens go, or None for plain
      causal attention over the T tokens (training; positions then must be 0..T-1 per row).
  Returns:
    logits: [B, T, V] float32; cache: with the new keys/values written and lengths advanced by
      the number of real tokens per row (None when called with None).
    With `eviction` (a `jaxspec.cache.EvictionState`, which needs a cache), new keys go to the
    slots the eviction policy chooses, attention is masked by position, and a third result is
    the per-token eviction history (arrays [T, layers, B, S]; see `eviction.after_tokens`).
    With `logits_at` ([B, n] int32 indexes into T), logits are computed at those tokens only
    ([B, n, V]): prefill needs the last token's, and the unembedding is a large share of a small
    model's cost.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, cache: Optional[paged.PagedKVCache] = None,
               eviction=None, logits_at=None):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.d_model, embedding_init=nn.initializers.normal(1.0),
                     name='embed')
    x = embed(tokens).astype(c.dtype)
    valid = positions >= 0
    t = tokens.shape[1]
    if cache is None:
      slots = jnp.where(valid, jnp.arange(t, dtype=jnp.int32)[None, :], -1)
    else:
      slots = jnp.where(valid, cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32), -1)
    if eviction is not None and cache is None:
      raise ValueError('eviction needs a cache, got cache=None')
    if cache is not None:
      check_cache(c, cache)
    histories = []
    for i in range(c.num_layers):
      x, cache, history = Block(c, i, name=f'layer_{i}')(x, positions, slots, cache, eviction)
      histories.append(history)
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
    x = RMSNorm(c.norm_eps, name='final_norm')(x, exact_norm(c, x, cache))
    if c.tie_embeddings:
      logits = matmul_rows(x, embed.embedding.T.astype(c.dtype), c.exact_verify)
    else:
      logits = Linear(c.vocab_size, dtype=c.dtype, exact=c.exact_verify, name='lm_head')(x)
    if cache is not None:
      cache = cache.replace(lengths=cache.lengths + valid.sum(axis=1, dtype=jnp.int32))
    if eviction is not None:
      key_pos, free_from, scores = (jnp.stack(f, axis=1) for f in zip(*histories))
      return logits.astype(jnp.float32), cache, eviction.replace(
          key_pos=key_pos, free_from=free_from, scores=scores)
    return logits.astype(jnp.float32), cache
