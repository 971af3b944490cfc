"""The paged KV cache as a pytree, with pure write / read / rollback functions (vLLM's
PagedAttention layout, Kwon et al. 2023).

Token at slot s of sequence b lives at page `page_table[b, s // L]`, offset `s % L`. Page 0 is the
null page: padded tokens write there and no sequence's page table points at it for a live slot.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checks import check_int

NULL_PAGE = 0


def pages_needed(num_tokens: int, page_size: int) -> int:
  """Pages that hold `num_tokens` tokens: ceil(num_tokens / page_size) (floor is the classic
  bug).

  Raises:
    ValueError: num_tokens not an int >= 0 or page_size not an int >= 1 (named).
  """
  num_tokens = check_int('num_tokens', num_tokens, 0)
  page_size = check_int('page_size', page_size, 1)
  return -(-num_tokens // page_size)


def memory_bytes(device=None) -> Optional[int]:
  """Bytes of memory `device` (default: the first device) can hold: its allocator's limit, or
  for the CPU, whose allocator reports none, the machine's physical memory; None if unknown."""
  device = jax.devices()[0] if device is None else device
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  (backends that do not implement it)
    stats = {}
  if stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  return host_memory_bytes() if device.platform == 'cpu' else None


def host_memory_bytes() -> Optional[int]:
  """Bytes of the machine's physical memory (host RAM), None if unknown."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return None


def check_pool_fits(pools, what: str = 'the KV cache', device=None) -> None:
  """Refuse key + value pools that cannot fit one device's memory at all, before allocating
  them (on the CPU, a pool past the machine's memory was killed by the OS without a message).

  Args:
    pools: per pool allocated together (an engine's target and draft), (name, shape, dtype),
      (name, shape, dtype, split) or (name, shape, dtype, split, shares): the pages' shape
      [layers, K, P, L, H], their dtype, the number of devices the pool is split over (1: each
      device holds it whole; a target cache split over a mesh's 'model' axis: that axis' size),
      and how many devices' shares land in `device`'s memory (1; simulated CPU devices all
      share the host's: the mesh's device count).
    what: the cache's name, for the message.
    device: the device each share lands on (default: the first device).
  Raises:
    ValueError: the shares of the pools in one memory exceed `memory_bytes(device)` (each pool
      and the device named, in GiB).
  """
  device = jax.devices()[0] if device is None else device
  parts = []
  for name, shape, dtype, *rest in pools:
    split, shares = (list(rest) + [1, 1])[:2]
    whole = 2 * math.prod(shape) * jnp.dtype(dtype).itemsize
    parts.append((name, shape, whole / split * shares, split, shares))
  need = sum(part[2] for part in parts)
  have = memory_bytes(device)
  if have is not None and need > have:
    each = '; '.join(f'{name}: {b / 2 ** 30:.1f} GiB, {shape[2]} pages of {shape[3]} tokens, '
                     f'{shape[0]} layers' + (f', split over {split} devices' if split > 1 else '')
                     + (f', {shares} shares' if shares > 1 else '')
                     for name, shape, b, split, shares in parts)
    where = ('in the host memory its CPU devices share' if any(p[4] > 1 for p in parts)
             else 'on one device')
    raise ValueError(f'{what} needs {need / 2 ** 30:.1f} GiB of key/value pages {where} '
                     f'({each}), more than the {have / 2 ** 30:.1f} GiB of memory of {device} '
                     f'({device.platform}): use fewer pages (a smaller batch, pool or context)')


@flax.struct.dataclass
class PagedKVCache:
  """Keys (after RoPE) and values of every layer, in fixed-size pages.

  Fields:
    k_pages: [layers, K, P, L, H] keys, P pages of L tokens per KV head.
    v_pages: [layers, K, P, L, H] values.
    page_table: [B, pages_per_seq] int32, physical page of each logical page of each sequence.
    lengths: [B] int32, tokens cached per sequence (slots 0 .. lengths-1 are live).
  """

  k_pages: jax.Array
  v_pages: jax.Array
  page_table: jax.Array
  lengths: jax.Array

  @property
  def num_layers(self) -> int:
    return self.k_pages.shape[0]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[2]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[3]

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @property
  def capacity(self) -> int:
    """Tokens one sequence can hold: pages_per_seq * page_size."""
    return self.page_table.shape[1] * self.page_size

  @property
  def num_bytes(self) -> int:
    """Bytes held by the K and V page pools."""
    return self.k_pages.nbytes + self.v_pages.nbytes


def check_page_table(page_table, num_pages: int) -> None:
  """Check a page table before a cache is built over it (host side, once per cache).

  Raises:
    ValueError: not a 2-D integer array [batch, pages_per_seq], or an entry outside
      [0, num_pages) (named).
  """
  table = np.asarray(page_table)        # a small int table: the copy is cheap
  if not np.issubdtype(table.dtype, np.integer):
    raise ValueError(f'page_table must hold integer page ids, got dtype {table.dtype}')
  if table.ndim != 2:
    raise ValueError(f'page_table must be [batch, pages_per_seq], got shape {table.shape}')
  if table.size and (table.min() < 0 or table.max() >= num_pages):
    raise ValueError(f'page_table entries must lie in [0, {num_pages}), got '
                     f'[{table.min()}, {table.max()}]')


def init_cache(*, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
               page_size: int, page_table, dtype=jnp.float32) -> PagedKVCache:
  """An empty cache over a pool of `num_pages` pages (page 0 is the null page).

  Args:
    page_table: [B, pages_per_seq] int array mapping each sequence's logical pages to pool pages,
      as handed out by `PageAllocator`; unused entries hold NULL_PAGE.
    dtype: of the pages; the model refuses a cache whose dtype is not its config.dtype
      (`jaxspec.models.cache_for` builds one that matches).
  Raises:
    ValueError: a size that is not an int >= 1, a page table that is not a 2-D integer array,
      an entry outside the pool (named), or pools larger than the device's memory
      (`check_pool_fits`).
  """
  sizes = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
               num_pages=num_pages, page_size=page_size)
  num_layers, num_kv_heads, head_dim, num_pages, page_size = (
      check_int(name, value, 1) for name, value in sizes.items())
  check_page_table(page_table, num_pages)
  page_table = jnp.asarray(page_table, jnp.int32)
  shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
  check_pool_fits([('keys and values', shape, dtype)])
  return PagedKVCache(
      k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
      page_table=page_table, lengths=jnp.zeros((page_table.shape[0],), jnp.int32))


def slot_address(page_table, slots, page_size: int):
  """(page, offset) of each slot: page_table[b, s // L], s % L; padding maps to the null page.

  Args:
    page_table: [B, pages_per_seq] int32.
    slots: [B, T] int32; a negative slot (-1 by convention) is padding. A slot at or past the
      capacity (pages_per_seq * L) maps to the null page too, so its write is discarded: a
      traced function cannot raise, and the callers check capacity on the host.
  Returns:
    pages, offsets: [B, T] int32 each.
  """
  valid = (slots >= 0) & (slots < page_table.shape[1] * page_size)
  safe = jnp.where(valid, slots, 0)
  pages = jnp.take_along_axis(page_table, safe // page_size, axis=1)
  pages = jnp.where(valid, pages, NULL_PAGE)
  offsets = jnp.where(valid, safe % page_size, 0)
  return pages, offsets


def write_kv(pages_pool, layer: int, pages, offsets, values):
  """Scatter one layer's new keys (or values) into the pool.

  Args:
    pages_pool: [layers, K, P, L, H].
    layer: static layer index.
    pages, offsets: [B, T] int32 from `slot_address`.
    values: [B, T, K, H].
  Returns:
    The pool with values written at [layer, :, pages, offsets].
  """
  return pages_pool.at[layer, :, pages, offsets].set(values.astype(pages_pool.dtype))


def write_keys_values(k_pages, v_pages, layer: int, pages, offsets, k, v):
  """`write_kv` of one layer's new keys and values, keeping every cached value finite.

  A token whose key or value (per KV head) holds NaN or inf (a model that overflowed, NaN
  weights) is written as key NaN, value 0. A query that sees its slot then scores NaN (its
  output NaN, so its logits are NaN and the request fails: `jaxspec.decoding.sampling`); a
  query that does not see the slot gets nothing of it. (A NaN *value* at a slot a query does
  not see reached it anyway, as weight 0 times NaN: stale pages failed healthy requests, and a
  chunk's later token, e.g. a rejected proposal, its earlier ones.)

  Args:
    k_pages, v_pages: [layers, K, P, L, H] pools; layer: static index.
    pages, offsets: [B, T] int32 from `slot_address`; k, v: [B, T, K, H] new keys and values.
  Returns:
    (k_pages, v_pages) with the new tokens written.
  """
  k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)   # an overflowing cast is caught too
  bad = ~(jnp.isfinite(k).all(axis=-1, keepdims=True) & jnp.isfinite(v).all(axis=-1, keepdims=True))
  return (write_kv(k_pages, layer, pages, offsets, jnp.where(bad, jnp.nan, k)),
          write_kv(v_pages, layer, pages, offsets, jnp.where(bad, 0, v)))


def gather_kv(pages_pool, layer: int, page_table):
  """All slots of every sequence for one layer, in slot order.

  Args:
    pages_pool: [layers, K, P, L, H].
    page_table: [B, pages_per_seq] int32.
  Returns:
    [B, S, K, H] with S = pages_per_seq * L.
  """
  per_layer = pages_pool[layer]                       # [K, P, L, H]
  gathered = per_layer[:, page_table]                 # [K, B, pages_per_seq, L, H]
  k, b, n, l, h = gathered.shape
  return gathered.reshape(k, b, n * l, h).transpose(1, 2, 0, 3)


def rollback(cache: PagedKVCache, new_lengths) -> PagedKVCache:
  """Forget every slot at or past `new_lengths` (rejected speculative tokens): no copy, the stale
  slots are masked out of attention and overwritten by the next write.

  Args:
    new_lengths: [B] int32, in [0, current lengths] (values past either end are clipped).
  Raises:
    ValueError: new_lengths not of shape [B] or not integers (a float 1.7 was cut to 1; shapes
      and dtypes are static, so this holds under jit).
  """
  new_lengths = jnp.asarray(new_lengths)          # lists and tuples too; a tracer stays one
  if new_lengths.shape != cache.lengths.shape:
    raise ValueError(f'new_lengths must have shape {cache.lengths.shape} (one per sequence), got '
                     f'{new_lengths.shape}')
  if not jnp.issubdtype(new_lengths.dtype, jnp.integer):
    raise ValueError(f'new_lengths must be integers, got dtype {new_lengths.dtype}')
  return cache.replace(lengths=jnp.clip(new_lengths.astype(jnp.int32), 0, cache.lengths))
