"""Contract 4 for the eviction kernels: each Pallas kernel (interpret mode) equals its jnp
reference, outputs and per-key attention mass, over a grid of shapes."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.paged import write_keys_values
from jaxspec.kernels import (BlockSizes, SelectParams, gqa_attention, gqa_attention_per_query,
                             paged_attention_with_mass, paged_attention_with_mass_reference,
                             select_slots, select_slots_reference)
from jaxspec.kernels.paged_attention import attention_with_mass, key_blocks


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
  with pytest.raises(ValueError, match='pages_per_block=3 must be a power of two'):
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
  params = SelectParams(budget=int(rng.integers(6, 12)), sinks=2, window=3,
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
      candidates = [i for i in range(s) if params.sinks <= key_pos[row, i] < positions[row] -
                    params.window]      # the victim: lowest priority, then the oldest position
      assert min(candidates, key=lambda i: (priority[row, i], key_pos[row, i])) == victim[row]
    if slot[row] >= 0:
      assert got[0][row, slot[row]] == positions[row]


@pytest.mark.parametrize('pages_per_seq,t', [(13, 1), (4, 5)])
def test_kernels_lower_through_pallas_triton_for_cuda(pages_per_seq, t):
  """Both kernels lower through Pallas' GPU (Triton) backend to Triton IR for CUDA on this
  CPU-only machine (an op the Triton lowering lacks raises here); compiling and running them on
  a GPU is scripts/check_kernels_gpu.py's job. 13 pages: slot axes are padded to powers of two."""
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


def test_select_with_inf_priorities_evicts_a_candidate_in_kernel_and_reference():
  # Every candidate at +inf: the reference's argmin landed on slot 0, the sink, and evicted it.
  priority = np.array([[0, np.inf, np.inf]], np.float32)
  key_pos, free_from = np.array([[0, 1, 2]], np.int32), np.zeros((1, 3), np.int32)
  params, positions = SelectParams(budget=3, sinks=1), np.array([3], np.int32)
  got = select_slots(priority, key_pos, free_from, positions, params, interpret=True)
  want = select_slots_reference(priority, key_pos, free_from, positions, params)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  np.testing.assert_array_equal(want[0], [[0, 3, 2]])             # the sink kept, slot 1 reused
  assert int(want[2][0]) == 1


@pytest.mark.parametrize('select', [
    functools.partial(select_slots, interpret=True), select_slots_reference])
@pytest.mark.parametrize('shapes', [
    ((1, 2), (1, 3), (1, 3), (1,)),          # priority
    ((1, 3), (1, 3), (2, 3), (1,)),          # free_from
    ((1, 3), (1, 3), (1, 3), (2,)),          # positions
    ((3,), (3,), (3,), (1,)),                # not [B, S]
])
def test_select_rejects_mismatched_shapes(select, shapes):
  prio, key_pos, free_from, positions = (np.zeros(shape, dt) for shape, dt in
                                         zip(shapes, (np.float32, np.int32, np.int32, np.int32)))
  with pytest.raises(ValueError, match=re.escape(f'priority {shapes[0]}, key_pos {shapes[1]} '
                                                 f'and free_from {shapes[2]}')):
    select(prio, key_pos, free_from, positions, SelectParams(budget=3))


