"""Paged attention for T >= 1 query tokens per sequence that also returns the attention mass each
cached key received (the quantity H2O accumulates, Zhang et al. 2023), as a Pallas kernel.

Keys are masked by *position*, not by slot: once tokens are evicted, slots are reused and slot
order no longer follows position order. Key slot j is visible to a query at position p iff
0 <= key_pos[j] <= p.

The kernel runs one program per (sequence, KV head). The G query heads of the group and the T
query tokens form R = T * G rows (padded to a power of two), so one program reads each cached key
once for all the queries that share it. Pass 1 is an online softmax over blocks of pages (running
max m, normaliser l, output o; Milakov & Gimelshein 2018, as FlashAttention); pass 2 walks the
same pages again and, with the final m and l, sums the probabilities of every key over the R rows.
Neither pass holds more than [R, block] scores, so the [B, N, T, S] attention matrix is never
written to memory.

Backends checked: interpret mode on CPU (equals the reference); Pallas' Triton backend, compiled
and run on an NVIDIA H200 (jax 0.11.2, Triton 3.6; scripts/check_kernels_gpu.py, results in
docs/kernels_gpu.md): equal to the reference within TF32 / bfloat16 rounding over the tests'
grid and in a whole model. Triton needs power-of-two blocks (rows, pages and key blocks are
padded; L and H must be powers of two) and at least 16 keys per block. Gathers of whole pages
through the page table, dots and elementwise ops only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxspec.checks import check_array, check_int, concrete
from jaxspec.kernels.attention import gqa_attention, masked_softmax

# Invisible keys score -inf (never a finite stand-in a visible score could undercut); a row whose
# running max is still -inf (nothing visible with a finite score yet) subtracts 0 instead, so
# exp(-inf - 0) = 0 and no inf - inf NaN arises.
_MASKED = -jnp.inf


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of `paged_attention_with_mass`.

  Attributes:
    pages_per_block: pages of keys processed per loop step (block of pages_per_block * L keys);
      a power of two (the page table is padded with the null page to a multiple of it).
    min_rows: query rows per program are padded to a power of two at least this (Triton's dot
      needs 16).
    min_keys: keys per loop step at least this: a smaller pages_per_block * L is raised to the
      next power of two of pages (and the slot axis padded to match). On an H200, blocks of 4
      keys gave wrong outputs, 8 and more right (docs/kernels_gpu.md).

  Raises:
    ValueError: a field not an int >= 1 (bools and floats refused).
  """

  pages_per_block: int = 1
  min_rows: int = 16
  min_keys: int = 16

  def __post_init__(self):
    for name in ('pages_per_block', 'min_rows', 'min_keys'):   # numpy ints kept as Python ints
      object.__setattr__(self, name, check_int(name, getattr(self, name), 1))


