"""Turning logits into the distribution a token is drawn from: temperature, top-k, top-p.

Speculative sampling is exact only if the draft's q and the target's p are both the *processed*
distributions of the request (a known bug is q from raw logits while the draft sampled under
top-k/top-p), so every sampler in jaxspec goes through `probabilities`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np


MIN_TEMPERATURE = 1e-4  # below this (and above 0) logits / temperature overflows float32
# Above this the distribution is already uniform over the top-k / top-p set to float32 precision;
# from ~1e38, logits / temperature underflow to 0 and top-k would keep every token.
MAX_TEMPERATURE = 1e6
INT32_MAX = int(np.iinfo(np.int32).max)
# What `sample` draws for a row that has no distribution: logits with a NaN or +inf (a model
# whose activations overflowed, NaN weights) or no allowed token. Never a vocabulary id; the
# decode loops end such a row there (`output.cut_lengths`) and the host entry points raise
# `output.NonFiniteLogitsError` (the engine finishes that request with finish_reason 'error').
INVALID_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How a request samples. Hashable: it is a static argument of the jitted loops.

  Attributes:
    temperature: 0 means greedy (argmax); otherwise in [MIN_TEMPERATURE, MAX_TEMPERATURE]
      (1e-4 .. 1e6: below, float32 logits / temperature overflow; above, the distribution is
      already uniform over the kept tokens, and from ~1e38 the logits underflow to 0).
    top_k: keep the k most likely tokens (0 = all); tokens tied with the k-th logit are kept
      too (as Hugging Face's top-k warper does), so a tie can keep more than k.
    top_p: keep the smallest set of tokens whose mass reaches top_p, in (0, 1] (Holtzman et al.).

  Python or numpy scalars and 0-d arrays are accepted (np.float32(0.5), top_k=np.int64(5),
  np.array(0.7)) and stored as Python float (temperature, top_p) and int (top_k).

  Raises:
    ValueError (naming the value): a bool or np.bool_, a non-number (str, an array of rank >= 1,
      None), a float top_k, NaN or inf, or a value out of the ranges above.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    # numpy scalars (np.float32(.5), np.int64(5)) are accepted like Python numbers and stored as
    # Python float / int, so equal settings hash equal as a static jit argument.
    temperature = _number(self.temperature)
    if temperature is None or not temperature >= 0:
      raise ValueError(f'temperature must be a number >= 0, got {self.temperature!r}')
    if 0 < temperature < MIN_TEMPERATURE or temperature > MAX_TEMPERATURE:
      raise ValueError(f'temperature {self.temperature!r} would overflow or underflow the '
                       f'float32 logits: use 0 for greedy, or a value in [{MIN_TEMPERATURE}, '
                       f'{MAX_TEMPERATURE:g}]')
    top_k = _number(self.top_k, integer=True)
    if top_k is None or top_k < 0:
      raise ValueError(f'top_k must be an int >= 0, got {self.top_k!r}')
    top_p = _number(self.top_p)
    if top_p is None or not 0.0 < top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p!r}')
    object.__setattr__(self, 'temperature', temperature)
    object.__setattr__(self, 'top_k', top_k)
    object.__setattr__(self, 'top_p', top_p)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def _number(value, integer: bool = False):
  """`value` as a Python float (int when `integer`), or None if it is not such a number.

  Accepts Python int/float and numpy integer/floating scalars or 0-d arrays (integers only when
  `integer`); bool and np.bool_ are not numbers here (True would silently mean 1). NaN and inf
  pass through as floats for the caller's range check to refuse.
  """
  if isinstance(value, jax.core.Tracer):  # a traced value cannot be a static jit argument
    return None
  if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
    value = np.asarray(value)[()]       # a concrete 0-d array
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, (int, np.integer)):
    return int(value) if integer else float(value)
  if not integer and isinstance(value, (float, np.floating)):
    return float(value)
  return None


def check_sampling(value) -> 'SamplingParams':
  """`value` if it is a SamplingParams (the check `generate` and the engine share).

  Raises:
    ValueError: 'sampling must be a SamplingParams, got {value!r}'.
  """
  if not isinstance(value, SamplingParams):
    raise ValueError(f'sampling must be a SamplingParams, got {value!r}')
  return value


@flax.struct.dataclass
class RowSampling:
  """Sampling parameters per batch row, as arrays: a traced (not static) argument, so one
  compiled step serves any mix of requests (greedy next to top-p next to top-k; the engine's
  per-request sampling). `probabilities` gives each row the distribution `SamplingParams` with
  the same values gives it (top-k on the scaled logits as there, by a sort that runs only when
  some row uses top-k; top-p by `nucleus_mask`).

  Attributes:
    temperature: [B] float32, 0 = greedy.
    top_k: [B] int32, 0 = all tokens.
    top_p: [B] float32 in (0, 1].
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  @classmethod
  def stack(cls, params: Sequence[SamplingParams]) -> 'RowSampling':
    """Rows from validated `SamplingParams` (row b = params[b]); numpy arrays (host side)."""
    for p in params:
      if not isinstance(p, SamplingParams):
        raise ValueError(f'expected SamplingParams, got {p!r}')
    # A top_k past int32 keeps every token, as any top_k >= V does: stored as the int32 maximum
    # (cast as it was, 2**31 overflowed and failed every step of the batch holding it).
    return cls(np.array([p.temperature for p in params], np.float32),
               np.array([min(p.top_k, INT32_MAX) for p in params], np.int32),
               np.array([p.top_p for p in params], np.float32))


