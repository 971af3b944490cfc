"""Array functions for attention and eviction: pure-jnp references (and Pallas kernels)."""

from jaxspec.kernels.attention import gqa_attention, gqa_attention_per_query, slot_causal_mask

__all__ = ['gqa_attention', 'gqa_attention_per_query', 'slot_causal_mask']
