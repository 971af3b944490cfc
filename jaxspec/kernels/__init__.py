"""Array functions for attention and eviction: pure-jnp references (and Pallas kernels)."""

from jaxspec.kernels.attention import gqa_attention, slot_causal_mask

__all__ = ['gqa_attention', 'slot_causal_mask']
