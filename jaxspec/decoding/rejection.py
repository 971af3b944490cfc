"""Modified rejection sampling: the acceptance rule that keeps speculative decoding lossless.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding"), Algorithm 1;
Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import sample


def rejection_sample(rng, draft_tokens, q, p):
  """Accept a prefix of the draft and emit one more token, so output ~ p exactly.

  For i = 1..K, draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the
  first rejection one token is drawn from norm(max(0, p_i - q_i)) and the rest are discarded. If
  all K are accepted, a bonus token is drawn from p_{K+1}. With one-hot p and q (greedy) this is
  "accept while the draft equals the target's argmax, then emit the target's argmax".

  Args:
    rng: PRNG key.
    draft_tokens: [B, K] int32 proposed tokens x_1..x_K; an id outside [0, V) (e.g. -1
      padding) is not a proposal either, whatever its q: rejected and drawn from p (indexing
      would have wrapped -1 round to V - 1 and could accept it).
    q: [B, K, V] float32 (any float dtype is computed in float32), the exact distribution each
      x_i was drawn from; a position whose q is all zeros is not a proposal: it is rejected and
      its token drawn from p (one-hot q is the host-proposal case, e.g. prompt lookup: accept x
      with probability p(x)).
    p: [B, K+1, V] float32, the target's processed distribution at each of the K+1 positions.
  Returns:
    num_accepted: [B] int32 in [0, K], the length of the accepted prefix.
    next_token: [B] int32, the correction (at position num_accepted) or bonus token.
  Raises:
    ValueError (at trace time): shapes other than the above, e.g. q over another vocabulary than
      p (a [B, K, 1] q broadcast against p silently and drew token 0 far too often).
  """
  if (draft_tokens.ndim != 2 or q.ndim != 3 or p.ndim != 3 or
      q.shape != (*draft_tokens.shape, p.shape[-1]) or
      p.shape[:2] != (draft_tokens.shape[0], draft_tokens.shape[1] + 1)):
    raise ValueError(f'rejection_sample needs draft_tokens [B, K], q [B, K, V] and p '
                     f'[B, K+1, V], got {tuple(draft_tokens.shape)}, {tuple(q.shape)} and '
                     f'{tuple(p.shape)}')
  b, k = draft_tokens.shape
  q, p = jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32)
  proposed = (draft_tokens >= 0) & (draft_tokens < p.shape[-1])
  q = jnp.where(proposed[..., None], q, 0.0)      # not a proposal: rejected, drawn from p itself
  rng_accept, rng_next = jax.random.split(rng)
  p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
  q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]         # [B, K]
  r = jax.random.uniform(rng_accept, (b, k))
  # r < p/q written as r * q < p (no division). A token with q = 0 was not drawn from q (a
  # position that is not a proposal, e.g. past a row's num_proposed): it is always rejected, and
  # the residual max(0, p - 0) = p then draws that position from p itself.
  accepted = (q_draft > 0) & (r * q_draft < p_draft)
  num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)    # [B]

  p_at = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]           # [B, V]
  q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)                  # q_{K+1} = 0
  q_at = jnp.take_along_axis(q_padded, num_accepted[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_at - q_at, 0.0)
  mass = residual.sum(axis=-1, keepdims=True)
  # After a rejection p != q so the residual has mass; guard the p == q rounding corner anyway.
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
  return num_accepted.astype(jnp.int32), sample(rng_next, residual)
