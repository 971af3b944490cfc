"""The host tier under prefix caching: a key it holds keeps its data when reserved again,
demote/promote is bit-identical, turns match a device-only cache, and a failed copy leaves the
cache serving with what arrived counted."""

import numpy as np
import pytest

from jaxspec.cache import HostTier, PrefixCache, page_keys, read_pages
from jaxspec.decoding import PrefixCachedGenerator
from jaxspec.models import cache_for
from test_prefix_cache import L, run_prompt


def test_reserving_a_key_the_host_tier_holds_keeps_its_data():
  host = HostTier(2)
  for key in (b'a', b'b'):
    assert host.reserve(key)
    host.put(key, [(np.ones(2), np.zeros(2))])
  assert host.reserve(b'a')                     # emptied 'a' before: get() then raised
  assert host.has_data(b'a') and host.has_data(b'b')
  assert host.reserve(b'c') and b'b' not in host and host.has_data(b'a')   # 'a' was touched


def _filled_caches(config, params, num_pages):
  return [cache_for(config, np.zeros((1, 8), np.int32), num_pages, L)]


def test_demote_promote_bit_identical_and_reset_forgets(tiny):
  config, params = tiny
  prefix = PrefixCache(num_pages=5, page_size=L, host_pages=8)   # 4 usable device pages
  caches = _filled_caches(config, params, 5)
  prompt = np.random.default_rng(3).integers(3, config.vocab_size, 3 * L + 1).tolist()
  first, plan = prefix.admit(prompt)
  caches = prefix.apply(plan, caches)
  logits, cache = run_prompt(config, params, prefix, first, caches)
  caches = [cache]
  prefix.commit(first, prompt)
  prefix.finish(first)
  original = read_pages(caches, first.pages[:3])[0]

  other = np.random.default_rng(4).integers(3, config.vocab_size, 3 * L + 1).tolist()
  second, plan = prefix.admit(other)                 # needs all 4 pages: reclaims the 3 cached
  assert sorted(p for p, _ in plan.demote) == sorted(first.pages[:3])
  caches = prefix.apply(plan, caches)
  _, cache = run_prompt(config, params, prefix, second, caches)
  caches = [cache]
  prefix.commit(second, other)
  prefix.finish(second)
  assert len(prefix.host) == 3

  third, plan = prefix.admit(prompt)                 # host hit: promoted into fresh pages
  assert third.num_cached == 3 * L and third.num_promoted == 3 * L
  assert [k for k, _ in plan.promote] == page_keys(prompt, L)[:3]
  with pytest.raises(ValueError, match=r'demoted from 1 caches \(one per model\), 2 given'):
    prefix.apply(plan, caches * 2)
  caches = prefix.apply(plan, caches)
  promoted = read_pages(caches, third.pages[:3])[0]
  for a, b in zip(original, promoted):
    np.testing.assert_array_equal(a, b)              # bit-identical round trip
  hit, _ = run_prompt(config, params, prefix, third, caches)
  np.testing.assert_allclose(hit, logits[3 * L:], rtol=1e-5, atol=1e-5)
  prefix.commit(third, prompt)
  prefix.finish(third)

  prefix.reset()
  assert len(prefix.host) == 0 and prefix.num_cached == 0
  assert prefix.num_free == prefix.num_pages - 1
  assert prefix.match(prompt) == ([], []) and prefix.match(other) == ([], [])
  again, _ = prefix.admit(prompt)
  assert again.num_cached == 0


