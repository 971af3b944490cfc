"""Contract 4 for the eviction kernels: each Pallas kernel (interpret mode) equals its jnp
reference, outputs and per-key attention mass, over a grid of shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import (BlockSizes, SelectParams, paged_attention_with_mass,
                             paged_attention_with_mass_reference, select_slots,
                             select_slots_reference)


def _paged_case(seed, *, batch, t, kv_heads, group, head_dim, page_size, pages_per_seq, length,
                shuffled):
  """Random pools and page tables; row 0 holds `length` tokens in slot order, row 1 (if any)
  the same count at shuffled slots (as after evictions). Queries sit at the last positions."""
  rng = np.random.default_rng(seed)
  num_pages = batch * pages_per_seq + 1
  pool = lambda: jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, head_dim)),
                             jnp.float32)
  k_pages, v_pages = pool(), pool()
  page_table = 1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
  s = pages_per_seq * page_size
  key_pos = np.full((batch, s), -1, np.int32)
  for b in range(batch):
    slots = rng.permutation(s)[:length] if (shuffled and b == 1) else np.arange(length)
    key_pos[b, slots] = np.arange(length)
  q_pos = np.array([[length - t + i for i in range(t)]] * batch, np.int32)
  if batch > 1 and t > 1:
    q_pos[-1, -1] = -1                                   # a padding query
  q = jnp.asarray(rng.normal(size=(batch, t, kv_heads * group, head_dim)), jnp.float32)
  return q, k_pages, v_pages, jnp.asarray(page_table, jnp.int32), jnp.asarray(key_pos), \
      jnp.asarray(q_pos)


# Lengths on a page boundary (length % page_size == 0) and off it; T = 1 (decode) and 5 (verify);
# GQA groups 1 and 3; blocks of one and two pages.
@pytest.mark.parametrize('page_size,pages_per_seq,length,t,group,pages_per_block', [
    (4, 4, 8, 1, 1, 1),
    (4, 4, 11, 5, 3, 2),
    (8, 2, 16, 5, 1, 1),
    (8, 2, 13, 1, 3, 2),
    (16, 2, 21, 5, 2, 1),
    (4, 3, 9, 5, 2, 2),          # 3 pages: padded to 4 (power of two) inside the wrapper
])
def test_paged_attention_kernel_matches_reference(page_size, pages_per_seq, length, t, group,
                                                  pages_per_block):
  args = _paged_case(page_size * 7 + length, batch=2, t=t, kv_heads=2, group=group, head_dim=8,
                     page_size=page_size, pages_per_seq=pages_per_seq, length=length,
                     shuffled=True)
  out, mass = paged_attention_with_mass(*args, BlockSizes(pages_per_block=pages_per_block),
                                        interpret=True)
  out_ref, mass_ref = paged_attention_with_mass_reference(*args)
  np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mass, mass_ref, rtol=1e-5, atol=1e-6)
  # Each real query row spreads probability 1 over the keys: mass sums to (real queries) x G.
  real = int((np.asarray(args[5]) >= 0).sum(axis=1)[0])
  np.testing.assert_allclose(np.asarray(mass).sum(axis=(1, 2))[0], real * group * 2, rtol=1e-5)
  # Empty slots receive nothing.
  assert np.all(np.asarray(mass)[np.broadcast_to(np.asarray(args[4])[:, None] < 0,
                                                 mass.shape)] == 0)


def test_paged_attention_kernel_rejects_bad_block():
  args = _paged_case(0, batch=1, t=1, kv_heads=1, group=1, head_dim=8, page_size=4,
                     pages_per_seq=3, length=5, shuffled=False)
  with pytest.raises(ValueError, match='pages_per_block=3'):
    paged_attention_with_mass(*args, BlockSizes(pages_per_block=3), interpret=True)


@pytest.mark.parametrize('seed', range(3))
def test_select_kernel_matches_reference(seed):
  rng = np.random.default_rng(seed)
  b, s = 4, 13                                                 # padded to 16 inside
  key_pos = np.full((b, s), -1, np.int32)
  free_from = rng.integers(0, 45, size=(b, s)).astype(np.int32)
  for row in range(b):
    n = int(rng.integers(0, s + 1))
    key_pos[row, rng.permutation(s)[:n]] = rng.permutation(40)[:n]
  positions = np.array([40, 42, 44, -1], np.int32)
  priority = rng.integers(0, 4, size=(b, s)).astype(np.float32)        # ties on purpose
  params = SelectParams(budget=int(rng.integers(2, 12)), sinks=2, window=3,
                        reuse_delay=int(rng.integers(0, 3)))
  got = select_slots(priority, key_pos, free_from, positions, params, interpret=True)
  want = select_slots_reference(priority, key_pos, free_from, positions, params)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  victim, slot = np.asarray(got[2]), np.asarray(got[3])
  assert victim[-1] == -1 and slot[-1] == -1                     # padding changes nothing
  np.testing.assert_array_equal(got[0][-1], key_pos[-1])
  for row in range(b - 1):
    live = (key_pos[row] >= 0).sum()
    if victim[row] >= 0:                                         # evicts only when at budget,
      assert live >= params.budget                               # never a sink or recent token
      assert params.sinks <= key_pos[row, victim[row]] < positions[row] - params.window
    if slot[row] >= 0:
      assert got[0][row, slot[row]] == positions[row]


@pytest.mark.parametrize('pages_per_seq,t', [(13, 1), (4, 5)])
def test_kernels_lower_through_pallas_triton_for_cuda(pages_per_seq, t):
  """Both kernels lower through Pallas' GPU (Triton) backend to Triton IR for CUDA on this
  CPU-only machine (an op the Triton lowering lacks raises here); compiling to PTX and running
  on a GPU is not checked. 13 pages: slot axes are padded to powers of two for Triton."""
  b, kv_heads, group, h, page_size = 2, 2, 3, 64, 16
  s = pages_per_seq * page_size
  attention = functools.partial(paged_attention_with_mass, interpret=False)
  lowered = jax.jit(attention).trace(
      jnp.zeros((b, t, kv_heads * group, h)), jnp.zeros((kv_heads, 30, page_size, h)),
      jnp.zeros((kv_heads, 30, page_size, h)), jnp.zeros((b, pages_per_seq), jnp.int32),
      jnp.zeros((b, s), jnp.int32), jnp.zeros((b, t), jnp.int32)).lower(
          lowering_platforms=('cuda',))
  assert 'custom_call @__gpu' in lowered.as_text()
  select = functools.partial(select_slots, params=SelectParams(budget=100, sinks=4, window=10),
                             interpret=False)
  lowered = jax.jit(select).trace(jnp.zeros((b, s)), jnp.zeros((b, s), jnp.int32),
                                  jnp.zeros((b, s), jnp.int32), jnp.zeros((b,), jnp.int32)).lower(
                                      lowering_platforms=('cuda',))
  assert 'custom_call @__gpu' in lowered.as_text()


def test_select_treats_nan_priority_as_lowest_in_kernel_and_reference():
  key_pos = np.array([[0, 1, 2, 3, 4, 5, 6, 7]], np.int32)          # full at budget 8
  free_from = np.zeros_like(key_pos)
  priority = np.array([[5, 4, np.nan, 6, 7, 8, 9, 9]], np.float32)
  params = SelectParams(budget=8, sinks=0, window=2, reuse_delay=0)
  positions = np.array([8], np.int32)
  got = select_slots(priority, key_pos, free_from, positions, params, interpret=True)
  want = select_slots_reference(priority, key_pos, free_from, positions, params)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  assert int(np.asarray(got[2])[0]) == 2                         # the NaN slot is evicted
