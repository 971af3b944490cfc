"""Speculative decoding: a draft proposes K tokens, the target verifies all K in one forward pass,
modified rejection sampling keeps the target's distribution (Leviathan et al. 2023, Alg. 1;
Chen et al. 2023). The draft's K steps are one `lax.scan`; the whole loop is one `lax.while_loop`.

Invariant between rounds: both caches hold every committed token except the last one, `pending`,
which is the input of the next round (so the draft's context always equals the target's).
"""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp

from jaxspec.cache import rollback
from jaxspec.checks import check_int, is_int_in
from jaxspec.decoding.autoregressive import decode_step
from jaxspec.decoding.output import Output, commit
from jaxspec.decoding.rejection import rejection_sample
from jaxspec.decoding.sampling import INVALID_TOKEN, SamplingParams, probabilities, sample
from jaxspec.models import ModelConfig, Transformer
from jaxspec.models.llama import EXACT_ROWS


def proposals_in_reach(k, accepted, emitted):
  """The draft tokens of one round that count as proposed for α = accepted ÷ proposed: all K,
  unless a stop token or the max-token limit cut the round before its first rejection, when only
  the `emitted` tokens (every one an accepted proposal) were in play and the proposals past the
  cut could not be accepted whatever the draft said (counted, a draft equal to the target read
  α = 4/6 at K = 3 with max_tokens 6). A rejection that was reached counts all K, as usual: α
  is Leviathan et al. 2023's acceptance rate, measured over the proposals verification could
  accept.

  Args:
    k: proposals drafted (K, or a row's `num_proposed`); accepted: n, accepted by verification;
      emitted: tokens the round emitted after the cuts. Ints or integer arrays (numpy or jax),
      elementwise.
  Returns:
    emitted where accepted >= emitted, else k (same type as the arguments).
  """
  return emitted + (accepted < emitted) * (k - emitted)


@flax.struct.dataclass
class SpecStats:
  """Per-row counters of the decode loop (the prefill's first token is not counted).

  Fields (all [B] int32):
    proposed: draft tokens proposed (K per round the row was active, fewer in a round cut
      before its first rejection: `proposals_in_reach`).
    accepted: proposed tokens accepted *and emitted* (a stop token or max_new_tokens cuts them).
    emitted: tokens emitted by the rounds (accepted + correction/bonus, after cuts).
    target_calls: target forward passes (rounds the row was active).
    rejected: rounds in which a draft token was rejected (n < K) and the rejection was reached
      (no stop token or max_new_tokens cut the round before it). accepted / (accepted +
      rejected) estimates the per-position acceptance probability of Leviathan et al.'s analysis.
    draft_failed: rounds of an active row in which the draft had no distribution at some
      position (its logits NaN or +inf): those proposals are INVALID_TOKEN, always rejected, so
      the output is still the target's but α measures a broken draft.
  """

  proposed: jax.Array
  accepted: jax.Array
  emitted: jax.Array
  target_calls: jax.Array
  rejected: jax.Array
  draft_failed: jax.Array

  @classmethod
  def zeros(cls, batch: int) -> 'SpecStats':
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, z, z, z, z)

  def after_round(self, active, n, emitted, k: int, failed) -> 'SpecStats':
    """The counters after one round.

    Args:
      active: [B] bool, rows that were not done before the round.
      n: [B] int32 draft tokens accepted by rejection sampling; emitted: [B] int32 tokens
        committed after the stop-token / max-token cut; k: static K.
      failed: [B] bool, rows whose proposals hold INVALID_TOKEN (the draft had no distribution).
    """
    act = active.astype(jnp.int32)
    return SpecStats(proposed=self.proposed + act * proposals_in_reach(k, n, emitted),
                     accepted=self.accepted + jnp.minimum(n, emitted),
                     emitted=self.emitted + emitted,
                     target_calls=self.target_calls + act,
                     rejected=self.rejected + act * ((n < k) & (emitted == n + 1)),
                     draft_failed=self.draft_failed + act * failed.astype(jnp.int32))


