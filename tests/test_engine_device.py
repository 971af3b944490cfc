"""The host side of the engine's device calls (`jaxspec.engine.device`): `bind` hands each cache
the call's page table and lengths as int32 host arrays (the jitted call copies them), and `fetch`
reads a call's results back as numpy, None kept, on either path (CPU or accelerator)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import device
from jaxspec.models import cache_for


def test_bind_gives_each_cache_the_tables_as_int32_host_arrays(tiny):
  config, _ = tiny
  cache = cache_for(config, jnp.zeros((2, 2), jnp.int32), num_pages=8, page_size=8)
  table = np.array([[1, 2], [3, 0]], np.int64)            # any int dtype in, int32 out
  lengths = [5, 0]
  bound = device.bind([cache, None, cache], table, lengths)
  assert bound[1] is None
  for c in (bound[0], bound[2]):
    assert isinstance(c.page_table, np.ndarray) and c.page_table.dtype == np.int32
    assert isinstance(c.lengths, np.ndarray) and c.lengths.dtype == np.int32
    np.testing.assert_array_equal(c.page_table, table)
    np.testing.assert_array_equal(c.lengths, lengths)
    assert c.k_pages is cache.k_pages                     # the pools themselves are not copied


@pytest.mark.parametrize('cpu', [True, False])
def test_fetch_reads_results_back_as_numpy_and_keeps_none(monkeypatch, cpu):
  monkeypatch.setattr(device, '_cpu_backend', lambda: cpu)   # False: the jax.device_get path
  window = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  p = jnp.array([0.25, 1.0], jnp.float32)
  got = device.fetch((window, None, p))
  assert isinstance(got, tuple) and len(got) == 3 and got[1] is None
  assert all(isinstance(a, np.ndarray) for a in (got[0], got[2]))
  np.testing.assert_array_equal(got[0], np.arange(6).reshape(2, 3))
  assert got[0].dtype == np.int32 and got[2].dtype == np.float32
  np.testing.assert_array_equal(got[2], [0.25, 1.0])