def probabilities(logits, params, mask=None):
  """The distribution a token is sampled from under `params`.

  Args:
    logits: [..., V] float.
    params: static `SamplingParams` (one setting for every row, specialised at compile time), or
      a `RowSampling` whose arrays have length logits.shape[0] (row b of logits, whatever its
      middle dims, e.g. [B, K+1, V], uses row b of the parameters).
    mask: optional [..., V] bool, the tokens a constraint allows (grammar-constrained decoding,
      see `jaxspec.decoding.constrained`). Disallowed logits become -inf *before* temperature,
      top-k and top-p, so the result is the request's distribution conditioned on the allowed
      set. Callers check masks on the host first (`TokenConstraint.allowed` raises
      `ConstraintError`).
  Returns:
    [..., V] float32 probabilities; one-hot at the argmax (lowest index on ties) when greedy.
    A row with no distribution is all NaN, greedy or not (nothing can be raised inside jit;
    `sample` draws INVALID_TOKEN from it): logits with a NaN or +inf anywhere (checked before
    the mask: an overflowing model, whose greedy argmax would otherwise silently be token 0
    or the inf), or no allowed token with a logit above -inf.
  Raises:
    ValueError: params neither a SamplingParams nor a RowSampling (named).
  """
  if not isinstance(params, (SamplingParams, RowSampling)):
    raise ValueError(f'params must be a SamplingParams or a RowSampling, got {params!r}')
  logits = logits.astype(jnp.float32)
  broken = jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1, keepdims=True)
  if mask is not None:
    logits = jnp.where(mask, logits, -jnp.inf)
  none_left = ~jnp.any(logits > -jnp.inf, axis=-1, keepdims=True)
  return jnp.where(broken | none_left, jnp.nan, _processed(logits, params))


def _processed(logits, params):
  """`probabilities` of float32 logits that have a distribution."""
  vocab = logits.shape[-1]
  if isinstance(params, RowSampling):
    return _row_probabilities(logits, params)
  if params.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  logits = logits / params.temperature
  if 0 < params.top_k < vocab:
    kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p < 1.0:
    logits = jnp.where(nucleus_mask(jax.nn.softmax(logits, axis=-1), params.top_p), logits,
                       -jnp.inf)
  return jax.nn.softmax(logits, axis=-1)


