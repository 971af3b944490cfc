"""jaxspec: speculative decoding, paged KV caches and eviction for memory-bound LLM inference in
JAX."""
