"""The big model's side of an agent session: prefill each turn's context and draw the first
token, measuring context tokens, tokens prefilled, TTFT and KV bytes.

Pages come from a `jaxspec.cache.PrefixCache` over a fixed pool (vLLM's automatic prefix
caching: SHA-256-chained full pages, LRU of finished requests' pages). With `prefix_cache=True`
a turn prefills only what follows the longest cached prefix: the full pages it shares with the
previous turn's context, or with any earlier context on the same pool (the stable prompt prefix
of every session); with False the same code path recomputes everything. The page table is cut to
a multiple of `width_step` pages: attention reads the whole table, so a short context must not
pay for the longest one, and only a few widths are ever compiled.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import NULL_PAGE, PagedKVCache, PrefixCache, pages_needed
from jaxspec.checks import check_int, is_int_in, token_ids
from jaxspec.decoding.constrained import prefill_chunked
from jaxspec.decoding.output import check_valid
from jaxspec.decoding.sampling import SamplingParams, probabilities, sample
from jaxspec.models import ModelConfig, cache_for


@jax.jit
def _greedy_token(logits):
  """[1, V] logits -> [1] int32 argmax, through `probabilities` so that NaN or +inf logits draw
  INVALID_TOKEN instead of token 0 (compiled: eager, it added ~1 ms to each TTFT at V = 32000)."""
  return sample(jax.random.PRNGKey(0), probabilities(logits, SamplingParams()))


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


class ContextSession:
  """The big model's KV cache across the turns of one agent session.

  Args:
    config, params: the big model.
    max_tokens: the longest context any turn will have (sizes the page pool).
    width_step: page-table widths are multiples of this many pages.
    prefix_cache: reuse cached pages (a prefix cache's hits); False recomputes every context.
  Raises:
    ValueError: max_tokens not an int in [1, the model's max_seq_len], page_size or width_step
      not an int >= 1, prefix_cache not a bool; from `prefill`: a context longer than
      max_tokens, empty, or with a token id that is not an int in [0, V), commit not a bool.
  """

  def __init__(self, config: ModelConfig, params, *, max_tokens: int, page_size: int = 16,
               prefix_cache: bool = False, width_step: int = 16):
    width_step = check_int('width_step', width_step, 1)
    page_size = check_int('page_size', page_size, 1)
    if not isinstance(prefix_cache, (bool, np.bool_)):   # PrefixCache would name prefix_caching
      raise ValueError(f'prefix_cache must be True or False, got {prefix_cache!r}')
    if not is_int_in(max_tokens, 1, config.max_seq_len):
      raise ValueError(f'max_tokens must be an int in [1, max_seq_len={config.max_seq_len}], '
                       f'got {max_tokens!r}')
    max_tokens = self.max_tokens = int(max_tokens)
    self.config, self.params, self.page_size = config, params, page_size
    self.prefix_cache = prefix_cache
    self.width_step = width_step
    self.max_width = self._width(pages_needed(max_tokens, page_size))
    self.prefix = PrefixCache(self.max_width + 1, page_size, enabled=prefix_cache)
    pool = cache_for(config, np.zeros((1, 1), np.int32), self.max_width + 1, page_size)
    self._k, self._v = pool.k_pages, pool.v_pages
    self.page_bytes = (2 * config.num_layers * config.num_kv_heads * page_size * config.head_dim
                       * jnp.dtype(config.dtype).itemsize)

  def _width(self, pages: int) -> int:
    return max(1, -(-pages // self.width_step)) * self.width_step

  def _cache(self, pages: list, cached: int) -> PagedKVCache:
    table = np.zeros((1, self._width(len(pages))), np.int32)      # NULL_PAGE past the context
    table[0, :len(pages)] = pages
    return PagedKVCache(self._k, self._v, jnp.asarray(table), jnp.array([cached], jnp.int32))

  def warmup(self) -> None:
    """Compile the prefill for every page-table width this session can use."""
    for width in range(self.width_step, self.max_width + 1, self.width_step):
      cache = self._cache([NULL_PAGE] * width, 0)    # writes only the null page
      logits, cache = prefill_chunked(self.config, self.params, cache, [0])
      jax.block_until_ready(_greedy_token(logits[:1]))
      self._k, self._v = cache.k_pages, cache.v_pages

  def prefill(self, tokens: Sequence[int], commit: bool = True) -> TurnCost:
    """Make `tokens` a context of the session (greedy first token), prefilling what the prefix
    cache does not hold. commit=False registers none of its pages (for repeated timings of the
    same context; taking its pages may still reclaim other contexts' least recently used ones).

    Raises:
      ValueError: an empty context, one longer than the session's max_tokens, a token id that
        is not an int in [0, V). NonFiniteLogitsError: the model's logits were NaN or +inf (its
        pages are not registered). A failure after the pages were taken gives them back.
    """
    if not isinstance(commit, (bool, np.bool_)):   # 'no' is truthy: it would commit
      raise ValueError(f'commit must be True or False, got {commit!r}')
    tokens = token_ids(tokens, 'context', self.config.vocab_size)
    if not tokens:
      raise ValueError('empty context')
    if len(tokens) > self.max_tokens:
      raise ValueError(f'context of {len(tokens)} tokens exceeds the session\'s '
                       f'max_tokens={self.max_tokens}')
    start = time.perf_counter()
    request, plan = self.prefix.admit(tokens)
    try:
      self.prefix.apply(plan, [])                     # no host tier: nothing to move
      cached = request.num_cached
      logits, cache = prefill_chunked(self.config, self.params,
                                      self._cache(request.pages, cached), tokens[cached:])
      self._k, self._v = cache.k_pages, cache.v_pages
      first = int(_greedy_token(logits[:1])[0])
      check_valid([[first]], 'context')            # before its pages are shared
      ttft = time.perf_counter() - start
      if commit:
        self.prefix.commit(request, tokens)
    finally:
      self.prefix.finish(request)
    return TurnCost(context_tokens=len(tokens), prefill_tokens=len(tokens) - cached,
                    cached_tokens=cached, ttft_s=ttft,
                    kv_bytes=len(request.pages) * self.page_bytes,
                    first_token=first, logits=np.asarray(logits[0]))