def draft_tokens(draft: ModelConfig, draft_params, draft_cache, pending, rng, *, k: int,
                 sampling: SamplingParams):
  """The draft proposes K tokens autoregressively in one `lax.scan`.

  Args:
    pending: [B] int32, the last committed token (not yet in either cache).
  Returns:
    tokens: [B, K] int32 x_1..x_K; q: [B, K, V] float32, the processed distribution each x_i was
    drawn from; draft_cache with pending, x_1..x_{K-1} written (lengths + K).
  Raises:
    ValueError: k not an int >= 1 (0 returned no proposals without a word).
  """
  k = check_int('speculation length K', k, 1)

  def one(carry, step_rng):
    cache, token = carry
    logits, cache = decode_step(draft, draft_params, cache, token)
    q = probabilities(logits, sampling)
    x = sample(step_rng, q)
    return (cache, x), (x, q)

  (draft_cache, _), (xs, qs) = jax.lax.scan(one, (draft_cache, pending), jax.random.split(rng, k))
  return xs.T, qs.transpose(1, 0, 2), draft_cache


def check_pair(target: ModelConfig, draft: ModelConfig, k) -> None:
  """Trace-time checks of the jitted speculative entry points (`generate` checks the same on
  the host first, with the request).

  Raises:
    ValueError: K not an int >= 1 (0 ran as autoregressive decoding, -1 divided by zero), a
      draft whose vocabulary differs from the target's (named), or K + 1 > EXACT_ROWS with the
      target's exact_verify (past those rows verification no longer rounds like decode).
  """
  if not is_int_in(k, 1, math.inf):
    raise ValueError(f'speculation length K must be an int >= 1, got k={k!r}')
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f'draft vocabulary ({draft.vocab_size}) differs from the target '
                     f'vocabulary ({target.vocab_size})')
  if target.exact_verify and k + 1 > EXACT_ROWS:
    raise ValueError(f'K = {k} with exact_verify: a verification of K + 1 = {k + 1} tokens '
                     f'is past the {EXACT_ROWS} rows that round exactly like decode steps '
                     f'(jaxspec.models.llama.EXACT_ROWS); use K <= {EXACT_ROWS - 1} or '
                     f'exact_verify=False')


def speculative_round(target: ModelConfig, draft: ModelConfig, target_params, draft_params,
                      target_cache, draft_cache, pending, rng, *, k: int,
                      sampling: SamplingParams):
  """Draft K, verify K+1 positions in one target pass, accept/reject.

  Returns:
    window: [B, K+1] int32, x_1..x_n followed by the correction/bonus token at index n;
    num_accepted: [B] int32 n in [0, K]; target_cache (lengths + K+1) and draft_cache
    (lengths + K), both still to be rolled back to what is committed.
  Raises:
    ValueError: see `check_pair`.
  """
  return _round(target, draft, target_params, draft_params, target_cache, draft_cache, pending,
                rng, k=k, sampling=sampling)[:4]


def _round(target, draft, target_params, draft_params, target_cache, draft_cache, pending, rng,
           *, k, sampling):
  """`speculative_round`'s results and [B] bool: the row's proposals hold INVALID_TOKEN."""
  check_pair(target, draft, k)
  rng_draft, rng_accept = jax.random.split(rng)
  xs, qs, draft_cache = draft_tokens(draft, draft_params, draft_cache, pending, rng_draft,
                                     k=k, sampling=sampling)
  window, n, target_cache = verify(target, target_params, target_cache, pending, xs, qs,
                                   rng_accept, sampling=sampling)
  return window, n, target_cache, draft_cache, jnp.any(xs == INVALID_TOKEN, axis=1)


def verify(target: ModelConfig, target_params, target_cache, pending, xs, q, rng, *, sampling):
  """One target pass over [pending, x_1..x_K] and modified rejection sampling (the verify half
  of a round; proposals may come from a draft model or from the host, e.g. prompt lookup with
  one-hot q).

  Args:
    target_cache: row b holds every committed token but pending[b].
    pending: [B] int32; xs: [B, K] int32 proposals; q: [B, K, V] float32 the distribution each
      x_i was drawn from (all zeros at a position: not a proposal, rejected, drawn from p).
    rng: PRNG key of the acceptance test.
    sampling: `SamplingParams` or `RowSampling`.
  Returns:
    (window [B, K+1] int32 x_1..x_n then the correction/bonus token at index n, num_accepted [B]
    int32 n, target_cache with K+1 slots written per row).
  """
  logits, target_cache = verify_pass(target, target_params, target_cache, pending, xs)
  window, n = accept(rng, xs, q, probabilities(logits, sampling))
  return window, n, target_cache


