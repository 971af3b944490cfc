"""Paged KV cache: device-side pytree and pure functions, host-side page allocation."""

from jaxspec.cache.allocator import OutOfPagesError, PageAllocator
from jaxspec.cache.paged import (NULL_PAGE, PagedKVCache, gather_kv, init_cache, pages_needed,
                                 rollback, slot_address, write_kv)
from jaxspec.cache.eviction import (POLICIES, EvictionPolicy, EvictionState, after_tokens,
                                    init_eviction, last_token, make_policy)

__all__ = ['NULL_PAGE', 'OutOfPagesError', 'PageAllocator', 'PagedKVCache', 'gather_kv',
           'init_cache', 'pages_needed', 'rollback', 'slot_address', 'write_kv',
           'POLICIES', 'EvictionPolicy', 'EvictionState', 'after_tokens', 'init_eviction',
           'last_token', 'make_policy']
