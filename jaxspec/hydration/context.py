"""The big model's side of an agent session: prefill each turn's context and draw the first
token, measuring context tokens, tokens prefilled, TTFT and KV bytes.

One session is one sequence over a fixed page pool (logical page i lives in pool page i + 1;
page 0 is the null page), so growing contexts never copy the cache. The page table is cut to a
multiple of `width_step` pages: attention reads the whole table, so a short context must not
pay for the longest one, and only a few widths are ever compiled.

With `prefix_cache=True` a turn prefills only what follows the full pages it shares with the
previous turn's context, which the session still holds: the pages a prefix cache
(`jaxspec.cache.prefix.PrefixCache`, vLLM / SGLang) would hit for this one session, computed by
`cached_prefix`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import PagedKVCache, pages_needed
from jaxspec.decoding.constrained import prefill_chunked
from jaxspec.models import ModelConfig, cache_for


@dataclasses.dataclass
class TurnCost:
  """One turn of the big model. Tokens are counts; kv_bytes the K+V bytes of the pages that
  hold the context (page granularity); ttft_s the seconds to prefill and draw the first (greedy)
  token; logits: [V] float32 after the last context token."""

  context_tokens: int
  prefill_tokens: int
  cached_tokens: int
  ttft_s: float
  kv_bytes: int
  first_token: int
  logits: np.ndarray


def cached_prefix(previous: Sequence[int], tokens: Sequence[int], page_size: int) -> int:
  """Tokens of `tokens` a prefix cache holding `previous` serves: the full pages of their common
  prefix, at most (len(tokens) - 1) // page_size pages (the last token is always computed)."""
  n = 0
  for a, b in zip(previous, tokens):
    if a != b:
      break
    n += 1
  return min(n // page_size, (len(tokens) - 1) // page_size) * page_size


class ContextSession:
  """The big model's KV cache across the turns of one agent session.

  Args:
    config, params: the big model.
    max_tokens: the longest context any turn will have (sizes the page pool).
    width_step: page-table widths are multiples of this many pages.
    prefix_cache: reuse the pages shared with the previous turn's context.
  Raises:
    ValueError (from `prefill`): a context longer than max_tokens or empty.
  """

  def __init__(self, config: ModelConfig, params, *, max_tokens: int, page_size: int = 16,
               prefix_cache: bool = False, width_step: int = 16):
    if width_step < 1:
      raise ValueError(f'width_step must be >= 1, got {width_step}')
    self.config, self.params, self.page_size = config, params, page_size
    self.prefix_cache = prefix_cache
    self.width_step = width_step
    self.max_width = self._width(pages_needed(max_tokens, page_size))
    pool = cache_for(config, np.zeros((1, 1), np.int32), self.max_width + 1, page_size)
    self._k, self._v = pool.k_pages, pool.v_pages
    self.tokens: list[int] = []
    self.page_bytes = (2 * config.num_layers * config.num_kv_heads * page_size * config.head_dim
                       * jnp.dtype(config.dtype).itemsize)

  def _width(self, pages: int) -> int:
    return max(1, -(-pages // self.width_step)) * self.width_step

  def _cache(self, num_tokens: int, cached: int) -> PagedKVCache:
    width = self._width(pages_needed(num_tokens, self.page_size))
    if width > self.max_width:
      raise ValueError(f'context of {num_tokens} tokens exceeds the session pool '
                       f'({self.max_width * self.page_size} tokens)')
    table = np.zeros((1, width), np.int32)
    used = pages_needed(num_tokens, self.page_size)
    table[0, :used] = np.arange(1, used + 1)
    return PagedKVCache(self._k, self._v, jnp.asarray(table), jnp.array([cached], jnp.int32))

  def warmup(self) -> None:
    """Compile the prefill for every page-table width this session can use."""
    for width in range(self.width_step, self.max_width + 1, self.width_step):
      cache = self._cache(width * self.page_size, 0)
      logits, cache = prefill_chunked(self.config, self.params, cache, [0])
      jax.block_until_ready(logits)
      self._k, self._v = cache.k_pages, cache.v_pages
    self.tokens = []

  def prefill(self, tokens: Sequence[int]) -> TurnCost:
    """Make `tokens` the session's context (greedy first token), reusing cached pages if on."""
    tokens = [int(t) for t in tokens]
    if not tokens:
      raise ValueError('empty context')
    cached = cached_prefix(self.tokens, tokens, self.page_size) if self.prefix_cache else 0
    cache = self._cache(len(tokens), cached)
    start = time.perf_counter()
    logits, cache = prefill_chunked(self.config, self.params, cache, tokens[cached:])
    first = int(jnp.argmax(logits[0]))
    ttft = time.perf_counter() - start
    self._k, self._v = cache.k_pages, cache.v_pages
    self.tokens = tokens
    return TurnCost(context_tokens=len(tokens), prefill_tokens=len(tokens) - cached,
                    cached_tokens=cached, ttft_s=ttft,
                    kv_bytes=pages_needed(len(tokens), self.page_size) * self.page_bytes,
                    first_token=first, logits=np.asarray(logits[0]))
