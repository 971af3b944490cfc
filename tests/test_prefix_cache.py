"""Prefix caching: hits equal recomputation, accounting never leaks (with and without a host
tier), salts isolate, out-of-pages leaves the pool untouched. The host tier's copies:
test_prefix_host.py."""

import copy

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import NULL_PAGE, OutOfPagesError, PrefixCache, init_cache, page_keys
from jaxspec.decoding import PrefixCachedGenerator, generate
from jaxspec.models import Transformer, cache_for

L = 8  # page size of these tests


def run_prompt(config, params, prefix, request, caches, pages_per_seq=8):
  """Prefill request's uncached tokens through the model; returns (logits [n_new, V], cache)."""
  table = np.full((1, pages_per_seq), NULL_PAGE, np.int32)
  table[0, :len(request.pages)] = request.pages
  cache = caches[0].replace(page_table=jnp.asarray(table),
                            lengths=jnp.full((1,), request.num_cached, jnp.int32))
  new = request.tokens[request.num_cached:]
  positions = jnp.arange(request.num_cached, len(request.tokens), dtype=jnp.int32)[None]
  logits, cache = Transformer(config).apply(params, jnp.asarray([new], jnp.int32), positions,
                                            cache)
  return np.asarray(logits[0]), cache


def test_page_keys_chain_full_pages_and_salt():
  tokens = list(range(3 * L + 3))
  keys = page_keys(tokens, L)
  assert len(keys) == 3                                  # the partial page has no key
  assert page_keys(tokens[:2 * L], L) == keys[:2]        # a key names its page and its prefix
  assert len(set(keys)) == 3
  changed = tokens.copy()
  changed[0] = 99                                        # an early change reaches every key
  assert not set(page_keys(changed, L)) & set(keys)
  assert page_keys(tokens, L, salt='a') == page_keys(tokens, L, salt=b'a')
  assert not set(page_keys(tokens, L, salt='a')) & set(keys)
  assert not set(page_keys(tokens, L, salt='a')) & set(page_keys(tokens, L, salt='b'))