def _old_gqa_attention(q, k, v, mask):
  """gqa_attention as it was: jax.nn.softmax over scores with invisible keys set to -1e30."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(b, t, kv_heads, n // kv_heads, h).astype(jnp.float32)
  scores = jnp.einsum('BTKGH,BSKH->BKGTS', qg, k.astype(jnp.float32)) * (h ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  v_t = v.astype(jnp.float32).transpose(0, 2, 3, 1)
  out = jnp.einsum('BKGTS,BKHS->BKGTH', probs, v_t)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


def _old_mass(q, keys, key_pos, q_pos):
  """attention_with_mass's mass as it was (softmax over -1e30-masked scores, times the mask)."""
  b, t, n, h = q.shape
  kv_heads = keys.shape[2]
  visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= q_pos[:, :, None])
  seen = visible.any(axis=-1)
  qg = q.reshape(b, t, kv_heads, n // kv_heads, h).astype(jnp.float32)
  s = jnp.einsum('BTKGH,BSKH->BKGTS', qg, keys.astype(jnp.float32)) * (h ** -0.5)
  s = jnp.where(visible[:, None, None], s, -1e30)
  p = jax.nn.softmax(s, axis=-1) * (visible & seen[:, :, None])[:, None, None]
  return p.sum(axis=(2, 3))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('seed,t,group', [(0, 1, 1), (1, 5, 3), (2, 3, 2)])
def test_references_round_ordinary_rows_exactly_as_before(seed, t, group, dtype):
  """Masking with -inf (so invisible keys never get weight) leaves every row that sees a key
  bit-identical to the old -1e30 + jax.nn.softmax formula, eager and jitted: the greedy-equality
  tests and README numbers depend on it. Scores are scaled up so some rows are peaked."""
  rng = np.random.default_rng(seed)
  b, s, kv_heads, h = 3, 24, 2, 16
  q = jnp.asarray(rng.normal(size=(b, t, kv_heads * group, h)) * 4, dtype)
  k = jnp.asarray(rng.normal(size=(b, s, kv_heads, h)) * 4, dtype)
  v = jnp.asarray(rng.normal(size=(b, s, kv_heads, h)), dtype)
  key_pos = np.where(rng.random((b, s)) < 0.2, -1, rng.permutation(s)).astype(np.int32)
  key_pos[:, 0] = 0                                                    # every query sees a key
  q_pos = jnp.asarray(rng.integers(0, s, size=(b, t)), jnp.int32)
  key_pos = jnp.asarray(key_pos)
  mask = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= q_pos[:, :, None])
  for wrap in (lambda f: f, jax.jit):
    np.testing.assert_array_equal(wrap(gqa_attention)(q, k, v, mask),
                                  wrap(_old_gqa_attention)(q, k, v, mask))
    np.testing.assert_array_equal(wrap(gqa_attention_per_query)(q, k, v, mask),
                                  jnp.concatenate([wrap(_old_gqa_attention)(
                                      q[:, i:i + 1], k, v, mask[:, i:i + 1]) for i in range(t)],
                                      axis=1))
    out, mass = wrap(attention_with_mass)(q, k, v, key_pos, q_pos)
    np.testing.assert_array_equal(out, wrap(_old_gqa_attention)(q, k, v, mask))
    np.testing.assert_array_equal(mass, wrap(_old_mass)(q, k, key_pos, q_pos))
  if dtype == jnp.float32:          # training differentiates it: the gradients are unchanged too
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, mask)))
    for new, old_ in zip(jax.grad(loss(gqa_attention), argnums=(0, 1, 2))(q, k, v),
                         jax.grad(loss(_old_gqa_attention), argnums=(0, 1, 2))(q, k, v)):
      np.testing.assert_array_equal(new, old_)


def _tiny_paged(q_value, k_value):
  """One sequence, one KV head, pages of 2 slots: slot 0 at position 0 (visible to the query at
  position 0), slot 1 at position 5 (the future); value of slot j = [2j + 4, 2j + 5]."""
  q = jnp.full((1, 1, 1, 2), q_value, jnp.float32)
  k_pages = jnp.full((1, 2, 2, 2), k_value, jnp.float32)
  v_pages = jnp.arange(8.0).reshape(1, 2, 2, 2)
  return (q, k_pages, v_pages, jnp.array([[1]], jnp.int32), jnp.array([[0, 5]], jnp.int32),
          jnp.array([[0]], jnp.int32))


@pytest.mark.parametrize('k_value,want_out,want_mass', [
    (1e20, [0.0, 0.0], [0.0, 0.0]),        # visible score -inf: the query sees nothing
    (1e17, [4.0, 5.0], [1.0, 0.0]),        # visible score -1.4e37, finite below -1e30
])
def test_invisible_keys_never_get_weight(k_value, want_out, want_mass):
  """The old references masked with -1e30, so a visible score of -inf (or a finite one below
  -1e30) left the future token all the weight; the old kernel returned 0 for the finite one."""
  args = _tiny_paged(-1e20, k_value)
  for out, mass in (paged_attention_with_mass(*args, interpret=True),
                    paged_attention_with_mass_reference(*args)):
    np.testing.assert_array_equal(out[0, 0, 0], want_out)
    np.testing.assert_array_equal(mass[0, 0], want_mass)
  q, k = args[0], args[1][:, 1][None].transpose(0, 2, 1, 3)             # slots of page 1
  mask = jnp.array([[[True, False]]])
  for attend in (gqa_attention, gqa_attention_per_query):
    np.testing.assert_array_equal(attend(q, k, args[2][:, 1][None].transpose(0, 2, 1, 3),
                                         mask)[0, 0, 0], want_out)


