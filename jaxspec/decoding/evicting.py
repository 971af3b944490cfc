"""Decoding with the target's KV cache under an eviction policy (`jaxspec.cache.eviction`):
prefill / scoring one token at a time, autoregressive and speculative loops.

Tokens enter one at a time inside each model call, in order, so an eviction decision always
follows the same steps whatever the call width: a (K+1)-token verification makes exactly the
decisions K+1 decode steps would (with `ModelConfig.exact_verify`, bit for bit). After the
acceptance step only the state after the committed tokens is kept (`after_tokens`): rejected
draft positions leave no score, no eviction and no slot behind. This needs the policy's
`reuse_delay` >= K+1 (a slot evicted during a round is not rewritten in that round), for the
autoregressive run compared against it too, since the delay decides where tokens are written.

Invariant of the speculative loop (as `jaxspec.decoding.speculative`): caches hold every committed
token except the last one, `pending`. Only the target evicts; the draft keeps a full cache.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import after_tokens, last_token, rollback
from jaxspec.checks import check_int, concrete
from jaxspec.decoding.autoregressive import decode_step
from jaxspec.decoding.output import Output, commit
from jaxspec.decoding.sampling import INVALID_TOKEN, SamplingParams, probabilities, sample
from jaxspec.decoding.speculative import SpecStats, accept, check_pair, draft_tokens
from jaxspec.models import ModelConfig, Transformer


def decode_step_evicting(config: ModelConfig, params, cache, eviction, token):
  """One token per row at position cache.lengths, under eviction.

  Args:
    token: [B] int32.
  Returns:
    (logits [B, V] float32, cache with lengths + 1, eviction state after the token).
  """
  logits, cache, history = Transformer(config).apply(params, token[:, None],
                                                     cache.lengths[:, None], cache, eviction)
  return logits[:, 0], cache, last_token(history)


def score_tokens(config: ModelConfig, params, cache, eviction, tokens, lengths):
  """Feed each row's tokens one by one (a `lax.scan`) and score every next-token prediction.

  Args:
    cache, eviction: empty cache and eviction state (donated); eviction None = the model's
      default full-cache path (slot = position).
    tokens: [B, T] int32 right-padded; lengths: [B] int32 real tokens per row, in [0, T].
  Returns:
    dict of [B, T] arrays: `logprob` float32, log p(tokens[t+1] | tokens[:t+1]) (0 at t >=
    length-1); `argmax` int32, the model's top-1 prediction after token t; `live` int32, tokens
    cached after step t (max over layers); plus the final `cache` and `eviction`.
  Raises:
    ValueError: tokens or lengths not integer arrays of those shapes with the cache's B rows, a
      length outside [0, T], a token id outside [0, vocab_size) within a row's length, or,
      without eviction or under policy 'full', a row longer than the cache's capacity (its
      later tokens would have no slot: scored against a cache that lost them). Values are
      checked when concrete.

  `score_tokens.lower(config, params, cache, eviction, tokens, lengths)` checks the same and
  returns the jitted step lowered (`.compile()` it to time calls without compiling; the
  compiled call takes (params, cache, eviction, tokens, lengths)).
  """
  tokens, lengths = _check_score_args(config, cache, eviction, tokens, lengths)
  return _score_tokens(config, params, cache, eviction, tokens, lengths)


def _lower_score_tokens(config: ModelConfig, params, cache, eviction, tokens, lengths):
  tokens, lengths = _check_score_args(config, cache, eviction, tokens, lengths)
  return _score_tokens.lower(config, params, cache, eviction, tokens, lengths)


score_tokens.lower = _lower_score_tokens


def _check_score_args(config: ModelConfig, cache, eviction, tokens, lengths) -> tuple:
  """`score_tokens`' checks; (tokens, lengths) as jax arrays."""
  tokens, lengths, found = _check_rows(config, cache, tokens, lengths, 'lengths', 'T', 0)
  if found is not None and (eviction is None or eviction.policy.kind == 'full'):
    _check_fits('rows scored with the full cache', cache, found)
  return tokens, lengths


