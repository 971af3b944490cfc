"""The device-side calls `generate` makes, gathered in one object so that another placement can
stand in for them: `LocalSteps` runs on the default device, `jaxspec.parallel.ShardedSteps`
on a device mesh (sharded target, replicated draft) with the same signatures."""

from __future__ import annotations

import jax.numpy as jnp

from jaxspec.decoding.autoregressive import decode_autoregressive, prefill
from jaxspec.decoding.speculative import decode_speculative
from jaxspec.models import ModelConfig, cache_for


class LocalSteps:
  """One device: host arrays become default-device arrays, the jitted steps run as defined."""

  put_batch = staticmethod(jnp.asarray)        # [B, ...] host array -> device
  put_replicated = staticmethod(jnp.asarray)   # PRNG keys, stop tokens -> device
  prefill = staticmethod(prefill)
  decode_autoregressive = staticmethod(decode_autoregressive)
  decode_speculative = staticmethod(decode_speculative)

  @staticmethod
  def new_cache(config: ModelConfig, page_table, num_pages: int, page_size: int, *,
                draft: bool = False):
    """An empty cache for `config` (`draft` only matters to placements that treat it apart)."""
    del draft
    return cache_for(config, page_table, num_pages, page_size)


LOCAL_STEPS = LocalSteps()
