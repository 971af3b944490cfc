"""Array functions for attention and eviction: pure-jnp references (and Pallas kernels)."""

from jaxspec.kernels.attention import gqa_attention, gqa_attention_per_query, slot_causal_mask
from jaxspec.kernels.evict_select import SelectParams, select_slots, select_slots_reference
from jaxspec.kernels.paged_attention import (BlockSizes, attention_with_mass,
                                             paged_attention_with_mass,
                                             paged_attention_with_mass_reference)

__all__ = ['BlockSizes', 'SelectParams', 'attention_with_mass', 'gqa_attention',
           'gqa_attention_per_query', 'paged_attention_with_mass',
           'paged_attention_with_mass_reference', 'select_slots', 'select_slots_reference',
           'slot_causal_mask']