@pytest.mark.parametrize('length', [2 * L - 1, 2 * L, 2 * L + 1, 3 * L])
def test_hit_gives_recomputed_logits(tiny, length):
  config, params = tiny
  rng = np.random.default_rng(length)
  prompt = rng.integers(3, config.vocab_size, length).tolist()
  prefix = PrefixCache(num_pages=24, page_size=L)
  caches = [cache_for(config, np.zeros((1, 8), np.int32), 24, L)]

  first, plan = prefix.admit(prompt, reserve=length + 4)
  assert first.num_cached == 0 and not plan
  full, cache = run_prompt(config, params, prefix, first, caches)
  prefix.commit(first, prompt)
  prefix.finish(first)

  again, _ = prefix.admit(prompt, reserve=length + 4)
  # Every full page but the one holding the last token is a hit (its logits are needed).
  assert again.num_cached == (length - 1) // L * L
  assert again.pages[:again.num_cached // L] == first.pages[:again.num_cached // L]
  hit, _ = run_prompt(config, params, prefix, again, [cache])
  np.testing.assert_allclose(hit, full[again.num_cached:], rtol=1e-5, atol=1e-5)
  assert (hit.argmax(-1) == full[again.num_cached:].argmax(-1)).all()


@pytest.mark.parametrize('length', [2 * L - 1, 2 * L, 2 * L + 1])
def test_generator_hit_equals_recompute_greedy(tiny, length):
  config, params = tiny
  prompt = np.random.default_rng(length).integers(3, config.vocab_size, length).tolist()
  gen = PrefixCachedGenerator(config, params, num_pages=64, page_size=L)
  cold = gen.generate(prompt, max_new_tokens=12)
  warm = gen.generate(prompt, max_new_tokens=12)
  assert cold.cached_tokens == 0 and cold.prefill_tokens == length
  assert warm.cached_tokens == (length - 1) // L * L
  assert warm.prefill_tokens == length - warm.cached_tokens
  ref = generate(config, params, [prompt], max_new_tokens=12, page_size=L)
  assert cold.tokens == warm.tokens == ref.tokens
  # The reply is cached too: the next turn (history + reply + more) hits past the old prompt.
  turn2 = prompt + warm.tokens[0] + [5, 6, 7]
  nxt = gen.generate(turn2, max_new_tokens=4)
  assert nxt.cached_tokens > warm.cached_tokens
  assert nxt.tokens == generate(config, params, [turn2], max_new_tokens=4, page_size=L).tokens


def test_speculative_hit_same_tokens_and_acceptance(tiny, tiny_draft):
  config, params = tiny
  draft, draft_params = tiny_draft
  prompt = np.random.default_rng(7).integers(3, config.vocab_size, 3 * L + 2).tolist()
  gen = PrefixCachedGenerator(config, params, num_pages=64, page_size=L, draft=draft,
                              draft_params=draft_params, k=3)
  cold = gen.generate(prompt, max_new_tokens=16)
  warm = gen.generate(prompt, max_new_tokens=16)
  assert warm.cached_tokens == 3 * L
  ref = generate(config, params, [prompt], max_new_tokens=16, page_size=L, draft=draft,
                 draft_params=draft_params, k=3)
  plain = generate(config, params, [prompt], max_new_tokens=16, page_size=L)
  assert cold.tokens == warm.tokens == ref.tokens == plain.tokens
  for field in ('proposed', 'accepted', 'emitted', 'target_calls', 'rejected'):
    assert getattr(cold, field) == getattr(warm, field) == getattr(ref, field), field
  assert 0 < warm.accepted < warm.proposed


def test_second_turn_hit_on_decoded_pages_gives_recomputed_logits(tiny):
  config, params = tiny
  prompt = np.random.default_rng(11).integers(3, config.vocab_size, L + 3).tolist()
  gen = PrefixCachedGenerator(config, params, num_pages=32, page_size=L)
  reply = gen.generate(prompt, max_new_tokens=2 * L).tokens[0]
  turn2 = prompt + reply + [4, 5, 6]
  request, _ = gen.prefix.admit(turn2, reserve=len(turn2))
  assert request.num_cached >= 2 * L > len(prompt)          # pages the decode loop wrote
  hit, _ = run_prompt(config, params, gen.prefix, request, gen.caches, gen.pages_per_seq)
  gen.prefix.finish(request)
  fresh = PrefixCache(num_pages=32, page_size=L, enabled=False)
  cold, _ = fresh.admit(turn2)
  full, _ = run_prompt(config, params, fresh, cold,
                       [cache_for(config, np.zeros((1, 8), np.int32), 32, L)])
  np.testing.assert_allclose(hit, full[request.num_cached:], rtol=1e-4, atol=1e-4)


def test_speculative_multi_turn_small_pool_with_host_tier(tiny, tiny_draft):
  config, params = tiny
  draft, draft_params = tiny_draft
  spec = dict(draft=draft, draft_params=draft_params, k=2)
  small = PrefixCachedGenerator(config, params, num_pages=9, page_size=L, host_pages=32, **spec)
  rng = np.random.default_rng(12)
  convs = [rng.integers(3, config.vocab_size, 2 * L + 3).tolist() for _ in range(3)]
  promoted = 0
  for _ in range(2):
    for c, conv in enumerate(convs):
      got = small.generate(conv, max_new_tokens=6)
      ref = generate(config, params, [conv], max_new_tokens=6, page_size=L, **spec)
      assert got.tokens == ref.tokens
      for field in ('proposed', 'accepted', 'emitted', 'target_calls', 'rejected'):
        assert getattr(got, field) == getattr(ref, field), field
      promoted += got.promoted_tokens
      convs[c] = conv + got.tokens[0] + [c + 3]
  assert promoted > 0


def test_salt_must_be_text_or_bytes():
  prefix = PrefixCache(num_pages=8, page_size=L)
  with pytest.raises(ValueError, match='salt must be str or bytes, got int 0'):
    prefix.admit([1, 2, 3], salt=0)
  with pytest.raises(ValueError, match='salt must be str or bytes'):
    page_keys([1, 2], 2, salt=3)


def test_salts_isolate_tenants():
  prefix = PrefixCache(num_pages=16, page_size=L)
  prompt = list(range(3 * L))
  req, _ = prefix.admit(prompt, salt='tenant-a')
  prefix.commit(req, prompt)
  prefix.finish(req)
  other, _ = prefix.admit(prompt, salt='tenant-b')
  assert other.num_cached == 0
  assert not set(other.pages) & set(req.pages)
  prefix.finish(other)
  same, _ = prefix.admit(prompt, salt='tenant-a')
  assert same.num_cached == 2 * L and same.pages[:2] == req.pages[:2]


def _snapshot(prefix):
  return copy.deepcopy((prefix.allocator._free, prefix.allocator._refs, prefix._holders,
                        list(prefix._lru), prefix._page_of_key, prefix._requests))


def test_request_that_cannot_fit_errors_and_leaves_pool_unchanged():
  prefix = PrefixCache(num_pages=9, page_size=L)            # 8 usable pages
  held, _ = prefix.admit(list(range(3 * L)))                # 3 held
  cached, _ = prefix.admit(list(range(100, 100 + 2 * L)), reserve=3 * L)
  prefix.commit(cached, list(range(100, 100 + 2 * L)))
  prefix.finish(cached)                                     # 2 cached, 1 freed
  before = _snapshot(prefix)
  with pytest.raises(OutOfPagesError, match=r'needs 6 new pages.*3 free \+ 2 reclaimable'):
    prefix.admit(list(range(200, 200 + 5 * L)), reserve=6 * L)
  assert _snapshot(prefix) == before
  ok, _ = prefix.admit(list(range(200, 200 + 5 * L)))       # 5 pages: fits by reclaiming
  assert prefix.num_cached == 0 and prefix.num_free == 0
  del held, ok


def test_generator_out_of_pages_is_clear(tiny):
  config, params = tiny
  gen = PrefixCachedGenerator(config, params, num_pages=5, page_size=L)
  cached = list(range(3, 3 + 2 * L + 1))
  gen.generate(cached, max_new_tokens=4)                   # leaves 2 cached pages
  before = _snapshot(gen.prefix)
  assert gen.prefix.num_cached == 2
  with pytest.raises(OutOfPagesError, match='cache out of pages'):
    gen.generate(list(range(3, 3 + 5 * L)), max_new_tokens=4)
  assert _snapshot(gen.prefix) == before                   # nothing reclaimed, nothing leaked
  assert gen.generate(cached, max_new_tokens=4).cached_tokens == 2 * L  # still usable


def test_unapplied_plan_is_refused():
  prefix = PrefixCache(num_pages=4, page_size=L, host_pages=4)
  first = list(range(2 * L + 1))
  req, _ = prefix.admit(first)
  prefix.commit(req, first)
  prefix.finish(req)
  _, plan = prefix.admit(list(range(50, 50 + 2 * L + 1)))   # reclaims -> demotions pending
  assert plan.demote
  with pytest.raises(ValueError, match='plan is pending'):
    prefix.admit([1, 2, 3])
  with pytest.raises(ValueError, match='plan is pending'):
    prefix.reset()
  with pytest.raises(ValueError, match='not the pending one'):
    prefix.apply(type(plan)(), [])                          # an empty plan cannot drop it
  # Moving pages with no caches stored empty host entries that later promoted as an IndexError.
  with pytest.raises(ValueError, match='the plan moves 2 demoted and 0 promoted pages, and no '
                                       'caches were given'):
    prefix.apply(plan, [])
  with pytest.raises(ValueError, match='plan is pending'):  # still pending: apply it properly
    prefix.admit([1, 2, 3])


# ------------------------------------------------------------- accounting, property-based

def check_accounting(prefix, live):
  alloc = prefix.allocator
  free = alloc._free
  assert len(free) == len(set(free)) and NULL_PAGE not in free
  holders = [0] * prefix.num_pages
  for req in live:
    for p in req.pages:
      holders[p] += 1
  assert holders == prefix._holders
  lru = set(prefix._lru)
  registered = set(prefix._key_of_page)
  for page in range(1, prefix.num_pages):
    states = [page in free, holders[page] > 0, page in lru]
    assert sum(states) == 1, (page, states)
    assert alloc.ref_count(page) == holders[page] + (page in registered)
    if page in lru:
      assert page in registered and holders[page] == 0
    if page in registered and holders[page] == 0:
      assert page in lru
  assert {p: k for k, p in prefix._page_of_key.items()} == prefix._key_of_page
  if prefix.host is not None:
    assert len(prefix.host) <= prefix.host.capacity
    for key in prefix.host.keys():
      prefix.host.get(key)  # every host entry holds data


OPS = ('admit', 'admit', 'extend', 'commit', 'finish', 'finish', 'reset', 'reclaim')
SHARED = [[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 1, 0, 1]]  # prompts often start with these


def run_ops(ops, host):
  """Apply (op, seed) pairs to a 9-page pool of 2-token pages; check accounting after each."""
  prefix = PrefixCache(num_pages=10, page_size=2, host_pages=host)
  caches = [init_cache(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=10, page_size=2,
                       page_table=np.zeros((1, 1), np.int32))]
  live = []
  for op, seed in ops:
    r = np.random.default_rng(seed)
    plan = None
    try:
      if op == 'admit':
        head = SHARED[r.integers(2)][:r.integers(0, 9)] if r.random() < 0.7 else []
        prompt = head + r.integers(0, 2, r.integers(1, 4)).tolist()
        req, plan = prefix.admit(prompt, reserve=len(prompt) + int(r.integers(0, 4)),
                                 salt=str(r.integers(0, 2)))
        live.append(req)
        caches = prefix.apply(plan, caches)
        plan = None
        if r.random() < 0.7:
          prefix.commit(req, prompt)
      elif op == 'extend' and live:
        req = live[r.integers(len(live))]
        plan = prefix.extend(req, len(req.pages) * 2 + int(r.integers(0, 4)))
      elif op == 'commit' and live:
        req = live[r.integers(len(live))]
        room = len(req.pages) * 2 - len(req.tokens)
        prefix.commit(req, req.tokens + r.integers(0, 2, r.integers(0, room + 1)).tolist())
      elif op == 'finish' and live:
        prefix.finish(live.pop(r.integers(len(live))))
      elif op == 'reset':
        prefix.reset()
      elif op == 'reclaim':
        plan = prefix.reclaim(int(r.integers(0, 8)))
    except OutOfPagesError:
      pass
    if plan is not None:
      caches = prefix.apply(plan, caches)
    check_accounting(prefix, live)
  for req in live:
    prefix.finish(req)
  prefix.reset()
  check_accounting(prefix, [])
  assert prefix.num_free == prefix.num_pages - 1     # nothing leaked
  return prefix.stats


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10 ** 6)),
                               max_size=30),
                  host=st.sampled_from([0, 3]))