def test_generator_host_tier_turns_match_device_only(tiny):
  config, params = tiny
  rng = np.random.default_rng(5)
  convs = [rng.integers(3, config.vocab_size, 3 * L + 3).tolist() for _ in range(3)]
  small = PrefixCachedGenerator(config, params, num_pages=9, page_size=L, host_pages=32)
  big = PrefixCachedGenerator(config, params, num_pages=64, page_size=L)
  promoted = []
  for turn in range(2):
    for c, conv in enumerate(convs):
      a = small.generate(conv, max_new_tokens=4)
      b = big.generate(conv, max_new_tokens=4)
      assert a.tokens == b.tokens
      assert a.cached_tokens == b.cached_tokens == (0 if turn == 0 else 3 * L)
      assert b.promoted_tokens == 0
      promoted.append(a.promoted_tokens)
      convs[c] = conv + a.tokens[0] + [c + 3]
  # The 8-page pool holds under two conversations: turn 2 finds what it lost in the host tier.
  assert promoted[:3] == [0, 0, 0] and promoted[3] > 0 and sum(promoted) >= 3 * L
  assert small.peak_device_pages <= 8 and small.host_pages_used > 0


def test_a_failed_promotion_leaves_the_generator_serving_and_never_hits_its_page(tiny,
                                                                                monkeypatch):
  # The plan stayed pending after a failed host-to-device copy: every later call (and
  # reset_prefix_cache) raised 'a plan is pending'; the promoted page kept its key without data.
  from jaxspec.cache import host as host_module  # pylint: disable=import-outside-toplevel
  config, params = tiny
  rng = np.random.default_rng(7)
  a, b = (rng.integers(3, config.vocab_size, 5 * L).tolist() for _ in range(2))
  gen = PrefixCachedGenerator(config, params, num_pages=8, page_size=L, host_pages=16)
  want = gen.generate(a, max_new_tokens=4).tokens
  gen.generate(b, max_new_tokens=4)                     # a's pages demoted to the host tier
  write_pages = host_module.write_pages

  def out_of_memory(*args, **kwargs):
    raise MemoryError('simulated')

  monkeypatch.setattr(host_module, 'write_pages', out_of_memory)
  host = gen.prefix.host
  stored = lambda: sum(host.has_data(key) for key in host.keys())  # noqa: E731
  demoted, held = gen.prefix.stats['demoted_pages'], stored()
  with pytest.raises(MemoryError, match='simulated'):
    gen.generate(a, max_new_tokens=4)
  # b's pages made room for a's before the promotion failed: their copies arrived and count.
  assert gen.prefix.stats['demoted_pages'] - demoted == stored() - held > 0
  monkeypatch.setattr(host_module, 'write_pages', write_pages)
  again = gen.generate(a, max_new_tokens=4)             # serves, and reads no page without data
  assert again.tokens == want
  assert gen.prefix.allocator.num_free + len(gen.prefix._lru) == gen.prefix.num_pages - 1
  gen.reset_prefix_cache()


def test_a_promotion_failing_on_the_drafts_data_leaves_both_caches_usable(tiny, tiny_draft,
                                                                         monkeypatch):
  # write_pages donated the target's pool before staging the draft's data: a failure there
  # left the generator holding deleted buffers ('Buffer has been deleted or donated').
  from jaxspec.cache import host as host_module  # pylint: disable=import-outside-toplevel
  config, params = tiny
  draft, draft_params = tiny_draft
  rng = np.random.default_rng(8)
  a, b = (rng.integers(3, config.vocab_size, 5 * L).tolist() for _ in range(2))
  gen = PrefixCachedGenerator(config, params, num_pages=8, page_size=L, host_pages=16,
                              draft=draft, draft_params=draft_params, k=2)
  want = gen.generate(a, max_new_tokens=4).tokens
  gen.generate(b, max_new_tokens=4)                     # a's pages demoted to the host tier
  stack, calls = np.stack, []

  def failing_stack(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:                                 # the draft's keys
      raise MemoryError('simulated')
    return stack(*args, **kwargs)

  monkeypatch.setattr(host_module.np, 'stack', failing_stack)
  with pytest.raises(MemoryError, match='simulated'):
    gen.generate(a, max_new_tokens=4)
  monkeypatch.undo()
  assert len(calls) == 3
  assert gen.generate(a, max_new_tokens=4).tokens == want
