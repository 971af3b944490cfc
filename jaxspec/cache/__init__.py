"""Paged KV cache: device-side pytree and pure functions, host-side page allocation."""

from jaxspec.cache.allocator import OutOfPagesError, PageAllocator
from jaxspec.cache.paged import (NULL_PAGE, PagedKVCache, gather_kv, init_cache, pages_needed,
                                 rollback, slot_address, write_kv)

__all__ = ['NULL_PAGE', 'OutOfPagesError', 'PageAllocator', 'PagedKVCache', 'gather_kv',
           'init_cache', 'pages_needed', 'rollback', 'slot_address', 'write_kv']