def test_accounting_invariant_under_any_sequence(ops, host):
  run_ops(ops, host)


def test_random_operations_reach_hits_demotions_and_promotions():
  """The generator of the property test does exercise sharing and both tiers."""
  rng = np.random.default_rng(0)
  ops = [(OPS[i], int(s)) for i, s in zip(rng.integers(0, len(OPS), 400),
                                          rng.integers(0, 10 ** 6, 400)) if OPS[i] != 'reset']
  stats = run_ops(ops, host=3)
  assert stats['cached_tokens'] >= 40 and stats['demoted_pages'] >= 5
  assert stats['promoted_pages'] >= 3


def test_prefix_cache_refuses_ids_and_sizes_that_are_not_ints():
  cache = PrefixCache(10, 4)
  for tokens, match in (([1.7, 2.2, 3.9], 'flat sequence of int token ids'),
                        ([1, True, 3], 'holds the bool True'), ([1, -2, 3], 'token id -2'),
                        ([1, 2 ** 63], r'token id 9223372036854775808 outside \[0, 2\*\*63\)')):
    with pytest.raises(ValueError, match=match):
      cache.admit(tokens)
    with pytest.raises(ValueError, match=match):
      cache.match(tokens)
  assert cache.num_free == 9                     # nothing was taken
  for kwargs, match in ((dict(host_pages=float('nan')), 'host_pages must be an int >= 0'),
                        (dict(host_pages=2.5), 'host_pages must be an int >= 0, got 2.5'),
                        (dict(host_pages=True), 'host_pages must be an int >= 0, got True'),
                        (dict(page_size=0), 'page_size must be an int >= 1, got 0'),
                        (dict(num_pages=1.0), r'num_pages must be an int >= 2 \(page 0')):
    with pytest.raises(ValueError, match=match):
      PrefixCache(**{'num_pages': 10, 'page_size': 4, **kwargs})
  request, _ = PrefixCache(10, 4, host_pages=np.int64(2)).admit(np.arange(5, dtype=np.int32))
  assert request.tokens == [0, 1, 2, 3, 4]