def verify_pass(target: ModelConfig, target_params, target_cache, pending, xs):
  """The target's pass of `verify` over [pending, x_1..x_K], without the acceptance test (the
  verification pass of Leviathan et al. 2023, Alg. 1).

  Args:
    target_cache: row b holds every committed token but pending[b].
    pending: [B] int32; xs: [B, K] int32 proposals.
  Returns:
    (logits [B, K+1, V] (position j's distribution drew window token j), target_cache with K+1
    slots written per row).
  """
  tokens = jnp.concatenate([pending[:, None], xs], axis=1)                   # [B, K+1]
  positions = target_cache.lengths[:, None] + jnp.arange(xs.shape[1] + 1, dtype=jnp.int32)
  return Transformer(target).apply(target_params, tokens, positions, target_cache)


def accept(rng, xs, q, p):
  """Modified rejection sampling of a round's proposals (Leviathan et al. 2023, Alg. 1) and the
  tokens it emits.

  Args:
    rng: PRNG key; xs: [B, K] int32 proposals; q: [B, K, V] float32 the distribution each was
      drawn from (zeros: not a proposal, rejected); p: [B, K+1, V] float32 the target's
      distributions at [pending, x_1..x_K].
  Returns:
    (window [B, K+1] int32: x_1..x_n then the correction/bonus token at index n, n [B] int32
    proposals accepted).
  """
  n, next_token = rejection_sample(rng, xs, q, p)
  idx = jnp.arange(xs.shape[1] + 1, dtype=jnp.int32)[None, :]
  window = jnp.where(idx < n[:, None], jnp.pad(xs, ((0, 0), (0, 1))), next_token[:, None])
  return window, n


@functools.partial(jax.jit, static_argnames=('target', 'draft', 'k', 'sampling', 'max_new_tokens'),
                   donate_argnames=('target_cache', 'draft_cache'))
def decode_speculative(target: ModelConfig, draft: ModelConfig, target_params, draft_params,
                       target_cache, draft_cache, first_token, rng, stop_tokens, *, k: int,
                       sampling: SamplingParams, max_new_tokens: int):
  """Speculative decoding until every row is done; each row accepts its own number of tokens.

  Args:
    target_cache, draft_cache: both prefilled with the same prompts (donated); capacity at least
      prompt + max_new_tokens + k + 1 tokens.
      The capacity is not checked inside the jitted loop (a too-small cache sends the writes
      past its pages to the null page, where they are lost); `generate` sizes and checks it.
    first_token: [B] int32 drawn from the target at prefill.
    stop_tokens: [S] int32.
    k: static speculation length K >= 1.
  Returns:
    (Output, SpecStats, target_cache, draft_cache); a row whose target logits were not finite
    ends with INVALID_TOKEN (see `output.check_valid`; a draft's non-finite logits only make
    its proposals non-proposals, drawn from the target's p).
  Raises:
    ValueError (at trace time): see `check_pair`.
  """
  check_pair(target, draft, k)
  b = first_token.shape[0]
  out, _ = commit(Output.empty(b, max_new_tokens + k + 1), first_token[:, None],
                  jnp.ones((b,), jnp.int32), stop_tokens, max_new_tokens)

  def body(state):
    target_cache, draft_cache, out, stats, pending, rng = state
    rng, round_rng = jax.random.split(rng)
    active = ~out.done
    old_lengths = target_cache.lengths
    window, n, target_cache, draft_cache, failed = _round(
        target, draft, target_params, draft_params, target_cache, draft_cache, pending,
        round_rng, k=k, sampling=sampling)
    out, emitted = commit(out, window, n + 1, stop_tokens, max_new_tokens)
    # The draft wrote pending, x_1..x_{K-1}; when a row keeps all K it also needs x_K.
    draft_cache = jax.lax.cond(
        jnp.any(emitted == k + 1),
        lambda c: decode_step(draft, draft_params, c, window[:, k - 1])[1],
        lambda c: c, draft_cache)
    # Keep pending + the first emitted-1 committed tokens; the last emitted token is next pending.
    keep = old_lengths + jnp.where(emitted > 0, emitted, 0)
    target_cache = rollback(target_cache, keep)
    draft_cache = rollback(draft_cache, keep)
    last = jnp.take_along_axis(window, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(emitted > 0, last, pending)
    stats = stats.after_round(active, n, emitted, k, failed)
    return target_cache, draft_cache, out, stats, pending, rng

  state = (target_cache, draft_cache, out, SpecStats.zeros(b), first_token, rng)
  target_cache, draft_cache, out, stats, _, _ = jax.lax.while_loop(
      lambda s: ~jnp.all(s[2].done), body, state)
  return out, stats, target_cache, draft_cache