def _check_rows(config: ModelConfig, cache, tokens, lengths, name: str, width: str,
                low: int) -> tuple:
  """tokens [B, width] and their `name` [B] as integer jax arrays with the cache's B rows
  (`_int_array`), each length in [low, width] and each id before it in the vocabulary (when the
  values are concrete). Returns (tokens, lengths, the lengths as numpy or None if traced)."""
  batch = cache.lengths.shape[0]
  tokens = _int_array('tokens', tokens, 'B' + width, batch)
  lengths = _int_array(name, lengths, 'B', batch)
  found, ids = concrete(lengths), concrete(tokens)
  if found is not None:
    bad = found[(found < low) | (found > tokens.shape[1])]
    if bad.size:
      raise ValueError(f'{name} must lie in [{low}, {width}={tokens.shape[1]}], got '
                       f'{int(bad[0])}')
    if ids is not None:
      _check_ids('tokens', ids[np.arange(tokens.shape[1]) < found[:, None]], config.vocab_size)
  return tokens, lengths, found


@functools.partial(jax.jit, static_argnames=('config',), donate_argnames=('cache', 'eviction'))
def _score_tokens(config: ModelConfig, params, cache, eviction, tokens, lengths):
  t_max = tokens.shape[1]
  nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))

  def step(carry, t):
    cache, eviction = carry
    pos = jnp.where(t < lengths, t, -1).astype(jnp.int32)
    if eviction is None:
      logits, cache = Transformer(config).apply(params, tokens[:, t][:, None], pos[:, None], cache)
      live = cache.lengths
    else:
      logits, cache, history = Transformer(config).apply(
          params, tokens[:, t][:, None], pos[:, None], cache, eviction)
      eviction = last_token(history)
      live = eviction.num_live.max(axis=0)
    logp = jax.nn.log_softmax(logits[:, 0])
    target_lp = jnp.take_along_axis(logp, nxt[:, t][:, None], axis=1)[:, 0]
    target_lp = jnp.where(t + 1 < lengths, target_lp, 0.0)
    return (cache, eviction), (target_lp, jnp.argmax(logp, -1).astype(jnp.int32), live)

  (cache, eviction), (lp, am, live) = jax.lax.scan(step, (cache, eviction),
                                                    jnp.arange(t_max, dtype=jnp.int32))
  return dict(logprob=lp.T, argmax=am.T, live=live.T, cache=cache, eviction=eviction)


def _check_ids(name: str, ids, vocab_size: int) -> None:
  """ValueError naming the first id of `ids` (a numpy array) outside [0, vocab_size)."""
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise ValueError(f'{name} holds token id {int(bad[0])} outside the vocabulary '
                     f'[0, {vocab_size})')


def _check_fits(what: str, cache, tokens_after, hint: Optional[str] = None) -> None:
  """ValueError when a sequence would hold more than `cache.capacity` tokens: `tokens_after`,
  [B] concrete counts of tokens the cache must hold (or None: traced, not checked). Inside the
  jitted loops a token with no slot is written to the null page and lost without an error."""
  if tokens_after is None:
    return
  need = int(np.max(tokens_after)) if np.size(tokens_after) else 0
  if need > cache.capacity:
    hint = ', or use a policy with a budget' if hint is None else hint
    raise ValueError(f'{what} need {need} cache slots per sequence, the cache holds '
                     f'{cache.capacity}: a token with no slot would be lost (size the cache '
                     f'for the whole sequence{hint})')


def _int_array(name: str, x, dims: str, batch: int):
  """`x` as a jax array, if it holds integers (not bools) in len(dims) dimensions, the first of
  them `batch` rows (`dims` names them for the error, e.g. 'BP'); else ValueError naming it. A
  float array reached the model as token ids (flax: 'Input type must be an integer'), or a
  float prompt length silently drew the first token from all-zero logits."""
  x = x if isinstance(x, jax.Array) else jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer) or x.ndim != len(dims) or \
      (x.ndim and x.shape[0] != batch):
    raise ValueError(f'{name} must be an integer array [{", ".join(dims)}] with B = {batch} '
                     f'(the cache\'s rows), got {x.dtype} of shape {tuple(x.shape)}')
  return x