def test_page_keys_and_holders_name_bad_arguments():
  for args, match in ((([1, -2, 3, 4], 2), 'tokens has token id -2'),   # was hashed silently
                      (([2 ** 63, 1], 2), r'outside \[0, 2\*\*63\)'),  # was struct.error
                      (([1, 2], 2.5), 'page_size must be an int >= 1, got 2.5')):
    with pytest.raises(ValueError, match=match):
      page_keys(*args)
  cache = PrefixCache(8, 4)
  for page in (8, -1, True):                     # 8: IndexError; -1 read the last page's count
    with pytest.raises(ValueError, match=r'page must be an int in \[0, 8\)'):
      cache.holders(page)
  request, _ = cache.admit([5, 6, 7, 8, 9])
  assert [cache.holders(p) for p in request.pages] == [1, 1]


def test_generator_words_errors_for_its_one_prompt(tiny):
  config, params = tiny
  gen = PrefixCachedGenerator(config, params, num_pages=8, page_size=L)
  with pytest.raises(ValueError, match='prompt is empty'):      # was 'prompt 0 is empty'
    gen.generate([], max_new_tokens=2)
  for bad, match in ((0, 'max_prompt_len must be an int >= 1, got 0'),   # compiled nothing
                     (10.5, 'max_prompt_len must be an int >= 1, got 10.5'),   # a TypeError
                     (300, 'exceeds the context of 256')):   # was after the shorter ones
    with pytest.raises(ValueError, match=match):
      gen.warm_up(bad, 2)


def test_finish_refuses_a_keep_that_is_not_a_bool():
  cache = PrefixCache(num_pages=8, page_size=4)
  request, plan = cache.admit([1, 2, 3, 4, 5], reserve=8)
  cache.apply(plan, [])
  with pytest.raises(ValueError, match="keep must be True or False, got 'no'"):
    cache.finish(request, keep='no')                  # 'no' is truthy: the pages stayed cached
  cache.finish(request, keep=False)
