"""Paged KV cache: device-side pytree and pure functions; host-side page allocation, prefix
caching (hash-chained full pages, LRU) and the host-memory tier; eviction policies."""

from jaxspec.cache.allocator import OutOfPagesError, PageAllocator
from jaxspec.cache.host import HostTier, read_pages, write_pages
from jaxspec.cache.paged import (NULL_PAGE, PagedKVCache, gather_kv, init_cache, pages_needed,
                                 rollback, slot_address, write_keys_values, write_kv)
from jaxspec.cache.eviction import (POLICIES, EvictionPolicy, EvictionState, after_tokens,
                                    init_eviction, last_token, make_policy)
from jaxspec.cache.page_hash import page_keys
from jaxspec.cache.plan import Plan, Request
from jaxspec.cache.prefix import PrefixCache

__all__ = ['NULL_PAGE', 'HostTier', 'OutOfPagesError', 'PageAllocator', 'PagedKVCache', 'Plan',
           'PrefixCache', 'Request', 'gather_kv', 'init_cache', 'page_keys', 'pages_needed',
           'read_pages', 'rollback', 'slot_address', 'write_keys_values', 'write_kv', 'write_pages',
           'POLICIES', 'EvictionPolicy', 'EvictionState', 'after_tokens', 'init_eviction',
           'last_token', 'make_policy']
