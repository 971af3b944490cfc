"""Turning logits into the distribution a token is drawn from: temperature, top-k, top-p.

Speculative sampling is exact only if the draft's q and the target's p are both the *processed*
distributions of the request (a known bug is q from raw logits while the draft sampled under
top-k/top-p), so every sampler in jaxspec goes through `probabilities`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
    if not self.temperature >= 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f'top_k must be an int >= 0, got {self.top_k!r}')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def probabilities(logits, params: SamplingParams):
  """The distribution a token is sampled from under `params`.

  Args:
    logits: [..., V] float.
    params: static sampling parameters.
  Returns:
    [..., V] float32 probabilities; one-hot at the argmax (lowest index on ties) when greedy.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if params.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  logits = logits / params.temperature
  if 0 < params.top_k < vocab:
    kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # Keep a token iff the mass of the tokens strictly more likely than it is below top_p; the
    # most likely token is always kept.
    keep = mass_before < params.top_p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.nn.softmax(logits, axis=-1)


def sample(rng, probs):
  """Draw one token per row.

  Args:
    rng: PRNG key.
    probs: [..., V] float32 probabilities (zeros allowed).
  Returns:
    [...] int32 token ids.
  """
  return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)
