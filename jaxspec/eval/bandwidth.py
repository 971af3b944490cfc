"""Memory-bandwidth utilisation of decoding (ALGORITHMS.md §7): bytes a step must read ÷ step time
÷ a bandwidth measured on the same machine, in the same process."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import ModelConfig


def measure_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 10) -> float:
  """Best-of-`repeats` bytes/s of an XLA elementwise pass over a float32 array of `num_bytes`
  (counted as one read + one write). Returns bytes per second."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  jax.block_until_ready(f(x))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - start)
  return 2 * x.nbytes / best


def decode_step_bytes(config: ModelConfig, params, batch: int, kv_slots: int,
                      bytes_per_value: int = 4) -> int:
  """Bytes one decode step must read: every weight once (the embedding table only one row per
  sequence) plus the keys and values of `kv_slots` cached slots per sequence, all layers.

  Args:
    params: the params pytree (its dtype decides weight bytes).
    kv_slots: slots attention reads per sequence (the cache capacity for jaxspec's gather).
  """
  leaves = jax.tree_util.tree_leaves_with_path(params)
  weights = 0
  for path, leaf in leaves:
    if 'embed' in jax.tree_util.keystr(path) and not config.tie_embeddings:
      weights += batch * leaf.shape[-1] * leaf.dtype.itemsize
    else:
      weights += leaf.size * leaf.dtype.itemsize
  kv = batch * kv_slots * config.kv_bytes_per_token(bytes_per_value)
  return int(weights + kv)


def mbu(step_bytes: int, step_seconds: float, bandwidth: float) -> float:
  """Memory-bandwidth utilisation in [0, ~1]: step_bytes / step_seconds / bandwidth."""
  return float(step_bytes / step_seconds / bandwidth)


def expected_speedup(alpha: float, k: int, c: float) -> float:
  """Leviathan et al. 2023: (1 - α^(K+1)) / ((1 - α)(K c + 1)), c = draft/target step time."""
  if alpha >= 1.0:
    return (k + 1) / (k * c + 1)
  return float((1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)))


def expected_tokens_per_round(alpha: float, k: int) -> float:
  """(1 - α^(K+1)) / (1 - α): mean tokens per target pass at i.i.d. acceptance α."""
  if alpha >= 1.0:
    return float(k + 1)
  return float((1 - alpha ** (k + 1)) / (1 - alpha))
