"""Contract 1: greedy speculative decoding returns exactly the greedy target tokens."""

import numpy as np
import pytest

from jaxspec.decoding import generate


def _prompts(lengths, seed=0, vocab=64):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


# page_size 8: lengths just before, on and just after a page boundary.
@pytest.mark.parametrize('lengths', [[7], [8], [9], [15, 16, 17, 24]])
@pytest.mark.parametrize('k', [1, 2, 4, 8])
def test_greedy_speculative_equals_autoregressive(tiny, tiny_draft, lengths, k):
  (tc, tp), (dc, dp) = tiny, tiny_draft
  prompts = _prompts(lengths, seed=len(lengths) * 100 + lengths[0])
  ar = generate(tc, tp, prompts, max_new_tokens=33, page_size=8)
  sp = generate(tc, tp, prompts, max_new_tokens=33, page_size=8, draft=dc, draft_params=dp, k=k)
  assert sp.tokens == ar.tokens
  assert all(len(t) == 33 for t in sp.tokens)
  # The draft agrees only partly, so both the accept and the reject paths were taken.
  assert 0.0 < sp.acceptance_rate < 1.0


def test_stop_token_inside_accepted_run_ends_output(tiny):
  tc, tp = tiny
  prompts = _prompts([12, 21])
  ar_free = generate(tc, tp, prompts, max_new_tokens=40, page_size=8)
  # A stop token the target emits at index 5 of row 0: with the target as its own draft every
  # proposal is accepted, so with K = 8 the stop token sits inside an accepted run.
  stop = ar_free.tokens[0][5]
  ar = generate(tc, tp, prompts, max_new_tokens=40, page_size=8, stop_tokens=[stop])
  sp = generate(tc, tp, prompts, max_new_tokens=40, page_size=8, stop_tokens=[stop], draft=tc,
                draft_params=tp, k=8)
  assert sp.tokens == ar.tokens
  first = ar_free.tokens[0].index(stop)
  assert sp.tokens[0] == ar_free.tokens[0][:first + 1]          # ends at (and includes) the stop
  # Counters count only what was emitted: every proposal was accepted, and nothing past the
  # stop token or max_new_tokens was counted.
  assert sp.emitted == sum(len(t) - 1 for t in sp.tokens)
  assert sp.accepted <= sp.emitted


def test_max_new_tokens_cuts_an_accepted_run(tiny):
  tc, tp = tiny
  prompts = _prompts([10])
  ar = generate(tc, tp, prompts, max_new_tokens=6, page_size=8)
  sp = generate(tc, tp, prompts, max_new_tokens=6, page_size=8, draft=tc, draft_params=tp, k=8)
  assert sp.tokens == ar.tokens and len(sp.tokens[0]) == 6
  assert sp.emitted == 5 and sp.accepted == 5 and sp.target_calls == 1
  # The 3 proposals past max_new_tokens were out of reach: not counted as proposed.
  assert sp.proposed == 5 and sp.acceptance_rate == 1.0
  # The stop-token cut, likewise: a draft equal to the target reads α = 1.
  stop = ar.tokens[0][3]
  cut = generate(tc, tp, prompts, max_new_tokens=6, page_size=8, stop_tokens=[stop], draft=tc,
                 draft_params=tp, k=8)
  assert cut.proposed == cut.accepted == 3 and cut.acceptance_rate == 1.0


@pytest.mark.parametrize('n, emitted, expected', [
    (8, 9, 8),      # all accepted + bonus: K proposed
    (2, 3, 8),      # a rejection reached: K proposed (those after it count as not accepted)
    (8, 5, 5),      # cut inside an accepted run: only the emitted ones were in reach
    (3, 3, 3),      # cut at the rejected position: the 3 accepted were all that was in reach
    (0, 1, 8),      # first proposal rejected
])
def test_proposals_in_reach(n, emitted, expected):
  from jaxspec.decoding.speculative import proposals_in_reach
  assert proposals_in_reach(8, n, emitted) == expected
  arrays = proposals_in_reach(np.int32(8), np.array([n, n]), np.array([emitted, emitted]))
  assert arrays.tolist() == [expected, expected]


def test_self_draft_accepts_everything(tiny):
  tc, tp = tiny
  sp = generate(tc, tp, _prompts([9, 13]), max_new_tokens=30, page_size=8, draft=tc,
                draft_params=tp, k=4)
  assert sp.acceptance_rate == 1.0
  assert sp.mean_accepted_length > 4.0


def test_decode_loops_compile_once_per_shape(tiny, tiny_draft):
  from jaxspec.decoding import decode_speculative, prefill
  (tc, tp), (dc, dp) = tiny, tiny_draft
  kwargs = dict(max_new_tokens=12, page_size=8, draft=dc, draft_params=dp, k=3)
  generate(tc, tp, _prompts([10, 20]), **kwargs)
  sizes = [f._cache_size() for f in (prefill, decode_speculative)]
  # Other prompts of other lengths in the same bucket, another seed: no recompilation.
  generate(tc, tp, _prompts([5, 33], seed=7), seed=3, **kwargs)
  assert [f._cache_size() for f in (prefill, decode_speculative)] == sizes


def test_speculative_loop_consumes_both_donated_caches(tiny, tiny_draft):
  import jax
  import jax.numpy as jnp
  from jaxspec.cache import PageAllocator
  from jaxspec.decoding import SamplingParams, decode_speculative, prefill
  from jaxspec.models import cache_for
  (tc, tp), (dc, dp) = tiny, tiny_draft
  alloc = PageAllocator(2 * 4 + 1)
  table = np.array([alloc.allocate(4) for _ in range(2)])
  tokens, lengths = jnp.ones((2, 8), jnp.int32), jnp.array([8, 3], jnp.int32)
  caches = []
  for config, params in ((tc, tp), (dc, dp)):
    first, cache = prefill(config, params, cache_for(config, table, alloc.num_pages, 8), tokens,
                           lengths, jax.random.PRNGKey(0), sampling=SamplingParams())
    caches.append(cache)
  old = [c.k_pages for c in caches]
  out, _, target_cache, draft_cache = decode_speculative(
      tc, dc, tp, dp, caches[0], caches[1], first, jax.random.PRNGKey(1),
      jnp.zeros((0,), jnp.int32), k=3, sampling=SamplingParams(), max_new_tokens=10)
  assert all(buf.is_deleted() for buf in old)             # updated in place, not copied
  assert not target_cache.k_pages.is_deleted() and out.num_tokens.tolist() == [10, 10]