def _kernel(q_ref, q_pos_ref, k_pages_ref, v_pages_ref, page_table_ref, key_pos_ref,
            o_ref, mass_ref, *, pages_per_block: int, scale: float):
  # q_ref:          [R, H]        query rows of one (sequence, KV head): T tokens x G heads
  # q_pos_ref:      [R] int32     absolute position of each row's token, -1 for padding rows
  # k_pages_ref:    [P, L, H]     this KV head's key pool (after RoPE)
  # v_pages_ref:    [P, L, H]     this KV head's value pool
  # page_table_ref: [NP] int32    this sequence's pages, NP = pages per sequence
  # key_pos_ref:    [S] int32     position held by each slot (S = NP * L), -1 = empty
  # o_ref:          [R, H]        attention output
  # mass_ref:       [S] float32   probability mass each slot received, summed over the R rows
  rows, head_dim = q_ref.shape
  page_size = k_pages_ref.shape[1]
  num_blocks = page_table_ref.shape[0] // pages_per_block
  block_k = pages_per_block * page_size
  q = q_ref[...].astype(jnp.float32)
  q_pos = q_pos_ref[...]

  def scores(i):
    pages = page_table_ref[pl.ds(i * pages_per_block, pages_per_block)]
    k = k_pages_ref[pages].reshape(block_k, head_dim).astype(jnp.float32)
    key_pos = key_pos_ref[pl.ds(i * block_k, block_k)]
    visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= q_pos[:, None])     # [R, block_k]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    return jnp.where(visible, s, _MASKED), visible, pages

  def safe(m):                 # the max to subtract: 0 while a row has no finite visible score
    return jnp.where(m == _MASKED, 0.0, m)

  def online_softmax(i, carry):
    o, m, l = carry
    s, visible, pages = scores(i)
    v = v_pages_ref[pages].reshape(block_k, head_dim).astype(jnp.float32)
    m_next = jnp.maximum(m, s.max(axis=1))
    correction = jnp.exp(m - safe(m_next))
    p = jnp.where(visible, jnp.exp(s - safe(m_next)[:, None]), 0.0)
    l_next = correction * l + p.sum(axis=1)
    o_next = correction[:, None] * o + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return o_next, m_next, l_next

  init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  o, m, l = jax.lax.fori_loop(0, num_blocks, online_softmax, init)
  m = safe(m)
  inv_l = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)     # rows that see nothing: 0
  o_ref[...] = (o * inv_l[:, None]).astype(o_ref.dtype)

  def key_mass(i, _):
    s, visible, _ = scores(i)
    p = jnp.where(visible, jnp.exp(s - m[:, None]), 0.0) * inv_l[:, None]
    mass_ref[pl.ds(i * block_k, block_k)] = p.sum(axis=0)
    return 0

  jax.lax.fori_loop(0, num_blocks, key_mass, 0)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _check(q, k_pages, v_pages, page_table, key_pos, q_pos, block_sizes=None, interpret=False):
  for name, x in (('q', q), ('k_pages', k_pages), ('v_pages', v_pages)):
    check_array(name, x, 'float')     # an int q gave int outputs, truncated silently
  for name, x in (('page_table', page_table), ('key_pos', key_pos), ('q_pos', q_pos)):
    check_array(name, x, 'integer')
  if not isinstance(interpret, bool):
    raise ValueError(f'interpret must be True or False, got {interpret!r}')
  for name, x, ndim in (('q', q, 4), ('k_pages', k_pages, 4), ('v_pages', v_pages, 4),
                        ('page_table', page_table, 2), ('key_pos', key_pos, 2),
                        ('q_pos', q_pos, 2)):
    if jnp.ndim(x) != ndim:
      raise ValueError(f'{name} must have {ndim} dimensions, got shape {jnp.shape(x)}')
  b, t, n, h = q.shape
  kv_heads, _, page_size, h_k = k_pages.shape
  if v_pages.shape != k_pages.shape or h_k != h:
    raise ValueError(f'k_pages {k_pages.shape} / v_pages {v_pages.shape} do not match q {q.shape}')
  if kv_heads < 1 or n % kv_heads:
    raise ValueError(f'query heads {n} not a multiple of kv heads {kv_heads} (>= 1)')
  if page_table.shape[0] != b or key_pos.shape != (b, page_table.shape[1] * page_size):
    raise ValueError(f'page_table {page_table.shape} / key_pos {key_pos.shape} do not match '
                     f'batch {b} and page size {page_size}')
  if q_pos.shape != (b, t):
    raise ValueError(f'q_pos must be [B, T] = {(b, t)}, got {q_pos.shape}')
  if block_sizes is None:
    return
  per_block = block_sizes.pages_per_block
  if per_block < 1 or per_block & (per_block - 1):
    raise ValueError(f'pages_per_block={per_block} must be a power of two (blocks of pages are '
                     'power-of-two sized for Triton)')


def check_compiled_sizes(page_size: int, head_dim: int) -> None:
  """Pallas' Triton lowering needs every block a power of two in size.

  Raises:
    ValueError: page_size L (tokens) or head_dim H not a power of two, named.
  """
  for name, n in (('page_size L', page_size), ('head_dim H', head_dim)):
    if n & (n - 1):
      raise ValueError(f'the compiled kernels (interpret=False, Pallas Triton) need {name} a '
                       f'power of two, got {n} (interpret mode takes any size)')