def _row_probabilities(logits, params: RowSampling):
  """`probabilities` with per-row parameters; the work a batch does not need (anything but the
  argmax when every row is greedy, the top-k sort or the top-p bisection when no row uses it)
  is skipped by lax.cond."""
  vocab = logits.shape[-1]

  def per_row(x):                                       # [B] -> [B, 1, ..., 1]
    return x.reshape(x.shape + (1,) * (logits.ndim - 1))

  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  is_greedy = params.temperature == 0

  def sampled(logits):
    t = jnp.where(is_greedy, 1.0, params.temperature).astype(jnp.float32)
    scaled = logits / per_row(t)
    k = per_row(params.top_k)
    use_k = (k > 0) & (k < vocab)

    def cut_k(x):               # as the static path: below the k-th largest scaled logit -> -inf
      descending = -jnp.sort(-x, axis=-1)
      index = jnp.broadcast_to(jnp.clip(k - 1, 0, vocab - 1), x.shape[:-1] + (1,))
      kth = jnp.take_along_axis(descending, index, axis=-1)
      return jnp.where(use_k & (x < kth), -jnp.inf, x)

    probs = jax.nn.softmax(jax.lax.cond(jnp.any(use_k), cut_k, lambda x: x, scaled), axis=-1)
    top_p = per_row(params.top_p)
    use_p = top_p < 1.0
    return jax.lax.cond(jnp.any(use_p),
                        lambda p: _renormalise(jnp.where(~use_p | nucleus_mask(p, top_p), p, 0.0)),
                        lambda p: p, probs)

  probs = jax.lax.cond(jnp.all(is_greedy), lambda l: greedy, sampled, logits)
  return jnp.where(per_row(is_greedy), greedy, probs)


def _renormalise(probs):
  return probs / jnp.sum(probs, axis=-1, keepdims=True)


def nucleus_mask(probs, top_p, iterations: int = 32):
  """Tokens in the top-p nucleus (Holtzman et al. 2020): token i is kept iff the mass of the
  tokens strictly more likely than it is below top_p (so the most likely token always is).

  Found by bisecting the probability threshold x* = min{x : mass(p > x) < top_p} instead of
  sorting the vocabulary: 32 masked sums over V cost a tenth of XLA:CPU's sort of 4096 values,
  and the draft pays this K times per round. Exact up to tokens within max(p) / 2**32 below x*.

  Args:
    probs: [..., V] float32 probabilities; top_p: in (0, 1), a float or an array broadcasting
      against probs[..., :1] (one value per row).
  Returns:
    [..., V] bool.
  """
  return _keep_above_cut(
      probs, lambda mid: jnp.sum(jnp.where(probs > mid, probs, 0.0), axis=-1, keepdims=True)
      >= top_p, iterations)


def _keep_above_cut(probs, enough_above, iterations: int):
  """The tokens above a cut found by bisection, not by sorting: `enough_above(x)` (monotone,
  true at 0, false at max(p)) turns false at the cut x*; bisecting [0, max(p)] leaves lo < x*
  with enough_above(lo), and probs > lo keeps the token whose probability is x* itself; the
  most likely token is kept whatever the cut (`enough_above` true up to max(p), e.g. a top_p
  that is 0 in float32, would keep none).

  Args:
    probs: [..., V] float32; enough_above: [..., 1] float32 threshold -> [..., 1] bool.
  Returns:
    [..., V] bool.
  """
  lo = jnp.zeros(probs.shape[:-1] + (1,), probs.dtype)       # enough_above(lo)
  hi = jnp.max(probs, axis=-1, keepdims=True)                # not enough_above(hi)

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) / 2
    enough = enough_above(mid)
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, _ = jax.lax.fori_loop(0, iterations, halve, (lo, hi))
  # The most likely token always stays: a cut that underflows float32 (top_p = 1e-40 is 0 on
  # the device, so every cut has "enough" mass above it) would bisect up to max(p) and keep
  # nothing, and sampling from all zeros drew token 0.
  return (probs > lo) | (probs >= hi)


def sample(rng, probs):
  """Draw one token per row.

  Args:
    rng: PRNG key.
    probs: [..., V] probabilities (zeros allowed), drawn from in float32 whatever their dtype
      (in bfloat16 the Gumbel noise itself was drawn in bfloat16, and its ties went to the
      lowest id: 0.62 for a token of probability 0.5).
  Returns:
    [...] int32 token ids; INVALID_TOKEN (-1) for a row that is no distribution (a NaN in it,
    or no positive probability: see `probabilities`), which categorical sampling would have
    turned into token 0 without a word.
  """
  probs = jnp.asarray(probs, jnp.float32)
  token = jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)
  return jnp.where(jnp.sum(probs, axis=-1) > 0, token, INVALID_TOKEN)
