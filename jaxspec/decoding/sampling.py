"""Turning logits into the distribution a token is drawn from: temperature, top-k, top-p.

Speculative sampling is exact only if the draft's q and the target's p are both the *processed*
distributions of the request (a known bug is q from raw logits while the draft sampled under
top-k/top-p), so every sampler in jaxspec goes through `probabilities`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


MIN_TEMPERATURE = 1e-4  # below this (and above 0) logits / temperature overflows float32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How a request samples. Hashable: it is a static argument of the jitted loops.

  Attributes:
    temperature: 0 means greedy (argmax); must be >= 0.
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of tokens whose mass reaches top_p, in (0, 1] (Holtzman et al.).
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
      raise ValueError(f'temperature must be a number >= 0, got {self.temperature!r}')
    if 0 < self.temperature < MIN_TEMPERATURE or self.temperature == float('inf'):
      raise ValueError(f'temperature {self.temperature} would overflow the logits: use 0 for '
                       f'greedy, or a value in [{MIN_TEMPERATURE}, inf)')
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f'top_k must be an int >= 0, got {self.top_k!r}')
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def probabilities(logits, params: SamplingParams, mask=None):
  """The distribution a token is sampled from under `params`.

  Args:
    logits: [..., V] float.
    params: static sampling parameters.
    mask: optional [..., V] bool, the tokens a constraint allows (grammar-constrained decoding,
      see `jaxspec.decoding.constrained`). Disallowed logits become -inf *before* temperature,
      top-k and top-p, so the result is the request's distribution conditioned on the allowed
      set. A row with no allowed token has no distribution (NaN when sampling, token 0 when
      greedy; nothing can be raised inside jit): callers check masks on the host first
      (`TokenConstraint.allowed` raises `ConstraintError`).
  Returns:
    [..., V] float32 probabilities; one-hot at the argmax (lowest index on ties) when greedy.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if mask is not None:
    logits = jnp.where(mask, logits, -jnp.inf)
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


def nucleus_mask(probs, top_p: float, iterations: int = 32):
  """Tokens in the top-p nucleus (Holtzman et al. 2020): token i is kept iff the mass of the
  tokens strictly more likely than it is below top_p (so the most likely token always is).

  Found by bisecting the probability threshold x* = min{x : mass(p > x) < top_p} instead of
  sorting the vocabulary: 32 masked sums over V cost a tenth of XLA:CPU's sort of 4096 values,
  and the draft pays this K times per round. Exact up to tokens within max(p) / 2**32 below x*.

  Args:
    probs: [..., V] float32 probabilities; top_p: in (0, 1).
  Returns:
    [..., V] bool.
  """
  lo = jnp.zeros(probs.shape[:-1] + (1,), probs.dtype)       # mass(p > lo) >= top_p
  hi = jnp.max(probs, axis=-1, keepdims=True)                # mass(p > hi) <  top_p

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) / 2
    below = jnp.sum(jnp.where(probs > mid, probs, 0.0), axis=-1, keepdims=True) < top_p
    return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

  # x* lies in (lo, hi]: keeping p > lo keeps the token whose probability is x* itself.
  lo, _ = jax.lax.fori_loop(0, iterations, halve, (lo, hi))
  return probs > lo


def sample(rng, probs):
  """Draw one token per row.

  Args:
    rng: PRNG key.
    probs: [..., V] float32 probabilities (zeros allowed).
  Returns:
    [...] int32 token ids.
  """
  return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)
