"""Memory-bandwidth utilisation of decoding (ALGORITHMS.md §7): bytes a step must read ÷ step time
÷ a bandwidth measured on the same machine, in the same process."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxspec.models import ModelConfig


def measure_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 10) -> float:
  """Read bandwidth of this machine through XLA, in bytes/s.

  The fastest of `repeats` runs of two read-bound kernels over a float32 array of `num_bytes`
  (far larger than any cache): a sum reduction, and a vector-matrix product (the access pattern
  of a batch-1 decode step). Only the bytes read are counted.
  """
  n = num_bytes // 4
  cols = 8192
  x = jnp.ones((n // cols, cols), jnp.float32)
  v = jnp.ones((n // cols,), jnp.float32)
  kernels = [(jax.jit(jnp.sum), (x,)), (jax.jit(lambda v, w: v @ w), (v, x))]
  best = float('inf')
  for f, args in kernels:
    jax.block_until_ready(f(*args))
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(f(*args))
      best = min(best, time.perf_counter() - start)
  return x.nbytes / best


def decode_step_bytes(config: ModelConfig, params, batch: int, kv_slots: int,
                      bytes_per_value: int = 4) -> int:
  """Bytes one decode step must read: every weight once (the embedding table only one row per
  sequence) plus the keys and values of `kv_slots` cached slots per sequence, all layers.

  Args:
    params: the params pytree (its dtype decides weight bytes).
    kv_slots: cached slots a step must read per sequence (the benchmark counts the prompt and
      max_new_tokens; jaxspec's gather reads the whole page-table capacity, a little more).
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
