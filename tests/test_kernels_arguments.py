"""The eviction kernels' argument checks (`paged_attention_with_mass`, `select_slots`, their
references, `SelectParams` and `EvictionPolicy` bounds): wrong kinds of argument are named, and
the references match the kernels at the edges (an empty slot axis)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import make_policy
from jaxspec.kernels import (SelectParams, paged_attention_with_mass,
                             paged_attention_with_mass_reference, select_slots,
                             select_slots_reference)
from test_kernels_eviction import _paged_case


def test_no_slots_give_empty_results_from_the_kernels_and_their_references():
  # The references raised 'zero-size array to reduction operation' where the kernels returned.
  q, pages = jnp.ones((2, 1, 4, 8)), jnp.ones((2, 3, 4, 8))
  args = (q, pages, pages, jnp.zeros((2, 0), jnp.int32), jnp.zeros((2, 0), jnp.int32),
          jnp.zeros((2, 1), jnp.int32))
  for g, w in zip(paged_attention_with_mass(*args, interpret=True),
                  paged_attention_with_mass_reference(*args)):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(g, w)
  args = (jnp.zeros((2, 0)), jnp.zeros((2, 0), jnp.int32), jnp.zeros((2, 0), jnp.int32),
          jnp.array([3, 4], jnp.int32), SelectParams(budget=3))
  for g, w in zip(select_slots(*args, interpret=True), select_slots_reference(*args)):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(g, w)


def test_kernel_arguments_of_the_wrong_kind_are_named():
  # An int q gave int outputs (attention truncated); interpret='yes' ran as True; a list, a
  # params dict or block_sizes=None were AttributeErrors or tracer errors from inside.
  args = _paged_case(0, batch=1, t=1, kv_heads=2, group=2, head_dim=8, page_size=4,
                     pages_per_seq=2, length=5, shuffled=False)
  for index, value, needle in ((0, args[0].astype(jnp.int32), 'q must be a float array'),
                               (5, args[5].tolist(), 'q_pos must be an array, got list')):
    bad = list(args)
    bad[index] = value
    with pytest.raises(ValueError, match=needle):
      paged_attention_with_mass(*bad, interpret=True)
  with pytest.raises(ValueError, match="interpret must be True or False, got 'yes'"):
    paged_attention_with_mass(*args, interpret='yes')
  with pytest.raises(ValueError, match='block_sizes must be a BlockSizes, got None'):
    paged_attention_with_mass(*args, None, interpret=True)
  rows = (jnp.zeros((1, 4)), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32),
          jnp.array([2], jnp.int32))
  for call, kwargs, needle in (
      (select_slots, dict(params={'budget': 3}, interpret=True), 'params must be a SelectParams'),
      (select_slots_reference, dict(params={'budget': 3}), 'params must be a SelectParams'),
      (select_slots, dict(params=SelectParams(3), interpret=1), 'interpret must be True or'),
  ):
    with pytest.raises(ValueError, match=needle):
      call(*rows, **kwargs)
  with pytest.raises(ValueError, match='positions must be an array, got list'):
    select_slots(*rows[:3], [2], SelectParams(3), interpret=True)
  with pytest.raises(ValueError, match='key_pos must be an integer array, got dtype float32'):
    select_slots(rows[0], rows[0], rows[2], rows[3], SelectParams(3), interpret=True)


@pytest.mark.parametrize('make, needle', [
    (lambda: SelectParams(2 ** 40), r'SelectParams.budget=1099511627776 exceeds the int32'),
    (lambda: SelectParams(4, 0, 0, 2 ** 31), r'SelectParams.reuse_delay=2147483648 exceeds'),
    (lambda: make_policy('h2o', 10 ** 20), r"eviction policy 'h2o': .* add up past int32"),
    (lambda: make_policy('h2o', 2 ** 31 - 1, reuse_delay=1), 'add up past int32'),
])
def test_budgets_and_delays_past_int32_are_named(make, needle):
  # They passed, then overflowed in the jitted selection (a raw OverflowError).
  with pytest.raises(ValueError, match=needle):
    make()