def _stop_array(stop_tokens, batch: int):
  """stop_tokens as an integer jax array [S] or [B, S] (`_int_array`'s errors)."""
  stop = stop_tokens if isinstance(stop_tokens, jax.Array) else jnp.asarray(stop_tokens)
  if not stop.size:               # () or [] arrive as float32
    stop = stop.astype(jnp.int32)
  if stop.ndim == 1:
    return _int_array('stop_tokens', stop[None], 'BS', 1)[0]
  return _int_array('stop_tokens', stop, 'BS', batch)


def prefill_evicting(config: ModelConfig, params, cache, eviction, tokens, prompt_lengths, rng, *,
                     sampling: SamplingParams):
  """Prefill under eviction, one token per step, and draw the first new token.

  Args:
    cache, eviction: empty cache and eviction state (donated).
    tokens: [B, P] int32 right-padded prompts; prompt_lengths: [B] int32 in [1, P].
  Returns:
    (first_token [B] int32, cache, eviction).
  Raises:
    ValueError: tokens or prompt_lengths not integer arrays of those shapes with the cache's B
      rows, a prompt length outside [1, P], a prompt token id outside [0, vocab_size), or
      under policy 'full' a prompt longer than the cache's capacity, named (checked when the
      arguments are concrete; under a caller's jit they are traced and
      not checked).
  """
  shape = np.shape(tokens)
  if len(shape) != 2 or np.shape(prompt_lengths) != shape[:1]:
    raise ValueError(f'tokens must be [B, P] and prompt_lengths [B], got shapes {shape} and '
                     f'{np.shape(prompt_lengths)}')
  tokens, prompt_lengths, lengths = _check_rows(config, cache, tokens, prompt_lengths,
                                                 'prompt_lengths', 'P', 1)
  if lengths is not None and eviction.policy.kind == 'full':
    _check_fits("prompts under policy 'full'", cache, lengths)
  return _prefill_evicting(config, params, cache, eviction, tokens, prompt_lengths, rng,
                           sampling=sampling)


@functools.partial(jax.jit, static_argnames=('config', 'sampling'),
                   donate_argnames=('cache', 'eviction'))
def _prefill_evicting(config: ModelConfig, params, cache, eviction, tokens, prompt_lengths, rng,
                      *, sampling: SamplingParams):
  def step(carry, t):
    cache, eviction, last = carry
    pos = jnp.where(t < prompt_lengths, t, -1).astype(jnp.int32)
    logits, cache, history = Transformer(config).apply(
        params, tokens[:, t][:, None], pos[:, None], cache, eviction)
    last = jnp.where((t == prompt_lengths - 1)[:, None], logits[:, 0], last)
    return (cache, last_token(history), last), None

  init = (cache, eviction, jnp.zeros((tokens.shape[0], config.vocab_size), jnp.float32))
  (cache, eviction, last), _ = jax.lax.scan(step, init,
                                            jnp.arange(tokens.shape[1], dtype=jnp.int32))
  return sample(rng, probabilities(last, sampling)), cache, eviction


def decode_autoregressive_evicting(config: ModelConfig, params, cache, eviction, first_token, rng,
                                   stop_tokens, *, sampling: SamplingParams, max_new_tokens: int):
  """`decode_autoregressive` with the cache under eviction (finished rows change nothing).

  Args:
    cache, eviction: after `prefill_evicting` (donated).
    first_token: [B] int32, the token `prefill_evicting` drew (INVALID_TOKEN for a row whose
      logits were not finite: that row ends at once, the others decode).
    stop_tokens: [S] int32 stop ids shared by every row, or [B, S] per row, -1 padded.
    max_new_tokens: tokens to emit per row, first_token included (>= 1).
  Returns:
    (Output, cache, eviction).
  Raises:
    ValueError: max_new_tokens not an int >= 1, first_token not an integer [B] array (B the
      cache's rows) or stop_tokens not an integer [S] or [B, S] one, a first_token id outside
      the vocabulary, or,
      under policy 'full', a cache without room for lengths + max_new_tokens - 1 tokens per row
      (checked when concrete).
  """
  max_new_tokens = check_int('max_new_tokens', max_new_tokens, 1)
  first_token = _int_array('first_token', first_token, 'B', cache.lengths.shape[0])
  stop_tokens = _stop_array(stop_tokens, cache.lengths.shape[0])
  first = concrete(first_token)
  if first is not None:
    _check_ids('first_token', first[first != INVALID_TOKEN], config.vocab_size)
  if eviction.policy.kind == 'full':
    lengths = concrete(cache.lengths)
    _check_fits(f"max_new_tokens={max_new_tokens} under policy 'full'", cache,
                None if lengths is None else lengths + max_new_tokens - 1)
  return _decode_autoregressive_evicting(config, params, cache, eviction, first_token, rng,
                                         stop_tokens, sampling=sampling,
                                         max_new_tokens=max_new_tokens)


