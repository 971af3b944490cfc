"""A per-tensor checksum that does not depend on how a tensor is split over devices or processes,
so a checkpoint restored straight into its shards (`jaxspec.parallel.load_sharded` across
processes, where no process holds a tensor whole) can still be checked against what was saved.

For a tensor x of n elements, with b_i the bit pattern of its i-th element (C order) widened to
32 bits, the sum is

    S(x) = Σ_i b_i · (2i + 1)   mod 2**32

computed with uint32 arithmetic (which wraps), so each device sums its own slice and the
partial sums add up to the same value whatever the split or the reduction order. The odd weights
make a changed element change S (a flipped bit of b_i moves S by ±2^j·(2i + 1) ≢ 0), and most
swaps of two elements too (b_i and b_k swapped move S by 2(b_i − b_k)(k − i), which vanishes mod
2**32 only when that product is a multiple of 2**31). It is a check against damage, not a
cryptographic hash: the SHA-256 beside it (`checksums.tensor_checksums`) is the check wherever
a tensor is whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Dtypes whose bit patterns are summed: the float dtypes weights are stored in.
SUMMED = ('float32', 'bfloat16', 'float16')


def _bits(x):
  """uint32 bit patterns of a float32 / bfloat16 / float16 array."""
  if x.dtype == jnp.float32:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)


def _weights(shape):
  """uint32 2i + 1 of each element's C-order index i (mod 2**32: it wraps from i = 2**31)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2 ** 32)
    stride *= shape[axis]
  return index * jnp.uint32(2) + jnp.uint32(1)


@jax.jit
def _sum(x):
  return jnp.sum(_bits(x) * _weights(x.shape), dtype=jnp.uint32)


def tensor_sums(tree) -> dict:
  """S(x) of each leaf of `tree` whose dtype is in SUMMED, keyed by its '/'-joined pytree path.

  Args:
    tree: a pytree of numpy arrays, jax.Arrays (sharded ones too: the sum runs where the
      shards are, and its replicated scalar result is read by every process) or scalars.
  Returns:
    {path: int in [0, 2**32)}; leaves of other dtypes are left out.
  """
  sums = {}
  for key, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    leaf = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
    if leaf.dtype.name in SUMMED:
      # One host sync per tensor, on purpose: dispatching every sum first and reading them back
      # in one device_get queued dozens of cross-device programs at once, and on simulated CPU
      # devices with 2 cores their all-reduce rendezvous timed out (seen in CI, 8 devices).
      sums[jax.tree_util.keystr(key, simple=True, separator='/')] = int(_sum(leaf))
  return sums
