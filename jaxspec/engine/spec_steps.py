"""Device steps of the engine's drafters (`jaxspec.engine.drafters`): verify proposals of a draft
model or of the host, with a per-row cap on how many of the K proposals count, and the K = 0
round that keeps a draft model's cache in sync. Jitted once per static shape (rows, K), never per
request; rows are bound as in `jaxspec.engine.device` (idle rows: null page, room 0).

`draft_catch_up` brings a lazily kept draft cache up to the target's (`jaxspec.engine.draft_sync`)
and scores the draft on tokens the target drew meanwhile.

Verification is modified rejection sampling (Leviathan et al. 2023, Alg. 1) over the target's
[B, K+1] pass on [pending, x_1..x_K]. Positions at or past a row's cap get q = 0: they are not
proposals, so `rejection_sample` rejects them and draws that position from p itself, which is
what capping a row's acceptance at `caps[b]` means. Host proposals (prompt lookup) have one-hot
q: x is accepted with probability p(x); after a rejection the token is drawn from p with x
removed, renormalised (the residual max(0, p - onehot(x))).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.decoding.autoregressive import chunk_logits, decode_step
from jaxspec.decoding.output import cut_lengths
from jaxspec.decoding.sampling import INVALID_TOKEN, RowSampling, probabilities, sample
from jaxspec.decoding.speculative import accept, draft_tokens, verify, verify_pass
from jaxspec.engine.device import top_probability
from jaxspec.models import ModelConfig


def _capped(q, caps):
  """q with every position at or past caps[b] zeroed. q: [B, K, V]; caps: [B] int32."""
  k = q.shape[1]
  return jnp.where(jnp.arange(k)[None, :, None] < caps[:, None, None], q, 0.0)


def host_q(proposals, num_proposed, vocab: int):
  """q of host proposals: one-hot(proposal) on each row's first num_proposed[b] positions, zero
  after (not proposals).

  Args:
    proposals: [B, K] int32; num_proposed: [B] int32 in [0, K]; vocab: V.
  Returns:
    [B, K, V] float32.
  """
  return _capped(jax.nn.one_hot(proposals, vocab, dtype=jnp.float32), num_proposed)


@functools.partial(jax.jit, static_argnames=('target', 'draft', 'k', 'confidence'),
                   donate_argnames=('target_cache', 'draft_cache'))
def model_step(target: ModelConfig, draft: ModelConfig, target_params, draft_params, target_cache,
               draft_cache, pending, room, stop, caps, rng, sampling: RowSampling, *, k: int,
               confidence: bool = False):
  """Batched speculative decoding with a draft model, each row's acceptance capped at caps[b].

  The draft drafts K for every row (the static shape); a row with caps[b] < K accepts at most
  caps[b] of them. With caps = K this is `jaxspec.decoding.speculative.speculative_round` (same
  random stream, same tokens). Cache invariant of `jaxspec.decoding.speculative`: the draft
  wrote pending, x_1..x_{K-1}, plus x_K by one more draft step when some row emits all K + 1;
  the host rolls both caches back to lengths + emitted (the next call's bound lengths).

  Args:
    target_cache, draft_cache: bound caches (donated), same page tables and lengths.
    pending: [B] int32; room: [B] int32 tokens a row may still emit (0: idle row);
    stop: [B, S] int32 stop ids, -1 padded; caps: [B] int32 in [0, K].
    sampling: [B] per-row parameters (traced; draft and target both process their logits with
      the row's, as exact speculative sampling needs).
    k: static K >= 1.
    confidence: static; whether to return max_p (an exp over [B, K+1, V]: alone 0.05 ms at
      B = 4, K = 2 and 0.9 ms at B = 64, K = 8 on the development CPU; inside the step, within
      the timing noise of an idle round).
  Returns:
    (window [B, K+1] int32, num_accepted [B] int32 n <= caps, emitted [B] int32 after stop /
    max-token cuts, draft_failed [B] bool: the draft had no distribution (NaN or +inf logits) at
    some position, its proposals INVALID_TOKEN, max_p [B, K+1] float32 the target's top
    probability at each window position (`device.top_probability`: its confidence where it drew
    that token, as a K = 0 round reports it; None unless `confidence`), target_cache,
    draft_cache).
  """
  rng_draft, rng_accept = jax.random.split(rng)
  xs, qs, draft_cache = draft_tokens(draft, draft_params, draft_cache, pending, rng_draft, k=k,
                                     sampling=sampling)
  logits, target_cache = verify_pass(target, target_params, target_cache, pending, xs)
  window, n = accept(rng_accept, xs, _capped(qs, caps), probabilities(logits, sampling))
  emitted, _ = cut_lengths(window, n + 1, stop, room)
  draft_cache = jax.lax.cond(
      jnp.any(emitted == k + 1),
      lambda c: decode_step(draft, draft_params, c, window[:, k - 1])[1],
      lambda c: c, draft_cache)
  return (window, n, emitted, jnp.any(xs == INVALID_TOKEN, axis=1),
          top_probability(logits) if confidence else None, target_cache, draft_cache)


@functools.partial(jax.jit, static_argnames=('target', 'draft'),
                   donate_argnames=('target_cache', 'draft_cache'))
def model_sync_step(target: ModelConfig, draft: ModelConfig, target_params, draft_params,
                    target_cache, draft_cache, pending, room, stop, rng, sampling: RowSampling):
  """A K = 0 round with a draft model: one target step, and one draft step on the same pending
  token so the draft cache keeps the target's context. The draft's q for the next position
  gives this round's acceptance probability of one drafted token, β = Σ_v min(p(v), q(v))
  (Leviathan et al. 2023, Def. 3.1, α = E[β]), so an adaptive K can see α rise again while
  it does not speculate.

  Args:
    as `model_step` without caps and K.
  Returns:
    (window [B, 1] int32 the token drawn from p, emitted [B] int32 0 or 1, beta [B] float32 in
    [0, 1], draft_failed [B] bool: the draft had no distribution (NaN or +inf logits),
    target_cache, draft_cache), both caches with pending written.
  """
  logits, target_cache = decode_step(target, target_params, target_cache, pending)
  p = probabilities(logits, sampling)
  draft_logits, draft_cache = decode_step(draft, draft_params, draft_cache, pending)
  q = probabilities(draft_logits, sampling)
  beta = jnp.minimum(p, q).sum(axis=-1)
  beta = jnp.where(jnp.isnan(beta), 0.0, beta)     # a draft (or target) with no distribution
  window = sample(rng, p)[:, None]
  emitted, _ = cut_lengths(window, jnp.ones_like(room), stop, room)
  return window, emitted, beta, jnp.isnan(q).any(axis=-1), target_cache, draft_cache


@functools.partial(jax.jit, static_argnames=('target',), donate_argnames=('target_cache',))
def lookup_step(target: ModelConfig, target_params, target_cache, pending, proposals,
                num_proposed, room, stop, rng, sampling: RowSampling):
  """Verify host proposals (prompt lookup): q = one-hot(proposal) on each row's first
  num_proposed[b] positions, zero after (those positions draw from p).

  Args:
    target_cache: bound cache (donated).
    pending, room, stop, sampling: as `model_step`.
    proposals: [B, K] int32 (any id in [0, V) past num_proposed); num_proposed: [B] int32 in
      [0, K]. K (static) is proposals.shape[1] >= 1.
  Returns:
    (window [B, K+1] int32, num_accepted [B] int32 <= num_proposed, emitted [B] int32,
    target_cache).
  """
  q = host_q(proposals, num_proposed, target.vocab_size)
  window, n, target_cache = verify(target, target_params, target_cache, pending, proposals, q,
                                   rng, sampling=sampling)
  emitted, _ = cut_lengths(window, n + 1, stop, room)
  return window, n, emitted, target_cache


@functools.partial(jax.jit, static_argnames=('draft',), donate_argnames=('draft_cache',))
def draft_catch_up(draft: ModelConfig, draft_params, draft_cache, tokens, counts, observe_at,
                   observe_next, observe_p, sampling: RowSampling):
  """One chunk of a draft cache's catch-up (the draft alone: a prefill of tokens the target
  already holds), scoring the draft at chosen tokens against what the target drew next.

  For a token x the target drew from p after some position, the draft's q at that position
  gives the score s = min(1, q(x) / p(x)), and E_{x~p}[s] = Σ_v min(p(v), q(v)) = α, the
  acceptance probability of one drafted token there (Leviathan et al. 2023, Def. 3.1). For
  greedy rows p(x) = 1 and s = q(x).

  Args:
    draft_cache: bound draft cache (donated); row r holds lengths[r] tokens already.
    tokens: [R, C] int32 new tokens, right-padded; counts: [R] int32 real ones (0: idle row,
      bound to the null page).
    observe_at: [R, M] int32 indexes into C of the tokens after which the draft is scored.
    observe_next: [R, M] int32 the token the target drew after each; observe_p: [R, M] float32
      its probability under the target's p, 0 where nothing is observed.
    sampling: [R] per-row parameters, the rows' requests' (q is processed as p was).
  Scored tokens that follow each other (observe_at[:, j + 1] = observe_at[:, j] + 1, both
  scored) also give the later proposals' evidence: a second drafted token is verified only when
  the first was accepted, and then (greedy: the accepted token is the target's) the draft drafts
  it from the context it was scored on here, so Σ s_j s_{j+1} / Σ s_j estimates β, the
  acceptance of a proposal after an accepted one (exact in expectation for greedy rows, whose s
  are 0 or 1; for sampled rows an approximation that takes the two scores as the acceptances).

  Returns:
    (successes [R] float32 Σ s, trials [R] float32 scored tokens, later_successes [R] float32
    Σ s_j s_{j+1} and later_trials [R] float32 Σ s_j over the pairs of consecutive scored tokens,
    draft_failed [R] bool: the draft had no distribution (NaN or +inf logits) at a scored
    token, draft_cache).
  """
  logits, draft_cache = chunk_logits(draft, draft_params, draft_cache, tokens, counts, observe_at)
  q = jnp.take_along_axis(probabilities(logits, sampling), observe_next[..., None], axis=-1)
  seen = observe_p > 0
  beta = jnp.where(seen, jnp.minimum(1.0, q[..., 0] / jnp.where(seen, observe_p, 1.0)), 0.0)
  failed = jnp.any(seen & jnp.isnan(beta), axis=1)
  beta = jnp.where(jnp.isnan(beta), 0.0, beta)     # a draft with no distribution accepts nothing
  pair = seen[:, :-1] & seen[:, 1:] & (observe_at[:, 1:] == observe_at[:, :-1] + 1)
  later_trials = jnp.where(pair, beta[:, :-1], 0.0).sum(axis=1)
  later_successes = jnp.where(pair, beta[:, :-1] * beta[:, 1:], 0.0).sum(axis=1)
  return (beta.sum(axis=1), seen.sum(axis=1).astype(jnp.float32), later_successes,
          later_trials, failed, draft_cache)


STEPS = (model_step, model_sync_step, lookup_step, draft_catch_up)
