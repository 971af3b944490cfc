"""Memory-bandwidth utilisation of decoding (ALGORITHMS.md §7): bytes a step must read ÷ step time
÷ a bandwidth measured on the same machine, in the same process."""

from __future__ import annotations

import math
import numbers
import time
from typing import Optional

import jax
import jax.numpy as jnp

from jaxspec.checks import check_int, check_real
from jaxspec.models import ModelConfig


def measure_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 10) -> float:
  """Read bandwidth of this machine through XLA, in bytes/s.

  The fastest of `repeats` runs of two read-bound kernels over a float32 array of `num_bytes`
  bytes (256 MiB by default: larger than most caches; a last-level cache as large as it reads
  high): a sum reduction, and a vector-matrix product (the access pattern of a batch-1 decode
  step). Only the bytes read are counted.

  Raises:
    ValueError: num_bytes not an int >= 32 KiB (one row of the array), repeats not an int >= 1.
  """
  num_bytes = check_int('num_bytes', num_bytes, 4 * 8192)
  repeats = check_int('repeats', repeats, 1)
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
                      bytes_per_value: Optional[int] = None) -> int:
  """Bytes one decode step must read: every weight once (the embedding table only one row per
  sequence) plus the keys and values of `kv_slots` cached slots per sequence, all layers.

  Args:
    params: the params pytree (its dtype decides weight bytes).
    batch: sequences per step (>= 1).
    kv_slots: cached slots a step must read per sequence (the benchmark counts the prompt and
      max_new_tokens; jaxspec's gather reads the whole page-table capacity, a little more).
    bytes_per_value: bytes of one cached key or value element; None: the cache's dtype,
      `config.dtype` (4 for float32, 2 for bfloat16).
  Returns:
    bytes (int).
  Raises:
    ValueError: batch < 1, kv_slots < 0 or bytes_per_value < 1 (not ints).
  """
  batch = check_int('batch', batch, 1)
  kv_slots = check_int('kv_slots', kv_slots, 0)
  bytes_per_value = (jnp.dtype(config.dtype).itemsize if bytes_per_value is None
                     else check_int('bytes_per_value', bytes_per_value, 1))
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
  """Memory-bandwidth utilisation in [0, ~1]: step_bytes / step_seconds / bandwidth.

  Args: step_bytes (bytes, >= 0), step_seconds (s, > 0), bandwidth (bytes/s, > 0).
  Raises ValueError naming a value out of range (a zero time or bandwidth divided by zero).
  """
  for name, value, low_open in (('step_bytes', step_bytes, False),
                                ('step_seconds', step_seconds, True),
                                ('bandwidth', bandwidth, True)):
    check_real(name, value, 0.0, math.inf, high_open=True)
    if low_open and value == 0:
      raise ValueError(f'{name} must be > 0, got {value!r}')
  return float(step_bytes / step_seconds / bandwidth)


def _alpha_k(alpha, k) -> tuple:
  """(alpha, k) checked: α a number in [0, 1] (NaN passes, for a run without rounds), K an int
  >= 0."""
  if isinstance(alpha, numbers.Real) and not isinstance(alpha, bool) and math.isnan(alpha):
    return math.nan, check_int('k', k, 0)
  return check_real('alpha', alpha, 0.0, 1.0), check_int('k', k, 0)


def expected_speedup(alpha: float, k: int, c: float) -> float:
  """Leviathan et al. 2023: (1 - α^(K+1)) / ((1 - α)(K c + 1)), c = draft/target step time,
  the verification costing one target step.

  Raises ValueError: α outside [0, 1] (NaN gives NaN), K not an int >= 0, c not a finite
  number >= 0.
  """
  alpha, k = _alpha_k(alpha, k)
  c = check_real('c', c, 0.0, math.inf, high_open=True)
  return float(expected_tokens_per_round(alpha, k) / (k * c + 1))


def expected_tokens_per_round(alpha: float, k: int) -> float:
  """(1 - α^(K+1)) / (1 - α): mean tokens per target pass at i.i.d. acceptance α (K + 1 at
  α = 1). Raises ValueError: α outside [0, 1] (NaN gives NaN), K not an int >= 0."""
  alpha, k = _alpha_k(alpha, k)
  if alpha >= 1.0:
    return float(k + 1)
  return float((1 - alpha ** (k + 1)) / (1 - alpha))
