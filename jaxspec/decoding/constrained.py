"""Constrained decoding: every emitted token is allowed by a `TokenConstraint` (a JSON schema or a
regular expression), so the text always parses and validates.

The allowed set depends on the tokens chosen so far, so the loop steps on the host, one token
(autoregressive) or one speculative round at a time; each device step (chunked prefill, one
masked decode step, one masked verification) is jitted once per shape with its cache donated.

Constrained speculative decoding applies the same mask to the draft's q_i and the target's p_i
at each position i: the draft proposes x_1..x_K while advancing the constraint, so the mask at
position i is the one of the state after x_<i, and the target's p_{K+1} gets the mask after all
K. Both distributions are then conditioned on the same allowed set, and modified rejection
sampling (Leviathan et al. 2023, Alg. 1; `rejection_sample`) emits exactly the constrained
target's distribution. The constraint is rolled back over the round's proposals and advanced over
what was emitted.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import PageAllocator, pages_needed, rollback
from jaxspec.checks import check_int, check_seed, is_int_in, seed_key, token_ids
from jaxspec.decoding.autoregressive import decode_step, prefill_logits
from jaxspec.decoding.constraint import TokenConstraint
from jaxspec.decoding.generate import MAX_K, check_context, stop_ids
from jaxspec.decoding.output import NonFiniteLogitsError, check_valid, draft_failed_message
from jaxspec.decoding.rejection import rejection_sample
from jaxspec.decoding.sampling import (INVALID_TOKEN, SamplingParams, check_sampling,
                                       probabilities, sample)
from jaxspec.decoding.speculative import proposals_in_reach
from jaxspec.models import ModelConfig, Transformer, cache_for, check_params

PREFILL_CHUNK = 64  # tokens per jitted prefill call (one compile per cache shape)


@dataclasses.dataclass
class ConstrainedResult:
  """One constrained generation (batch 1).

  Attributes:
    tokens: emitted token ids, the stop token included when hit.
    finished: True when the stop token was emitted (the constrained text is complete), False
      when max_new_tokens ran out first.
    ttft_s: seconds from the call to the first token (prefill of both models + first sample).
    decode_s: seconds after the first token.
    proposed, accepted, rejected, target_calls, draft_failed: speculative counters (see
      `SpecStats`; a round whose draft had no distribution verifies the proposals before it).
  """

  tokens: list
  finished: bool
  ttft_s: float
  decode_s: float
  proposed: int = 0
  accepted: int = 0
  rejected: int = 0
  target_calls: int = 0
  draft_failed: int = 0

  def check_draft(self, what: str = 'the draft') -> 'ConstrainedResult':
    """This result, unless the draft's logits were NaN or +inf in some round (as
    `GenerationResult.check_draft`). Raises NonFiniteLogitsError naming `what` and the rounds."""
    if self.draft_failed:
      raise NonFiniteLogitsError(draft_failed_message(self.draft_failed, self.target_calls, what))
    return self

  @property
  def acceptance_rate(self) -> float:
    """α = accepted draft tokens ÷ proposed draft tokens (NaN without a draft)."""
    return self.accepted / self.proposed if self.proposed else float('nan')


def new_cache(config: ModelConfig, capacity: int, page_size: int = 16):
  """An empty batch-1 `PagedKVCache` holding `capacity` tokens, rounded up to a power-of-two
  number of pages so that growing contexts reuse a few compiled shapes."""
  pages = 1 << max(0, (pages_needed(capacity, page_size) - 1).bit_length())
  allocator = PageAllocator(pages + 1)
  table = np.array([allocator.allocate(pages)], np.int32)
  return cache_for(config, table, allocator.num_pages, page_size)


# One chunk of `prefill_logits`, jitted for the batch-1 cache (one compile per cache shape).
_prefill_chunk = jax.jit(prefill_logits, static_argnames=('config',), donate_argnames=('cache',))


def prefill_chunked(config: ModelConfig, params, cache, tokens: Sequence[int],
                    chunk: int = PREFILL_CHUNK):
  """Append `tokens` to a batch-1 cache in chunks of `chunk` tokens (the prefix already in the
  cache is attended to, not recomputed: prefix caching prefills only the uncached suffix).

  Returns:
    (logits [1, V] float32 after the last token, cache).
  Raises:
    ValueError: no tokens, or more than the cache has room for.
  """
  if len(tokens) == 0:
    raise ValueError('prefill_chunked needs at least one token')
  room = cache.capacity - int(cache.lengths[0])
  if len(tokens) > room:
    raise ValueError(f'{len(tokens)} tokens exceed the {room} free slots of the cache')
  ids = np.asarray(tokens, np.int32)
  logits = None
  for start in range(0, len(ids), chunk):
    part = ids[start:start + chunk]
    padded = np.zeros((1, chunk), np.int32)
    padded[0, :len(part)] = part
    logits, cache = _prefill_chunk(config, params, cache, jnp.asarray(padded),
                                   jnp.array([len(part)], jnp.int32))
  return logits, cache


@functools.partial(jax.jit, static_argnames=('sampling',))
def _sample_masked(logits, mask, rng, *, sampling):
  return sample(rng, probabilities(logits, sampling, mask))


@functools.partial(jax.jit, static_argnames=('config', 'sampling'), donate_argnames=('cache',))
def _step(config: ModelConfig, params, cache, token, mask, rng, *, sampling):
  """One decode step under a mask: token [1] -> (x [1], q [1, V] the distribution x came from,
  cache + 1)."""
  logits, cache = decode_step(config, params, cache, token)
  q = probabilities(logits, sampling, mask)
  return sample(rng, q), q, cache


@functools.partial(jax.jit, static_argnames=('config', 'sampling'), donate_argnames=('cache',))
def _verify(config: ModelConfig, params, cache, pending, xs, qs, masks, rng, *, sampling):
  """Target pass over pending, x_1..x_K with p_i masked like q_i, then rejection sampling.

  pending: [1]; xs: [1, K]; qs: [1, K, V]; masks: [1, K+1, V] bool -> (n [1], next [1], cache).
  """
  k = xs.shape[1]
  tokens = jnp.concatenate([pending[:, None], xs], axis=1)
  positions = cache.lengths[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
  logits, cache = Transformer(config).apply(params, tokens, positions, cache)
  n, nxt = rejection_sample(rng, xs, qs, probabilities(logits, sampling, masks))
  return n, nxt, cache


def _mask(constraint: Optional[TokenConstraint], vocab: int) -> np.ndarray:
  return np.ones((1, vocab), bool) if constraint is None else constraint.allowed()[None]


def constrained_generate(target: ModelConfig, target_params, prompt: Sequence[int],
                         constraint: Optional[TokenConstraint], *, max_new_tokens: int,
                         stop_token: Optional[int], sampling: SamplingParams = SamplingParams(),
                         seed: int = 0, draft: Optional[ModelConfig] = None, draft_params=None,
                         k: Optional[int] = None, page_size: int = 16) -> ConstrainedResult:
  """Generate from one prompt, every token allowed by `constraint` (None: unconstrained, through
  the same host-stepped loop, for like-for-like comparisons).

  Autoregressive when `draft` is None; else speculative with the constraint's mask on both
  models (see module docstring). `constraint` is advanced over the emitted tokens.

  Args:
    prompt: token ids (>= 1).
    max_new_tokens: >= 1, the first token included.
    stop_token: one id in [0, V) that ends the text (the constraint's `eos_id`: allowed once
      the text is complete); None never stops before max_new_tokens (unconstrained runs only).
    k: speculation length >= 1 (with a draft).
  Raises:
    ValueError: bad arguments (a seed that is not a 64-bit int, sampling that is not a
      SamplingParams, a stop_token that is not one id in the vocabulary or differs from the
      constraint's eos_id too).
    ContextOverflowError: the prompt + max_new_tokens + slack exceeds the target's (or the
      draft's) context (a ValueError).
    CheckpointError: target_params (draft_params) that are not the config's params (named).
    ConstraintError: the constraint cannot be continued.
    NonFiniteLogitsError: the target's logits were NaN or +inf. (A draft's are not an error:
      the round verifies the proposals drafted before them, so the output is still the
      target's, as with `generate` and the engine.)
  (A constraint that has consumed tokens, e.g. from an earlier call, is a ValueError: its mask
  would continue that text.)
  """
  max_new_tokens = check_int('max_new_tokens', max_new_tokens, 1)
  check_sampling(sampling)
  seed = check_seed(seed)
  prompt = token_ids(prompt, 'prompt', target.vocab_size)
  if not prompt:
    raise ValueError('prompt is empty')
  if (draft is None) != (draft_params is None) or (draft is None) != (k is None):
    raise ValueError('give draft, draft_params and k together (or none of them)')
  if draft is not None:
    if not is_int_in(k, 1, MAX_K):
      raise ValueError(f'speculation length K must be an int in [1, {MAX_K}], got {k!r}')
    k = int(k)
  if draft is not None and draft.vocab_size != target.vocab_size:
    raise ValueError(f'draft vocabulary ({draft.vocab_size}) differs from the target '
                     f'vocabulary ({target.vocab_size})')
  if stop_token is not None:
    if isinstance(stop_token, (list, tuple, np.ndarray)):
      raise ValueError(f'stop_token must be one token id (or None), got {stop_token!r}')
    stop_token = stop_ids([stop_token], target.vocab_size)[0]
  if constraint is not None and stop_token != constraint.eos_id:
    raise ValueError(f'stop_token {stop_token} differs from the constraint\'s end token '
                     f'{constraint.eos_id}')
  if constraint is not None and constraint.consumed:
    raise ValueError(f'the constraint has already consumed {constraint.consumed} tokens (a '
                     'constraint follows one generation: build a new one for each)')
  if constraint is not None and constraint.vocab_size != target.vocab_size:
    raise ValueError(f'constraint masks have {constraint.vocab_size} entries, the model '
                     f'vocabulary {target.vocab_size}')
  check_params(target, target_params, 'target_params')
  if draft is not None:
    check_params(draft, draft_params, 'draft_params')
  vocab = target.vocab_size
  slack = 1 if draft is None else k + 1
  check_context('prompt', len(prompt), [target] if draft is None else [target, draft],
                max_new_tokens, slack)
  capacity = len(prompt) + max_new_tokens + slack

  rng = seed_key(seed)
  start = time.perf_counter()
  logits, t_cache = prefill_chunked(target, target_params, new_cache(target, capacity, page_size),
                                    prompt)
  if draft is not None:
    _, d_cache = prefill_chunked(draft, draft_params, new_cache(draft, capacity, page_size),
                                 prompt)
  rng, sub = jax.random.split(rng)
  first = int(_sample_masked(logits, _mask(constraint, vocab), sub, sampling=sampling)[0])
  check_valid([[first]])
  ttft = time.perf_counter() - start

  start = time.perf_counter()
  tokens = [first]
  stats = dict(proposed=0, accepted=0, rejected=0, target_calls=0, draft_failed=0)
  if constraint is not None:
    constraint.advance(first)
  pending = first
  while tokens[-1] != stop_token and len(tokens) < max_new_tokens:
    rng, sub = jax.random.split(rng)
    if draft is None:
      x, _, t_cache = _step(target, target_params, t_cache, jnp.array([pending], jnp.int32),
                            _mask(constraint, vocab), sub, sampling=sampling)
      window = [int(x[0])]
    else:
      window, t_cache, d_cache = _round(target, draft, target_params, draft_params, t_cache,
                                        d_cache, pending, constraint, sub, stats, k=k,
                                        stop_token=stop_token, sampling=sampling,
                                        room=max_new_tokens - len(tokens))
    check_valid([tokens + window])   # before the constraint sees a token that is none
    if constraint is not None:
      for t in window:
        constraint.advance(t)
    tokens += window
    pending = window[-1]
  decode_s = time.perf_counter() - start
  return ConstrainedResult(tokens=tokens, finished=tokens[-1] == stop_token, ttft_s=ttft,
                           decode_s=decode_s, **stats)


def _round(target, draft, target_params, draft_params, t_cache, d_cache, pending, constraint,
           rng, stats, *, k, stop_token, sampling, room):
  """One constrained speculative round. Both caches hold the committed tokens except `pending`.

  Returns the emitted window (accepted drafts + correction/bonus, cut after the stop token and
  at `room` tokens) and both caches rolled back to the committed tokens except the new pending.
  The constraint is left where it was (the caller advances it over the window).
  """
  vocab = target.vocab_size
  old = int(t_cache.lengths[0])
  rng_draft, rng_verify = jax.random.split(rng)
  masks, xs, qs = [], [], []
  token, drafted = pending, 0
  for i, step_rng in enumerate(jax.random.split(rng_draft, k)):
    masks.append(_mask(constraint, vocab))
    if xs and xs[-1] == stop_token:
      # The text ended inside the round: pad with the stop token, q one-hot on it (the round is
      # cut at the first stop token, so nothing after it is emitted).
      x, q = stop_token, jax.nn.one_hot(jnp.array([stop_token]), vocab, dtype=jnp.float32)
    else:
      x, q, d_cache = _step(draft, draft_params, d_cache, jnp.array([token], jnp.int32),
                            masks[-1], step_rng, sampling=sampling)
      x, drafted = int(x[0]), drafted + 1
      if x == INVALID_TOKEN:
        # The draft's logits were not finite: the target verifies the proposals before it
        # (none: one plain target step), which keeps its distribution exact, as generate and
        # the engine serve a broken draft's request with the target's tokens (and count it).
        stats['draft_failed'] += 1
        break
    if constraint is not None:
      constraint.advance(x)
    xs.append(x)
    qs.append(q)
    token = x
  else:
    masks.append(_mask(constraint, vocab))
  k = len(xs)
  if constraint is not None:
    constraint.rollback(k)
  if k:
    n, nxt, t_cache = _verify(target, target_params, t_cache, jnp.array([pending], jnp.int32),
                              jnp.array([xs], jnp.int32), jnp.stack(qs, axis=1),
                              jnp.asarray(np.stack(masks, axis=1)), rng_verify,
                              sampling=sampling)
  else:
    nxt, _, t_cache = _step(target, target_params, t_cache, jnp.array([pending], jnp.int32),
                            masks[0], rng_verify, sampling=sampling)
    n = jnp.zeros((1,), jnp.int32)
  n, nxt = int(n[0]), int(nxt[0])
  window = xs[:n] + [nxt]
  if stop_token is not None and stop_token in window:
    window = window[:window.index(stop_token) + 1]
  window = window[:room]
  emitted = len(window)
  stats['proposed'] += proposals_in_reach(k, n, emitted)
  stats['accepted'] += min(n, emitted)
  stats['rejected'] += int(n < k and emitted == n + 1)
  stats['target_calls'] += 1
  if emitted == k + 1 and drafted == k:   # the draft wrote pending, x_1..x_{K-1}; add x_K
    _, d_cache = decode_step_jit(draft, draft_params, d_cache, jnp.array([xs[-1]], jnp.int32))
  keep = jnp.array([old + emitted], jnp.int32)
  return window, rollback(t_cache, keep), rollback(d_cache, keep)


decode_step_jit = jax.jit(decode_step, static_argnames=('config',), donate_argnames=('cache',))