@functools.partial(jax.jit, static_argnames=('config', 'sampling', 'max_new_tokens'),
                   donate_argnames=('cache', 'eviction'))
def _decode_autoregressive_evicting(config: ModelConfig, params, cache, eviction, first_token,
                                    rng, stop_tokens, *, sampling: SamplingParams,
                                    max_new_tokens: int):
  b = first_token.shape[0]
  out, _ = commit(Output.empty(b, max_new_tokens + 1), first_token[:, None],
                  jnp.ones((b,), jnp.int32), stop_tokens, max_new_tokens)

  def body(state):
    cache, eviction, out, pending, rng = state
    rng, step_rng = jax.random.split(rng)
    old_lengths = cache.lengths
    # A finished row runs as padding: with reuse_delay 0 its eviction step would still write the
    # pending token over the victim's slot, and restoring the state after would not undo that.
    positions = jnp.where(out.done, -1, cache.lengths)[:, None]
    logits, cache, history = Transformer(config).apply(params, pending[:, None], positions, cache,
                                                       eviction)
    token = sample(step_rng, probabilities(logits[:, 0], sampling))
    out, n = commit(out, token[:, None], jnp.ones((b,), jnp.int32), stop_tokens, max_new_tokens)
    kept = jnp.minimum(n, 1)
    cache = rollback(cache, old_lengths + kept)
    eviction = after_tokens(eviction, history, kept)
    return cache, eviction, out, jnp.where(n > 0, token, pending), rng

  cache, eviction, out, _, _ = jax.lax.while_loop(lambda s: ~jnp.all(s[2].done), body,
                                                  (cache, eviction, out, first_token, rng))
  return out, cache, eviction


def decode_speculative_evicting(target: ModelConfig, draft: ModelConfig, target_params,
                                draft_params, target_cache, eviction, draft_cache, first_token,
                                rng, stop_tokens, *, k: int, sampling: SamplingParams,
                                max_new_tokens: int):
  """`decode_speculative` with the target's cache under eviction (the draft's is full).

  Each round: draft K, verify pending + K drafts in one target pass (eviction steps run token by
  token inside it), accept/reject, then keep the target's eviction state after the committed
  tokens only. Requires eviction.policy.reuse_delay >= K + 1 (checked).

  Args:
    target_cache, eviction: after `prefill_evicting` (donated); draft_cache: the draft's full
      cache after the same prompts (donated). It must hold prompt + max_new_tokens - 1 tokens
      per row, as must the target's under policy 'full' (checked when the lengths are concrete;
      inside the jitted loop a token with no slot would be lost without an error).
    first_token: [B] int32; stop_tokens: [S] int32 shared, or [B, S] per row, -1 padded.
    k: speculation length K (>= 1); max_new_tokens: tokens to emit per row (>= 1).
  Returns:
    (Output, SpecStats, target_cache, eviction, draft_cache).
  Raises:
    ValueError: k or max_new_tokens not an int >= 1, reuse_delay < K + 1, a draft whose
      vocabulary differs from the target's, first_token or stop_tokens not integer arrays of
      the shapes above, a first_token id outside it, or a cache too small
      (as above; checked when concrete).
  """
  k = check_int('speculation length K', k, 1)
  max_new_tokens = check_int('max_new_tokens', max_new_tokens, 1)
  check_pair(target, draft, k)
  if eviction.policy.reuse_delay < k + 1:
    raise ValueError(f'speculative decoding under eviction needs reuse_delay >= K + 1 = {k + 1}, '
                     f'got {eviction.policy.reuse_delay}')
  first_token = _int_array('first_token', first_token, 'B', target_cache.lengths.shape[0])
  stop_tokens = _stop_array(stop_tokens, target_cache.lengths.shape[0])
  first = concrete(first_token)
  if first is not None:
    _check_ids('first_token', first[first != INVALID_TOKEN], target.vocab_size)
  # Committed tokens end below lengths + max_new_tokens - 1; a last round's drafts past that
  # are rejected or cut, and their writes may go to the null page.
  for name, c, full in (('target', target_cache, eviction.policy.kind == 'full'),
                        ('draft', draft_cache, True)):
    lengths = concrete(c.lengths) if full else None
    _check_fits(f"the {name}'s cache, decoding max_new_tokens={max_new_tokens}"
                + (" under policy 'full'" if name == 'target' else ''), c,
                None if lengths is None else lengths + max_new_tokens - 1,
                hint='' if name == 'draft' else None)
  return _decode_speculative_evicting(target, draft, target_params, draft_params, target_cache,
                                      eviction, draft_cache, first_token, rng, stop_tokens, k=k,
                                      sampling=sampling, max_new_tokens=max_new_tokens)