@pytest.mark.parametrize('stale', [np.nan, np.inf])
def test_a_non_finite_value_reaches_only_the_queries_that_see_its_slot(stale):
  """Slot 1 (position 5) is written with a NaN or inf value (a model that overflowed): the
  query at position 0 does not see it, the one at position 5 does. Written as it was, weight 0
  times NaN reached the first query too (a stale page failed later requests, a chunk's later
  token its earlier ones); `write_keys_values` stores key NaN, value 0."""
  q, k_pages, v_pages, table, key_pos, _ = _tiny_paged(1.0, 1.0)
  q = jnp.concatenate([q, q], axis=1)                                    # [1, 2, 1, 2]
  q_pos = jnp.array([[0, 5]], jnp.int32)
  pages, offsets = jnp.array([[1]], jnp.int32), jnp.array([[1]], jnp.int32)
  new = jnp.full((1, 1, 1, 2), 1.0)
  k_pages, v_pages = write_keys_values(k_pages[None], v_pages[None], 0, pages, offsets, new,
                                       new.at[0, 0, 0, 1].set(stale))
  assert np.isnan(k_pages[0, 0, 1, 1]).all() and (v_pages[0, 0, 1, 1] == 0).all()
  k_pages, v_pages = k_pages[0], v_pages[0]
  for attend in (functools.partial(paged_attention_with_mass, interpret=True),
                 paged_attention_with_mass_reference):
    out, _ = attend(q, k_pages, v_pages, table, key_pos, q_pos)
    np.testing.assert_array_equal(out[0, 0, 0], [4.0, 5.0])
    assert np.isnan(out[0, 1, 0]).all()
  k, v = (x[:, 1][None].transpose(0, 2, 1, 3) for x in (k_pages, v_pages))
  mask = jnp.array([[[True, False], [True, True]]])
  for attend in (gqa_attention, gqa_attention_per_query):
    out = attend(q, k, v, mask)
    np.testing.assert_array_equal(out[0, 0, 0], [4.0, 5.0])
    assert np.isnan(out[0, 1, 0]).all()


def test_a_query_that_sees_nothing_gives_zero():
  """Padding queries (and any with no visible key) give 0, in the references as the kernel
  (the old references gave them the mean of every value)."""
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(1, 2, 2, 4)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 3, 1, 4)), jnp.float32)
  mask = jnp.array([[[True, True, False], [False, False, False]]])
  for attend in (gqa_attention, gqa_attention_per_query):
    out = np.asarray(attend(q, k, k, mask))
    assert np.all(out[0, 1] == 0) and np.all(out[0, 0] != 0)


def test_nan_query_puts_no_mass_on_empty_or_invisible_slots():
  """With grouped heads, a NaN query head made the reference's mass NaN x 0 = NaN on every slot;
  the docstring (and the kernel) say 0 on empty / invisible ones."""
  q = jnp.ones((1, 1, 2, 2)).at[0, 0, 0, 0].set(jnp.nan)
  pool = jnp.ones((1, 3, 2, 2))
  args = (q, pool, pool, jnp.array([[1, 2]], jnp.int32), jnp.array([[0, 1, 2, -1]], jnp.int32),
          jnp.array([[1]], jnp.int32))
  for _, mass in (paged_attention_with_mass(*args, interpret=True),
                  paged_attention_with_mass_reference(*args)):
    mass = np.asarray(mass[0, 0])
    assert np.isnan(mass[:2]).all() and np.all(mass[2:] == 0)


@pytest.mark.parametrize('attend', [
    functools.partial(paged_attention_with_mass, interpret=True),
    paged_attention_with_mass_reference])