def key_blocks(pages_per_seq: int, page_size: int, block_sizes: BlockSizes) -> tuple[int, int]:
  """(pages per block, padded pages per sequence) `paged_attention_with_mass` runs with.

  The block holds at least `block_sizes.min_keys` keys and a power of two of pages (on an H200,
  4-key blocks gave wrong outputs: docs/kernels_gpu.md); the page table is padded with the null
  page to a power of two that the block divides. pages_per_seq: NP pages; page_size: L tokens.
  """
  per_block = max(block_sizes.pages_per_block, _next_pow2(-(-block_sizes.min_keys // page_size)))
  return per_block, max(_next_pow2(pages_per_seq), per_block)


def _check_page_ids(page_table, k_pages) -> None:
  # Values are readable only outside a jit (a model step passes tracers): an id outside the pool
  # was clamped here and would read arbitrary memory on a GPU.
  from jaxspec.cache.paged import check_page_table  # pylint: disable=g-import-not-at-top (cycle)
  table = concrete(page_table)
  if table is not None:
    check_page_table(table, k_pages.shape[1])


def paged_attention_with_mass(q, k_pages, v_pages, page_table, key_pos, q_pos,
                              block_sizes: BlockSizes = BlockSizes(), *, interpret: bool = False):
  """Attention of T query tokens over a sequence's paged keys, plus the mass each key received.

  Args:
    q: [B, T, N, H] queries (after RoPE), any float dtype.
    k_pages, v_pages: [K, P, L, H] one layer's key / value pools (keys after RoPE).
    page_table: [B, NP] int32 pages of each sequence (slot s at page_table[b, s // L], s % L).
      NP is padded with the null page 0 (its slots masked) to a power of two holding a whole
      number of key blocks (`key_blocks`) for the kernel.
    key_pos: [B, S] int32 absolute position of the token in each slot, S = NP * L; -1 = empty.
    q_pos: [B, T] int32 absolute position of each query token; -1 = padding (output 0, no mass).
    block_sizes: static tiling.
    interpret: run the kernel in the Pallas interpreter (CPU).
  Returns:
    out: [B, T, N, H] in q's dtype; mass: [B, K, S] float32, sum over the T queries and the G
    heads of KV head k of softmax probability on slot s (0 for empty / invisible slots).
    A query that sees no key, or only keys of score -inf, gives 0 and puts no mass anywhere.
    A batch of B = 0 gives empty results.
  Raises:
    ValueError: an argument that is not an array, inconsistent shapes, q / k_pages / v_pages
      of a non-float dtype, page_table / key_pos / q_pos of a non-integer dtype, interpret not a
      bool, block_sizes not a BlockSizes, a pages_per_block that is not a power of two,
      compiled (interpret=False) with a page size L or head_dim H not a power of two
      (`check_compiled_sizes`), or (for a page table whose values can be read: not traced
      inside a caller's jit) a page id outside [0, P).
  """
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f'block_sizes must be a BlockSizes, got {block_sizes!r}')
  _check(q, k_pages, v_pages, page_table, key_pos, q_pos, block_sizes, interpret)
  _check_page_ids(page_table, k_pages)
  if not interpret:
    check_compiled_sizes(k_pages.shape[2], q.shape[3])
  return _paged_attention(q, k_pages, v_pages, page_table, key_pos, q_pos, block_sizes,
                          interpret=interpret)


@functools.partial(jax.jit, static_argnames=('block_sizes', 'interpret'))
def _paged_attention(q, k_pages, v_pages, page_table, key_pos, q_pos, block_sizes, *, interpret):
  _check(q, k_pages, v_pages, page_table, key_pos, q_pos, block_sizes)
  b, t, n, h = q.shape
  kv_heads, _, page_size, _ = k_pages.shape
  g = n // kv_heads
  s = key_pos.shape[1]
  if b == 0:                                   # a grid of no programs: nothing to compute
    return jnp.zeros((0, t, n, h), q.dtype), jnp.zeros((0, kv_heads, s), jnp.float32)
  rows = _next_pow2(max(t * g, block_sizes.min_rows))
  per_block, padded_pages = key_blocks(page_table.shape[1], page_size, block_sizes)
  pad_pages = padded_pages - page_table.shape[1]
  page_table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pad_pages)))
  key_pos = jnp.pad(key_pos.astype(jnp.int32), ((0, 0), (0, pad_pages * page_size)),
                    constant_values=-1)
  qr = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, h)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
  pos_r = jnp.broadcast_to(q_pos.astype(jnp.int32)[:, None, :, None], (b, kv_heads, t, g))
  pos_r = jnp.pad(pos_r.reshape(b, kv_heads, t * g), ((0, 0), (0, 0), (0, rows - t * g)),
                  constant_values=-1)
  s_pad = key_pos.shape[1]
  kernel = functools.partial(_kernel, pages_per_block=per_block,
                             scale=h ** -0.5)
  pool_spec = pl.BlockSpec((None,) + k_pages.shape[1:], lambda i, j: (j, 0, 0, 0))
  out, mass = pl.pallas_call(
      kernel,
      grid=(b, kv_heads),
      in_specs=[
          pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0)),        # q
          pl.BlockSpec((None, None, rows), lambda i, j: (i, j, 0)),              # q_pos
          pool_spec,                                                             # k_pages
          pool_spec,                                                             # v_pages
          pl.BlockSpec((None, page_table.shape[1]), lambda i, j: (i, 0)),        # page_table
          pl.BlockSpec((None, s_pad), lambda i, j: (i, 0)),                      # key_pos
      ],
      out_specs=[
          pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0)),        # out
          pl.BlockSpec((None, None, s_pad), lambda i, j: (i, j, 0)),             # mass
      ],
      out_shape=[jax.ShapeDtypeStruct((b, kv_heads, rows, h), q.dtype),
                 jax.ShapeDtypeStruct((b, kv_heads, s_pad), jnp.float32)],
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
  )(qr, pos_r, k_pages, v_pages, page_table, key_pos)
  mass = mass[:, :, :s]
  out = out[:, :, :t * g].reshape(b, kv_heads, t, g, h).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, n, h), mass


