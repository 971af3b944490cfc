"""Grouped-query attention over cached slots (pure jnp; the reference the Pallas kernels match)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxspec.checks import check_int


def slot_causal_mask(q_slots, num_keys: int, window: Optional[int] = None):
  """Which cached slots each query may attend to: key slot j is visible to a query at slot s iff
  0 <= j <= s (every slot below s holds an earlier token of the same sequence), and, with a
  sliding `window` (Mistral; Beltagy et al. 2020), s - window < j: the query and the window - 1
  tokens before it.

  Args:
    q_slots: [B, T] int32 slot of each query token, -1 for padding (sees nothing).
    num_keys: S, number of key slots.
    window: static int >= 1 or None (no window).
  Returns:
    [B, T, S] bool.
  Raises:
    ValueError: a window that is not an int >= 1 (0 would hide every key: zero outputs).
  """
  if window is not None:
    window = check_int('window', window, 1)
  key_slots = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]
  visible = key_slots <= q_slots[:, :, None]
  if window is not None:
    visible &= key_slots > q_slots[:, :, None] - window
  return visible


def masked_softmax(scores, visible):
  """Softmax over the last axis restricted to the visible keys.

  The operations of jax.nn.softmax, exp(x - max) / sum, in the same order: a row with a visible
  key whose score is finite and >= -1e30 rounds bit for bit as jax.nn.softmax did on the scores
  with invisible keys set to -1e30 (how this was computed before). Invisible keys get exactly 0,
  however small the visible scores (no finite stand-in that a visible score could undercut), and
  a row with no visible key, or only -inf scores, is all 0 (as the Pallas kernel). A NaN score
  makes its row NaN on the visible keys only.

  Args:
    scores: [..., S] float32.
    visible: bool, broadcastable to scores.shape.
  Returns:
    [..., S] float32.
  """
  x = jnp.where(visible, scores, -jnp.inf)
  # As jax.nn.softmax, the max is a constant to the gradient (training's gradients stay as they
  # were, bit for bit).
  x_max = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
  x_max = jnp.where(x_max == -jnp.inf, 0.0, x_max)        # no visible finite score: exp gives 0
  unnormalized = jnp.where(visible, jnp.exp(x - x_max), 0.0)
  total = jnp.sum(unnormalized, axis=-1, keepdims=True)
  # The outer where changes no value, but without it XLA:CPU fuses the division differently and
  # the mass sums round differently from before (tests/test_kernels_eviction.py compares them).
  return jnp.where(visible, unnormalized / jnp.where(total > 0, total, 1.0), 0.0)


def gqa_attention(q, k, v, mask):
  """Softmax attention with grouped-query heads, computed in float32.

  Args:
    q: [B, T, N, H] queries (after RoPE).
    k, v: [B, S, K, H] keys (after RoPE) and values; N must be a multiple of K.
    mask: [B, T, S] bool, True where the key is visible.
  Returns:
    [B, T, N, H] in q's dtype: 0 for a query that sees no key (padding) or whose visible scores
    are all -inf (`masked_softmax`; invisible keys never get weight).
  Raises:
    ValueError: q or k not 4-D, or N not a multiple of K (K >= 1).
  """
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f'q [B, T, N, H] and k [B, S, K, H] must be 4-D, got {q.shape} and {k.shape}')
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  if kv_heads < 1 or n % kv_heads:
    raise ValueError(f'query heads {n} not a multiple of kv heads {kv_heads} (>= 1)')
  g = n // kv_heads
  qg = q.reshape(b, t, kv_heads, g, h).astype(jnp.float32)
  scores = jnp.einsum('BTKGH,BSKH->BKGTS', qg, k.astype(jnp.float32)) * (h ** -0.5)
  probs = masked_softmax(scores, mask[:, None, None, :, :])
  # Contract over the minor axis of both operands: XLA:CPU then rounds each query row the same
  # way whatever T is, so one-token decode and K+1-token verification agree bit for bit.
  v_t = v.astype(jnp.float32).transpose(0, 2, 3, 1)                   # [B, K, H, S]
  out = jnp.einsum('BKGTS,BKHS->BKGTH', probs, v_t)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


def gqa_attention_per_query(q, k, v, mask):
  """`gqa_attention` evaluated one query token at a time (a `lax.map` over T).

  Each step has exactly the shapes of single-token decode, so XLA emits the same reductions and
  a (K+1)-token verification rounds like K+1 decode steps. A loop rather than T unrolled copies:
  one compiled body whatever T is (with the norms' add tree, `RMSNorm`, the test-tiny 16-token
  call compiles in ~0.9 s at XLA:CPU -O0, 1.3x the default mode's, against ~3.3 s unrolled:
  `scripts/exact_compile_time.py`), bit for bit the same at -O0 and at the default level
  (tests/test_paged_cache.py); one query is `gqa_attention` itself (eagerly, a one-step loop
  rounded unlike the op-by-op call: tests/test_kernels_eviction.py). Same args and result as
  gqa_attention.
  """
  if q.shape[1] == 1:
    return gqa_attention(q, k, v, mask)                               # a decode step's own call
  qs = jnp.moveaxis(q, 1, 0)[:, :, None]                              # [T, B, 1, N, H]
  ms = jnp.moveaxis(mask, 1, 0)[:, :, None]                           # [T, B, 1, S]
  out = jax.lax.map(lambda a: gqa_attention(a[0], k, v, a[1]), (qs, ms))   # [T, B, 1, N, H]
  return jnp.moveaxis(out[:, :, 0], 0, 1)