@pytest.mark.parametrize('index,name', [(3, 'page_table'), (4, 'key_pos'), (5, 'q_pos')])
def test_paged_attention_rejects_non_integer_positions_and_pages(attend, index, name):
  args = list(_paged_case(0, batch=1, t=1, kv_heads=1, group=1, head_dim=8, page_size=4,
                          pages_per_seq=2, length=5, shuffled=False))
  args[index] = args[index].astype(jnp.float32) + 0.5
  with pytest.raises(ValueError, match=f'{name} must be an integer array, got dtype float32'):
    attend(*args)


@pytest.mark.parametrize('field,value', [('pages_per_block', 2.0), ('pages_per_block', True),
                                         ('pages_per_block', 0), ('min_rows', 2.5),
                                         ('min_rows', -16), ('min_keys', 0)])
def test_block_sizes_are_checked(field, value):
  with pytest.raises(ValueError, match=re.escape(f'{field} must be an int >= 1, got {value!r}')):
    BlockSizes(**{field: value})


@pytest.mark.parametrize('page_size,pages_per_seq,blocks,want', [
    (2, 1, BlockSizes(), (8, 8)),                      # past the next power of two (1 page)
    (4, 3, BlockSizes(), (4, 4)),
    (4, 2, BlockSizes(min_keys=64), (16, 16)),
    (16, 13, BlockSizes(), (1, 16)),                   # 16 keys already: only NP padded
    (4, 1, BlockSizes(pages_per_block=8), (8, 8)),     # a block wider than the padded table
])
def test_key_blocks_below_min_keys_are_padded_with_empty_pages(page_size, pages_per_seq, blocks,
                                                               want):
  """Blocks of fewer than min_keys keys (wrong outputs on an H200 at 4 keys) are widened: more
  pages per block, the page table padded with the null page beyond a power of two if needed;
  the kernel run so equals the reference."""
  assert key_blocks(pages_per_seq, page_size, blocks) == want
  args = _paged_case(5, batch=2, t=3, kv_heads=2, group=2, head_dim=8, page_size=page_size,
                     pages_per_seq=pages_per_seq, length=page_size * pages_per_seq - 1,
                     shuffled=True)
  out, mass = paged_attention_with_mass(*args, blocks, interpret=True)
  out_ref, mass_ref = paged_attention_with_mass_reference(*args)
  assert mass.shape == mass_ref.shape == (2, 2, page_size * pages_per_seq)
  np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mass, mass_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('page_size,head_dim,needle', [
    (12, 8, 'page_size L a power of two, got 12'), (4, 48, 'head_dim H a power of two, got 48')])
def test_compiled_kernel_refuses_sizes_triton_cannot_block(page_size, head_dim, needle):
  args = _paged_case(0, batch=1, t=1, kv_heads=1, group=1, head_dim=head_dim,
                     page_size=page_size, pages_per_seq=2, length=5, shuffled=False)
  with pytest.raises(ValueError, match=needle):
    paged_attention_with_mass(*args, interpret=False)
  paged_attention_with_mass(*args, interpret=True)             # interpret mode takes any size


def test_block_sizes_store_python_ints():
  assert BlockSizes(np.int64(2), np.int32(16)) == BlockSizes(2, 16)
  assert type(BlockSizes(np.int64(2)).pages_per_block) is int


def test_paged_attention_of_an_empty_batch_is_empty_as_the_reference():
  args = _paged_case(0, batch=1, t=2, kv_heads=2, group=2, head_dim=8, page_size=4,
                     pages_per_seq=2, length=5, shuffled=False)
  args = [x if i in (1, 2) else x[:0] for i, x in enumerate(args)]     # pools keep their pages
  got = paged_attention_with_mass(*args, interpret=True)
  want = paged_attention_with_mass_reference(*args)
  for g, w, shape in zip(got, want, [(0, 2, 4, 8), (0, 2, 8)]):
    assert g.shape == w.shape == shape and g.dtype == w.dtype