def gather_pages(pool, page_table):
  """[K, P, L, H] pool -> [B, S, K, H] slots of each sequence in slot order (S = NP * L)."""
  gathered = pool[:, page_table]                                     # [K, B, NP, L, H]
  k, b, np_, l, h = gathered.shape
  return gathered.reshape(k, b, np_ * l, h).transpose(1, 2, 0, 3)


def attention_with_mass(q, keys, values, key_pos, q_pos):
  """Pure-jnp attention over gathered slots with a position mask, plus per-key mass.

  The output is computed by exactly the operations of `attention.gqa_attention` (so with T = 1
  and slot == position it is bit-identical to the model's default decode path).

  Args:
    q: [B, T, N, H]; keys, values: [B, S, K, H]; key_pos: [B, S] int32 (-1 empty);
    q_pos: [B, T] int32 (-1 padding).
  Returns:
    out: [B, T, N, H] (rows of padding queries are 0); mass: [B, K, S] float32, exactly 0 on
    empty and invisible slots (also when a query is NaN). A query that sees no key, or only keys
    of score -inf, gives 0 and puts no mass anywhere (`attention.masked_softmax`).
  """
  b, t, n, h = q.shape
  kv_heads = keys.shape[2]
  visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= q_pos[:, :, None])   # [B, T, S]
  out = gqa_attention(q, keys, values, visible)
  seen = visible.any(axis=-1)                                                         # [B, T]
  out = jnp.where(seen[:, :, None, None], out, jnp.zeros((), out.dtype))
  qg = q.reshape(b, t, kv_heads, n // kv_heads, h).astype(jnp.float32)
  s = jnp.einsum('BTKGH,BSKH->BKGTS', qg, keys.astype(jnp.float32)) * (h ** -0.5)
  p = masked_softmax(s, visible[:, None, None])
  return out, p.sum(axis=(2, 3))


def paged_attention_with_mass_reference(q, k_pages, v_pages, page_table, key_pos, q_pos):
  """Pure-jnp reference of `paged_attention_with_mass`: same args (no tiling), results and
  errors."""
  _check(q, k_pages, v_pages, page_table, key_pos, q_pos)
  _check_page_ids(page_table, k_pages)
  if key_pos.shape[1] == 0:           # no slot: no key to see (a reduction over none would fail)
    return jnp.zeros_like(q), jnp.zeros((q.shape[0], k_pages.shape[0], 0), jnp.float32)
  return attention_with_mass(q, gather_pages(k_pages, page_table),
                             gather_pages(v_pages, page_table), key_pos, q_pos)