@functools.partial(jax.jit, static_argnames=('target', 'draft', 'k', 'sampling', 'max_new_tokens'),
                   donate_argnames=('target_cache', 'eviction', 'draft_cache'))
def _decode_speculative_evicting(target: ModelConfig, draft: ModelConfig, target_params,
                                 draft_params, target_cache, eviction, draft_cache, first_token,
                                 rng, stop_tokens, *, k: int, sampling: SamplingParams,
                                 max_new_tokens: int):
  b = first_token.shape[0]
  out, _ = commit(Output.empty(b, max_new_tokens + k + 1), first_token[:, None],
                  jnp.ones((b,), jnp.int32), stop_tokens, max_new_tokens)

  def body(state):
    target_cache, eviction, draft_cache, out, stats, pending, rng = state
    rng, rng_draft, rng_accept = jax.random.split(rng, 3)
    active = ~out.done
    old_lengths = target_cache.lengths
    xs, qs, draft_cache = draft_tokens(draft, draft_params, draft_cache, pending, rng_draft,
                                       k=k, sampling=sampling)
    verify = jnp.concatenate([pending[:, None], xs], axis=1)                  # [B, K+1]
    offsets = jnp.arange(k + 1, dtype=jnp.int32)
    positions = jnp.where(active[:, None], old_lengths[:, None] + offsets, -1)  # done: padding
    logits, target_cache, history = Transformer(target).apply(
        target_params, verify, positions, target_cache, eviction)
    window, n = accept(rng_accept, xs, qs, probabilities(logits, sampling))
    out, emitted = commit(out, window, n + 1, stop_tokens, max_new_tokens)
    draft_cache = jax.lax.cond(
        jnp.any(emitted == k + 1),
        lambda c: decode_step(draft, draft_params, c, window[:, k - 1])[1],
        lambda c: c, draft_cache)
    # Committed to the caches: pending + the first emitted-1 tokens (verify rows 0..emitted-1).
    kept = jnp.maximum(emitted, 0)
    target_cache = rollback(target_cache, old_lengths + kept)
    draft_cache = rollback(draft_cache, old_lengths + kept)
    eviction = after_tokens(eviction, history, kept)
    last = jnp.take_along_axis(window, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(emitted > 0, last, pending)
    stats = stats.after_round(active, n, emitted, k, jnp.any(xs == INVALID_TOKEN, axis=1))
    return target_cache, eviction, draft_cache, out, stats, pending, rng

  state = (target_cache, eviction, draft_cache, out, SpecStats.zeros(b), first_token, rng)
  target_cache, eviction, draft_cache, out, stats, _, _ = jax.lax.while_loop(
      lambda s: ~jnp.all(s[3].done), body, state)
  return out, stats, target_cache, eviction, draft_cache