def test_select_slots_of_an_empty_batch_is_empty_as_the_reference():
  args = (jnp.zeros((0, 4)), jnp.zeros((0, 4), jnp.int32), jnp.zeros((0, 4), jnp.int32),
          jnp.zeros((0,), jnp.int32), SelectParams(budget=3))
  got, want = select_slots(*args, interpret=True), select_slots_reference(*args)
  for g, w, shape in zip(got, want, [(0, 4), (0, 4), (0,), (0,)]):
    assert g.shape == w.shape == shape and g.dtype == w.dtype == jnp.int32


def test_a_pool_without_kv_heads_is_named():
  q, pages = jnp.ones((1, 1, 2, 4)), jnp.ones((0, 2, 2, 4))
  with pytest.raises(ValueError, match=r'query heads 2 not a multiple of kv heads 0 \(>= 1\)'):
    paged_attention_with_mass_reference(q, pages, pages, jnp.array([[1]]), jnp.array([[0, 1]]),
                                        jnp.array([[1]]))


@pytest.mark.parametrize('kwargs,needle', [
    (dict(budget=0), 'SelectParams.budget must be an int >= 1, got 0'),
    (dict(budget=2.5), 'got 2.5'),
    (dict(budget=3, window=-1), 'SelectParams.window must be an int >= 0, got -1'),
    (dict(budget=3, sinks=2, window=1), 'budget=3 must be >= sinks + window + 1 = 4'),
])
def test_select_params_are_checked_when_built(kwargs, needle):
  # Built directly, budget 0 evicted slot 0 though a slot was free, a negative delay was kept.
  with pytest.raises(ValueError, match=re.escape(needle)):
    SelectParams(**kwargs)


@pytest.mark.parametrize('select', [
    functools.partial(select_slots, interpret=True), select_slots_reference])
def test_a_tie_evicts_the_oldest_token_whatever_slot_it_is_in(select):
  # Slots 1 and 3 tie at the lowest priority; slot 3 holds the older token (position 2). By slot
  # index, which tokens survive depended on where they landed (reuse_delay moves that).
  priority = np.array([[5.0, 1.0, 5.0, 1.0]], np.float32)
  key_pos, free_from = np.array([[0, 6, 4, 2]], np.int32), np.zeros((1, 4), np.int32)
  got = select(priority, key_pos, free_from, np.array([7], np.int32), SelectParams(budget=4))
  assert int(got[2][0]) == 3 and int(got[3][0]) == 3
  np.testing.assert_array_equal(got[0], [[0, 6, 4, 7]])


@pytest.mark.parametrize('attend', [functools.partial(paged_attention_with_mass, interpret=True),
                                    paged_attention_with_mass_reference])
def test_paged_attention_refuses_page_ids_outside_the_pool(attend):
  # Ids 7 and -1 in a 3-page pool were clamped or wrapped to page 2 (arbitrary memory on a GPU).
  pool = jnp.zeros((1, 3, 2, 4))
  for bad in (7, -1):
    with pytest.raises(ValueError, match=r'page_table entries must lie in \[0, 3\)'):
      attend(jnp.ones((1, 1, 1, 4)), pool, pool, jnp.asarray([[1, bad]]),
             jnp.asarray([[0, 1, 2, 3]]), jnp.asarray([[3]]))
  with pytest.raises(ValueError, match=r'q must have 4 dimensions, got shape \(1, 1, 4\)'):
    attend(jnp.ones((1, 1, 4)), pool, pool, jnp.asarray([[1, 2]]), jnp.asarray([[0, 1, 2, 3]]),
           jnp.asarray([[3]]))


def test_attention_helpers_name_bad_windows_and_heads():
  from jaxspec.kernels import slot_causal_mask  # pylint: disable=import-outside-toplevel
  for window in (0, -2):          # an all-False mask: every output silently 0
    with pytest.raises(ValueError, match=f'window must be an int >= 1, got {window}'):
      slot_causal_mask(jnp.zeros((1, 1), jnp.int32), 4, window)
  q, no_heads = jnp.ones((1, 1, 2, 4)), jnp.ones((1, 3, 0, 4))
  with pytest.raises(ValueError, match=r'not a multiple of kv heads 0 \(>= 1\)'):
    gqa_attention(q, no_heads, no_heads, jnp.ones((1, 1, 3), bool))
