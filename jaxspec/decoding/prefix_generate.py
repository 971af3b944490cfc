"""Generation over a persistent paged pool with automatic prefix caching (and an optional host
tier): each request prefills only the tokens after its longest cached prefix.

One request at a time, as an agent loop issues them; the pool, the prefix index and the host tier
live across calls. Device steps are the ones `generate` uses (`prefill` from a starting length,
then the compiled autoregressive or speculative loop), so outputs match recomputing everything.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import numpy as np

from jaxspec.cache import NULL_PAGE, pages_needed
from jaxspec.cache import host as host_lib
from jaxspec.cache.prefix import PrefixCache
from jaxspec.checks import check_int, seed_key
from jaxspec.decoding.generate import MAX_K, GenerationResult, check_request, decode
from jaxspec.decoding.output import check_valid
from jaxspec.decoding.sampling import SamplingParams, check_sampling
from jaxspec.decoding.steps import LOCAL_STEPS
from jaxspec.models import ModelConfig, check_params


class PrefixCachedGenerator:
  """Generates one request at a time; requests share cached prefix pages.

  Target and draft (when speculating) use one page table over two pools of the same size, so a
  prefix page holds both models' keys/values and hits for both.

  Args:
    target, target_params: the target model.
    num_pages: device pool size P in pages of `page_size` tokens (page 0 is the null page).
    page_size: L.
    host_pages: host-tier capacity in pages (0: none).
    prefix_caching: False recomputes every prompt (the baseline), through the same code.
    draft, draft_params, k: optional draft model and speculation length K.
    sampling: sampling parameters of every request.
    prompt_bucket: new-token counts are padded to a multiple of this (one compile per bucket;
      the padding stops at the context).
    steps: where the device calls run: `LOCAL_STEPS`, or a `jaxspec.parallel.ShardedSteps`
      (target and its pages sharded over a mesh's 'model' axis, draft replicated; the mesh's
      'data' axis must be 1, since requests run one at a time).
  Raises:
    ValueError: bad K, mismatched vocabularies, a bad size, sampling that is not a
      SamplingParams, host_pages > 0 with prefix_caching False, a mesh whose 'data' axis is
      not 1, pools past the device's memory, a full host tier past the machine's. A pool too
      small for a request is reported by `generate` (OutOfPagesError), for that request.
    CheckpointError: target_params (draft_params) that are not the config's params (named).
  """

  def __init__(self, target: ModelConfig, target_params, *, num_pages: int, page_size: int = 16,
               host_pages: int = 0, prefix_caching: bool = True,
               draft: Optional[ModelConfig] = None, draft_params=None, k: Optional[int] = None,
               max_k: int = MAX_K, sampling: SamplingParams = SamplingParams(),
               prompt_bucket: int = 64, steps=LOCAL_STEPS):
    check_request(target, [[0]], max_new_tokens=1, draft=draft, draft_params=draft_params, k=k,
                  max_k=max_k)
    prompt_bucket = check_int('prompt_bucket', prompt_bucket, 1)
    num_pages, page_size, host_pages, prefix_caching = PrefixCache.check_args(
        num_pages, page_size, host_pages, prefix_caching)
    check_sampling(sampling)
    check_params(target, target_params, 'target_params')
    if draft is not None:
      check_params(draft, draft_params, 'draft_params')
    k = None if k is None else int(k)          # checked by check_request
    mesh = getattr(steps, 'mesh', None)    # 'data': jaxspec.parallel.mesh.DATA (which imports us)
    if mesh is not None and dict(mesh.shape).get('data', 1) != 1:
      raise ValueError(f"PrefixCachedGenerator runs one request at a time: its mesh's 'data' "
                       f"axis must be 1, got data={mesh.shape['data']} (split the target over "
                       "'model' instead)")
    self.target, self.target_params = target, target_params
    self.draft, self.draft_params, self.k, self.max_k = draft, draft_params, k, max_k
    self.sampling, self.prompt_bucket, self.steps = sampling, prompt_bucket, steps
    self.pages_per_seq = pages_needed(target.max_seq_len, page_size)
    table = np.zeros((1, self.pages_per_seq), np.int32)
    self.caches = [steps.new_cache(target, table, num_pages, page_size)]   # checks they fit
    if draft is not None:
      self.caches.append(steps.new_cache(draft, table, num_pages, page_size, draft=True))
    if host_pages:
      host_lib.check_host_fits(host_pages, self.caches)
    # After the pools are known to fit: its free list holds every page.
    self.prefix = PrefixCache(num_pages, page_size, host_pages, enabled=prefix_caching)
    self.peak_device_pages = 0

  @property
  def page_size(self) -> int:
    return self.prefix.page_size

  @property
  def device_pages_used(self) -> int:
    """Pool pages not on the free list (held by a request or cached)."""
    return self.prefix.num_pages - 1 - self.prefix.num_free

  @property
  def host_pages_used(self) -> int:
    return len(self.prefix.host) if self.prefix.host is not None else 0

  def warm_up(self, max_prompt_len: int, max_new_tokens: int, stop_tokens=()) -> None:
    """Compile everything a run up to `max_prompt_len` prompt tokens can meet: prefill at every
    prompt bucket, the decode loop (for `max_new_tokens` and as many stop tokens as
    `stop_tokens`: pass the run's own), and the host-tier copies; then forget the dummy prompts,
    and with them every prefix cached before (call it before serving, not between requests).

    Raises:
      ValueError: max_prompt_len or max_new_tokens not an int >= 1.
      ValueError / OutOfPagesError: as `generate` for the longest dummy prompt (tried first).
    """
    max_prompt_len = check_int('max_prompt_len', max_prompt_len, 1)
    max_new_tokens = check_int('max_new_tokens', max_new_tokens, 1)
    widths = range(self.prompt_bucket, max_prompt_len + self.prompt_bucket, self.prompt_bucket)
    for width in reversed(widths):             # the longest first: its errors before any compile
      n = min(width, max_prompt_len)
      vocab = self.target.vocab_size         # dummy ids inside any vocabulary
      self.generate([(3 + i % 50) % vocab for i in range(n)], max_new_tokens=max_new_tokens,
                    stop_tokens=stop_tokens)
      self.reset_prefix_cache()
    if self.prefix.host is not None:
      self.caches = host_lib.warm_up_copies(self.caches, self.pages_per_seq)
    self.peak_device_pages = 0
    self.prefix.stats.clear()

  def reset_prefix_cache(self) -> None:
    """Invalidate every cached prefix, on the device and in the host tier."""
    self.prefix.reset()

  def generate(self, prompt: Sequence[int], *, max_new_tokens: int, stop_tokens=(),
               salt: bytes | str = b'', seed: int = 0) -> GenerationResult:
    """Continue one prompt, reusing any cached prefix of it.

    Args:
      prompt: token ids (>= 1).
      max_new_tokens: tokens to emit at most, the first included.
      stop_tokens: ids that end the request (emitted).
      salt: cache salt; requests of different salts never share pages.
      seed: PRNG seed (same seed, same prompt: the same tokens hit or not, up to floating-point
        near-ties: cached keys/values equal recomputed ones to ~1e-5).
    Returns:
      GenerationResult with one row; ttft_s runs from after validation to the first token:
      hashing and matching, host-tier copies, prefill (target and draft) and the first sample.
    Raises:
      ValueError: as `generate` (a seed that is not a 64-bit int too); OutOfPagesError when
        the pool cannot hold the request even after reclaiming every cached page (the pool is
        unchanged then); NonFiniteLogitsError as `generate` (nothing of it is cached then).
    """
    _, slack, stop = check_request(self.target, [prompt], max_new_tokens=max_new_tokens,
                                   stop_tokens=stop_tokens, draft=self.draft,
                                   draft_params=self.draft_params, k=self.k, max_k=self.max_k,
                                   one_request=True)
    prompt, max_new_tokens = [int(t) for t in prompt], int(max_new_tokens)
    rng_prefill, rng_decode = jax.random.split(seed_key(seed))
    rng_prefill, rng_decode, stop = map(self.steps.put_replicated,
                                        (rng_prefill, rng_decode, stop))
    start = time.perf_counter()
    request, plan = self.prefix.admit(prompt, reserve=len(prompt) + max_new_tokens + slack,
                                      salt=salt)
    try:
      self.caches = self.prefix.apply(plan, self.caches)
      self.peak_device_pages = max(self.peak_device_pages, self.device_pages_used)
      table = np.full((1, self.pages_per_seq), NULL_PAGE, np.int32)
      table[0, :len(request.pages)] = request.pages
      start_len = np.full((1,), request.num_cached, np.int32)
      # One device copy per cache: the prefill of one donates its page table and lengths.
      put = self.steps.put_batch
      self.caches = [c.replace(page_table=put(table), lengths=put(start_len))
                     for c in self.caches]
      new = prompt[request.num_cached:]
      width = -(-len(new) // self.prompt_bucket) * self.prompt_bucket
      context = min(m.max_seq_len for m in (self.target, self.draft) if m is not None)
      width = min(width, context - request.num_cached)       # the padding stays in the context
      tokens = np.zeros((1, width), np.int32)
      tokens[0, :len(new)] = new
      tokens, lengths = put(tokens), put(np.full((1,), len(new), np.int32))
      first, cache = self.steps.prefill(self.target, self.target_params, self.caches[0], tokens,
                                        lengths, rng_prefill, sampling=self.sampling)
      draft_cache = None
      if self.draft is not None:
        _, draft_cache = self.steps.prefill(self.draft, self.draft_params, self.caches[1],
                                            tokens, lengths, rng_prefill, sampling=self.sampling)
        jax.block_until_ready(draft_cache)
      self.caches = [cache] if draft_cache is None else [cache, draft_cache]  # donated above
      first = jax.block_until_ready(first)
      ttft = time.perf_counter() - start

      start = time.perf_counter()
      out, counters, cache, draft_cache = decode(
          self.target, self.target_params, cache, first, rng_decode, stop,
          sampling=self.sampling, max_new_tokens=max_new_tokens, draft=self.draft,
          draft_params=self.draft_params, draft_cache=draft_cache, k=self.k, steps=self.steps)
      out = jax.block_until_ready(out)
      decode_s = time.perf_counter() - start
      self.caches = [cache] if draft_cache is None else [cache, draft_cache]
      emitted = np.asarray(out.tokens)[0, :int(out.num_tokens[0])].tolist()
      check_valid([emitted])      # before commit: NaN keys/values are never shared
      in_cache = min(int(c.lengths[0]) for c in self.caches)
      self.prefix.commit(request, (prompt + emitted)[:in_cache])
    finally:
      self.prefix.finish(request)
    return GenerationResult(tokens=[emitted], ttft_s=ttft, decode_s=decode_s,
                            prompt_tokens=len(prompt), prefill_tokens=len(new),
                            cached_tokens=request.num_cached,
                            promoted_tokens=request.num_promoted, **counters)
