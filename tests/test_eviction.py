"""Eviction policies: budget errors, contract 5 (a budget >= the sequence equals the full cache
exactly), kept tokens' positions after many evictions, and greedy speculative == greedy
autoregressive decoding under the same policy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import (POLICIES, EvictionPolicy, EvictionState, after_tokens, init_cache,
                           init_eviction, make_policy, pages_needed)
from jaxspec.cache.eviction import attend_and_evict, last_token, priority
from jaxspec.decoding import SamplingParams, prefill
from jaxspec.decoding.evicting import (decode_autoregressive_evicting,
                                       decode_speculative_evicting, prefill_evicting)
from jaxspec.models import Transformer, apply_rope, cache_for


@pytest.mark.parametrize('kind,budget,kwargs,needle', [
    ('h2o', 0, {}, 'budget must be an int >= 1, got 0'),
    ('tova', -4, {}, 'got -4'),
    ('window', None, {}, 'needs a budget'),
    ('sinks', 4, {}, 'budget=4 is smaller than sinks (4) + window (0)'),
    ('h2o', 8, dict(window=6, sinks=2), 'budget=8 is smaller than sinks (2) + window (6)'),
    ('h2o', 2.5, {}, 'got 2.5'),
    ('lru', 8, {}, "unknown eviction policy 'lru'"),
    ('full', 10, {}, "policy 'full' keeps every token and takes no budget, got budget=10"),
    ('full', None, dict(sinks=3), "policy 'full' keeps every token and takes no sinks, got "
                                  'sinks=3'),
    ('full', None, dict(window=3), "policy 'full' keeps every token and takes no window, got "
                                   'window=3'),
])
def test_bad_budgets_raise(kind, budget, kwargs, needle):
  with pytest.raises(ValueError) as err:
    make_policy(kind, budget, **kwargs)
  assert needle in str(err.value)


def test_full_policy_accepts_zero_sinks_window_and_a_reuse_delay():
  policy = make_policy('full', sinks=0, window=0, reuse_delay=4)     # the delay: speculative
  assert (policy.sinks, policy.window, policy.reuse_delay) == (0, 0, 4)


def test_numpy_integer_budgets_are_accepted():
  assert make_policy('h2o', np.int64(20)).budget == 20
  assert type(make_policy('h2o', np.int64(20)).budget) is int     # hashes like make_policy(20)


@pytest.mark.parametrize('args,needle', [
    (('window', 0), 'budget must be an int >= 1, got 0'),
    (('h2o', 3, 0, 10), 'budget=3 is smaller than sinks (0) + window (10)'),
    (('sinks', 4, 4), 'budget=4 is smaller than sinks (4) + window (0)'),
    (('bogus', 8), "unknown eviction policy 'bogus'"),
    (('tova', 8, -1), 'sinks must be an int >= 0, got -1'),
    (('full', 8), "policy 'full' keeps every token and takes no budget"),
    (('full', None, 3, 5), "policy 'full' keeps every token and takes no sinks, got sinks=3"),
    (('full', None, 0, 5), "policy 'full' keeps every token and takes no window, got window=5"),
])
def test_a_policy_built_directly_is_checked_like_make_policy(args, needle):
  # EvictionPolicy is public: built directly, a budget of 0 stalled every engine step and one
  # below sinks + window + 1 kept more than the budget live.
  with pytest.raises(ValueError) as err:
    EvictionPolicy(*args)
  assert needle in str(err.value)


def test_compiled_kernels_on_cpu_and_non_bool_flags_are_refused_at_init(tiny):
  config, _ = tiny
  cache = cache_for(config, np.arange(1, 3)[None], 3, 8)
  policy = make_policy('h2o', 8)
  if jax.default_backend() == 'cpu':
    with pytest.raises(ValueError, match="interpret=False needs a GPU backend .* default "
                                         "backend is 'cpu'"):
      init_eviction(policy, cache, use_kernel=True, interpret=False)
    # None (the default): the interpreter on CPU, so the kernels run.
    assert init_eviction(policy, cache, use_kernel=True).interpret is True
  with pytest.raises(ValueError, match="use_kernel must be True or False, got 'yes'"):
    init_eviction(policy, cache, use_kernel='yes')
  with pytest.raises(ValueError, match="interpret must be True, False or None, got 'no'"):
    init_eviction(policy, cache, interpret='no')


def test_compiled_kernels_are_the_default_on_a_gpu_and_need_power_of_two_sizes(tiny, monkeypatch):
  config, _ = tiny
  policy = make_policy('h2o', 8)
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  cache = cache_for(config, np.arange(1, 3)[None], 3, 8)
  assert init_eviction(policy, cache, use_kernel=True).interpret is False
  assert init_eviction(policy, cache, use_kernel=True, interpret=True).interpret is True
  odd = cache_for(config, np.arange(1, 3)[None], 3, 12)                 # pages of 12 slots
  with pytest.raises(ValueError, match='need page_size L a power of two, got 12'):
    init_eviction(policy, odd, use_kernel=True)
  assert init_eviction(policy, odd, use_kernel=True, interpret=True).interpret is True
  assert init_eviction(policy, odd).use_kernel is False                 # jnp references: any size


def test_init_eviction_needs_a_policy_object(tiny):
  config, _ = tiny
  cache = cache_for(config, np.arange(1, 3)[None], 3, 8)
  with pytest.raises(ValueError, match="needs an EvictionPolicy \\(from make_policy\\), got 'h2o'"):
    init_eviction('h2o', cache)


def _states(t=3, b=2):
  """(before, history): before holds zeros, history's token i holds i + 1 everywhere."""
  shape, policy = (1, b, 4), make_policy('h2o', 4)
  before = EvictionState(key_pos=jnp.zeros(shape, jnp.int32), free_from=jnp.zeros(shape, jnp.int32),
                         scores=jnp.zeros(shape, jnp.float32), policy=policy)
  steps = jnp.arange(1, t + 1).reshape(t, 1, 1, 1) * jnp.ones(shape)
  history = EvictionState(key_pos=steps.astype(jnp.int32), free_from=steps.astype(jnp.int32),
                          scores=steps, policy=policy)
  return before, history


def test_after_tokens_keeps_the_state_after_each_rows_tokens():
  before, history = _states()
  got = after_tokens(before, history, np.array([0, 2], np.int32))
  for field in ('key_pos', 'free_from', 'scores'):
    np.testing.assert_array_equal(getattr(got, field)[0], [[0] * 4, [2] * 4])


@pytest.mark.parametrize('num_tokens,needle', [
    (np.array([4, 1]), 'num_tokens must lie in [0, T] = [0, 3], got [4, 1]'),
    (np.array([0, -1]), 'num_tokens must lie in [0, T] = [0, 3], got [0, -1]'),
    (jnp.array([1, 9]), 'num_tokens must lie in [0, T] = [0, 3], got [1, 9]'),
    (np.array([1, 2, 3]), 'num_tokens must be a [B] = [2] integer array, got shape (3,)'),
    (np.array([1.0, 2.0]), 'num_tokens must be a [B] = [2] integer array, got shape (2,) dtype '
                           'float'),
])
def test_after_tokens_refuses_concrete_counts_outside_0_t(num_tokens, needle):
  # num_tokens > T read past the history (key_pos -2**31, NaN scores); < 0 silently kept before.
  before, history = _states()
  with pytest.raises(ValueError) as err:
    after_tokens(before, history, num_tokens)
  assert needle in str(err.value)


def test_after_tokens_clamps_traced_counts_to_0_t():
  before, history = _states()
  got = jax.jit(after_tokens)(before, history, jnp.array([-2, 7], jnp.int32))
  for field in ('key_pos', 'free_from', 'scores'):
    np.testing.assert_array_equal(getattr(got, field)[0], [[0] * 4, [3] * 4])


def test_cache_smaller_than_budget_plus_delay_raises(tiny):
  config, _ = tiny
  cache = cache_for(config, np.arange(1, 3)[None], 3, 8)             # 16 slots
  with pytest.raises(ValueError, match='needs budget 14 \\+ reuse_delay 4 = 18'):
    init_eviction(make_policy('h2o', 14, reuse_delay=4), cache)


@functools.partial(jax.jit, static_argnames=('config',))
def _logits_token_by_token(config, params, cache, eviction, tokens):
  """[T, B, V] logits of feeding `tokens` [B, T] one at a time (eviction None: default path)."""
  def step(carry, t):
    cache, eviction = carry
    tok, pos = tokens[:, t][:, None], cache.lengths[:, None]
    if eviction is None:
      logits, cache = Transformer(config).apply(params, tok, pos, cache)
    else:
      logits, cache, history = Transformer(config).apply(params, tok, pos, cache, eviction)
      eviction = last_token(history)
    return (cache, eviction), logits[:, 0]
  return jax.lax.scan(step, (cache, eviction), jnp.arange(tokens.shape[1]))[1]


def test_budget_at_least_sequence_equals_full_cache_exactly(tiny):
  config, params = tiny
  page_table = np.arange(1, 9).reshape(2, 4)                          # 32 slots per sequence
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, size=(2, 29)), jnp.int32)
  new_cache = lambda: cache_for(config, page_table, 9, 8)
  full = _logits_token_by_token(config, params, new_cache(), None, tokens)
  for kind in POLICIES:
    for budget in ([None] if kind == 'full' else [29, 32]):   # budget == length: the edge
      eviction = init_eviction(make_policy(kind, budget), new_cache())
      got = _logits_token_by_token(config, params, new_cache(), eviction, tokens)
      np.testing.assert_array_equal(got, full, err_msg=f'{kind} budget {budget}')


def _rope(x, pos):
  return apply_rope(x[None, None], jnp.asarray([[pos]]), 10000.0)[0, 0]


@pytest.mark.parametrize('kind', ['h2o', 'h2o_norm', 'tova', 'sinks', 'window'])
def test_kept_positions_intact_after_many_evictions(kind):
  """A random stream of 60 keys/queries through one layer with a budget of 9: at every step the
  output equals attention recomputed directly on the kept set (keys rotated at their own
  positions), each slot holds its token's key, and the window policies keep exactly the
  expected positions."""
  rng = np.random.default_rng(1)
  n_steps, kv_heads, group, h, budget = 60, 2, 2, 8, 9
  raw_q = rng.normal(size=(n_steps, kv_heads * group, h)).astype(np.float32)
  raw_k = rng.normal(size=(n_steps, kv_heads, h)).astype(np.float32)
  raw_v = rng.normal(size=(n_steps, kv_heads, h)).astype(np.float32)
  rot_k = np.stack([np.asarray(_rope(jnp.asarray(raw_k[p]), p)) for p in range(n_steps)])
  cache = init_cache(num_layers=1, num_kv_heads=kv_heads, head_dim=h, num_pages=4, page_size=4,
                     page_table=np.array([[3, 1, 2]]))              # 12 slots, pages out of order
  policy = make_policy(kind, budget, reuse_delay=2)
  state = init_eviction(policy, cache)
  step = jax.jit(lambda q, k, v, pos, cache, state: attend_and_evict(q, k, v, pos, cache, state, 0))
  for p in range(n_steps):
    q = _rope(jnp.asarray(raw_q[p]), p)[None, None]
    out, cache, history = step(q, jnp.asarray(rot_k[p])[None, None],
                               jnp.asarray(raw_v[p])[None, None],
                               jnp.asarray([[p]], jnp.int32), cache, state)
    state = last_token(state.replace(key_pos=history[0][:, None], free_from=history[1][:, None],
                                     scores=history[2][:, None]))
    key_pos = np.asarray(state.key_pos[0, 0])
    kept = np.sort(key_pos[key_pos >= 0])
    assert len(kept) == min(p + 1, budget) and kept[-1] == p
    if kind == 'window':
      np.testing.assert_array_equal(kept, np.arange(max(0, p + 1 - budget), p + 1))
    if kind == 'sinks' and p >= budget:
      np.testing.assert_array_equal(kept, np.r_[0:4, p + 5 - budget:p + 1])
    # Each slot holds the key/value of the token its position names.
    table = np.asarray(cache.page_table[0])
    for slot in np.nonzero(key_pos >= 0)[0]:
      page, off = table[slot // 4], slot % 4
      np.testing.assert_array_equal(cache.k_pages[0, :, page, off], rot_k[key_pos[slot]])
      np.testing.assert_array_equal(cache.v_pages[0, :, page, off], raw_v[key_pos[slot]])
    # Attention recomputed on the kept set alone.
    qg = np.asarray(q[0, 0]).reshape(kv_heads, group, h)
    s = np.einsum('kgh,skh->kgs', qg, rot_k[kept]) / np.sqrt(h)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.einsum('kgs,skh->kgh', w, raw_v[kept]).reshape(kv_heads * group, h)
    np.testing.assert_allclose(out[0, 0], want, rtol=1e-5, atol=1e-5)


def _prefilled(config, params, draft_params, policy, prompts):
  """(target cache, eviction, draft cache, first token) after prefill of the prompts."""
  tokens = np.zeros((len(prompts), 16), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  b = len(prompts)
  cache = cache_for(config, np.arange(1, 1 + 3 * b).reshape(b, 3), 1 + 3 * b, 8)
  eviction = init_eviction(policy, cache)
  first, cache, eviction = prefill_evicting(config, params, cache, eviction, jnp.asarray(tokens),
                                            lengths, jax.random.PRNGKey(0),
                                            sampling=SamplingParams())
  draft_cache = cache_for(config, np.arange(1, 1 + 8 * b).reshape(b, 8), 1 + 8 * b, 8)
  _, draft_cache = prefill(config, draft_params, draft_cache, jnp.asarray(tokens), lengths,
                           jax.random.PRNGKey(0), sampling=SamplingParams())
  return cache, eviction, draft_cache, first


@pytest.mark.parametrize('kind', ['h2o'])   # one policy: each compiles two whole decode loops
def test_greedy_speculative_equals_autoregressive_under_eviction(tiny, tiny_draft, kind):
  """Same policy, budget 12 over 9 + 40 tokens: same tokens, and the same final eviction state
  (positions and scores bit for bit), so rejected draft positions left no trace."""
  (config, params), (_, draft_params) = tiny, tiny_draft
  k, max_new = 3, 40
  policy = make_policy(kind, 12, reuse_delay=k + 1)                  # 16 slots = 2 pages
  rng = np.random.default_rng(7)
  prompts = [rng.integers(3, 64, size=n).tolist() for n in (9, 14)]
  stop = jnp.zeros((0,), jnp.int32)
  cache, eviction, _, first = _prefilled(config, params, draft_params, policy, prompts)
  ar, _, ar_ev = decode_autoregressive_evicting(config, params, cache, eviction, first,
                                                jax.random.PRNGKey(1), stop,
                                                sampling=SamplingParams(), max_new_tokens=max_new)
  cache, eviction, draft_cache, first = _prefilled(config, params, draft_params, policy, prompts)
  sp, stats, _, sp_ev, _ = decode_speculative_evicting(
      config, config, params, draft_params, cache, eviction, draft_cache, first,
      jax.random.PRNGKey(1), stop, k=k, sampling=SamplingParams(), max_new_tokens=max_new)
  np.testing.assert_array_equal(sp.tokens[:, :max_new], ar.tokens[:, :max_new])
  assert len(np.unique(np.asarray(ar.tokens))) > 5                   # not a degenerate repeat
  assert 0 < int(stats.accepted.sum()) < int(stats.proposed.sum())   # both paths taken
  np.testing.assert_array_equal(sp_ev.key_pos, ar_ev.key_pos)
  np.testing.assert_array_equal(sp_ev.scores, ar_ev.scores)
  assert np.all(np.asarray(ar_ev.num_live) == 12)                    # evicted down to budget


def test_speculative_under_eviction_needs_reuse_delay(tiny):
  config, params = tiny
  cache = cache_for(config, np.array([[1, 2]]), 3, 8)
  eviction = init_eviction(make_policy('h2o', 12, reuse_delay=2), cache)
  draft_cache, first = cache_for(config, np.array([[1, 2]]), 3, 8), jnp.asarray([5], jnp.int32)
  with pytest.raises(ValueError, match='reuse_delay >= K \\+ 1 = 4, got 2'):
    decode_speculative_evicting(config, config, params, params, cache, eviction, draft_cache,
                                first, jax.random.PRNGKey(1), jnp.zeros((0,), jnp.int32), k=3,
                                sampling=SamplingParams(), max_new_tokens=8)


def test_model_with_kernels_matches_references(tiny):
  """The whole model under H2O eviction with the Pallas kernels (interpret mode) gives the
  logits and eviction decisions of the jnp reference path."""
  config, params = tiny
  page_table = np.array([[1, 2]])                                     # 2 pages of 4 slots
  tokens = jnp.asarray(np.random.default_rng(3).integers(3, 64, size=(1, 11)), jnp.int32)
  policy = make_policy('h2o', 6)
  results = []
  for use_kernel in (False, True):
    cache = cache_for(config, page_table, 3, 4)
    eviction = init_eviction(policy, cache, use_kernel=use_kernel, interpret=True)
    logits = _logits_token_by_token(config, params, cache, eviction, tokens)
    results.append(np.asarray(logits))
  np.testing.assert_allclose(results[1], results[0], rtol=1e-4, atol=1e-4)


def test_scores_accumulate_attention_mass():
  """H2O scores sum the mass every query gave each key (each query spreads N = 4 query heads'
  worth: each of the 2 KV heads' mass already sums its G = 2 query heads);
  TOVA keeps only the last query's; h2o_norm divides by the queries that saw the key."""
  rng = np.random.default_rng(2)
  states = {}
  for kind in ('h2o', 'tova'):
    cache = init_cache(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=3, page_size=4,
                       page_table=np.array([[1, 2]]))
    state = init_eviction(make_policy(kind, 8), cache)
    for p in range(6):
      q = jnp.asarray(rng.normal(size=(1, 1, 4, 8)), jnp.float32)
      kv = jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32)
      _, cache, (key_pos, free_from, scores) = attend_and_evict(
          q, kv, kv, jnp.asarray([[p]], jnp.int32), cache, state, 0)
      state = state.replace(key_pos=key_pos[-1][None], free_from=free_from[-1][None],
                            scores=scores[-1][None])
    states[kind] = state
  np.testing.assert_allclose(states['h2o'].scores.sum(), 6 * 4, rtol=1e-5)
  np.testing.assert_allclose(states['tova'].scores.sum(), 4, rtol=1e-5)
  # The newest key has been seen by one query only; the first by all six.
  h2o = states['h2o']
  key_pos, scores = h2o.key_pos[0], h2o.scores[0]
  norm = priority(make_policy('h2o_norm', 8), scores, key_pos, jnp.asarray([6]))
  live = np.asarray(key_pos[0]) >= 0
  np.testing.assert_allclose(np.asarray(norm[0])[live],
                             np.asarray(scores[0])[live] / (6 - np.asarray(key_pos[0])[live]),
                             rtol=1e-6)


def test_padding_query_leaves_tova_scores():
  """A padding token (position -1, e.g. the tail of a shorter prompt in a batch) changes no
  slot, position or score, also under TOVA, whose scores are replaced by each real query's."""
  cache = init_cache(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=3, page_size=4,
                     page_table=np.array([[1, 2]]))
  state = init_eviction(make_policy('tova', 6), cache)
  rng = np.random.default_rng(4)
  for p in (0, 1, 2, -1):
    x = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
    before = state
    _, cache, (key_pos, free_from, scores) = attend_and_evict(
        x, x, x, jnp.asarray([[p]], jnp.int32), cache, state, 0)
    state = state.replace(key_pos=key_pos[-1][None], free_from=free_from[-1][None],
                          scores=scores[-1][None])
  for field in ('key_pos', 'free_from', 'scores'):
    np.testing.assert_array_equal(getattr(state, field), getattr(before, field))
  assert float(before.scores.sum()) > 0


@pytest.mark.parametrize('reuse_delay', [0, 1])
def test_model_keeps_each_layer0_key_at_its_own_position_under_eviction(tiny, reuse_delay):
  """Whole-model check of the bug class where cached keys end up rotated for the wrong position:
  after greedy decoding under H2O with a budget the sequence overflows, every kept layer-0 key
  equals the key a full-cache forward pass computes at the position the slot records (layer 0's
  keys depend only on the token and its position, so the two must agree). Row 1 stops early on
  its own stop token: a finished row's later steps (at reuse_delay 0 they wrote the pending
  token over the victim's slot) must leave its cache as it was."""
  config, params = tiny
  page, prompts = 8, [[5, 9, 14, 3, 22], [7, 40, 2, 11, 30, 8, 19, 33, 4, 25, 61, 6, 17]]
  policy = make_policy('h2o', 12, reuse_delay=reuse_delay)
  per = pages_needed(policy.slots, page)
  tokens = np.zeros((2, 16), np.int32)
  for row, p in enumerate(prompts):
    tokens[row, :len(p)] = p
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)

  def decode(stop):
    cache = cache_for(config, np.arange(1, 1 + 2 * per).reshape(2, per), 1 + 2 * per, page)
    first, cache, state = prefill_evicting(config, params, cache, init_eviction(policy, cache),
                                           jnp.asarray(tokens), lengths, jax.random.PRNGKey(0),
                                           sampling=SamplingParams())
    return decode_autoregressive_evicting(
        config, params, cache, state, first, jax.random.PRNGKey(1), jnp.asarray(stop, jnp.int32),
        sampling=SamplingParams(), max_new_tokens=24)

  free = np.asarray(decode([[-1], [-1]])[0].tokens[1, :24]).tolist()
  stop_at = next(i for i in range(4, 24) if free[i] not in free[:i])     # row 1's first new id
  out, cache, state = decode([[-1], [free[stop_at]]])
  assert int(out.num_tokens[1]) == stop_at + 1 < int(out.num_tokens[0])
  seqs = [(p + np.asarray(out.tokens[row, :int(out.num_tokens[row])]).tolist())
          [:int(cache.lengths[row])] for row, p in enumerate(prompts)]
  width = max(map(len, seqs))
  toks = np.zeros((2, width), np.int32)
  pos = np.full((2, width), -1, np.int32)
  for row, seq in enumerate(seqs):
    toks[row, :len(seq)], pos[row, :len(seq)] = seq, np.arange(len(seq))
  full_per = pages_needed(width, page)
  full = cache_for(config, np.arange(1, 1 + 2 * full_per).reshape(2, full_per), 1 + 2 * full_per,
                   page)
  _, full = Transformer(config).apply(params, jnp.asarray(toks), jnp.asarray(pos), full)

  def key(c, row, slot):
    return np.asarray(c.k_pages[0, :, int(c.page_table[row, slot // page]), slot % page])

  key_pos = np.asarray(state.key_pos)
  for row, seq in enumerate(seqs):
    kept = np.nonzero(key_pos[0, row] >= 0)[0]
    assert len(seq) > 12 and len(kept) == 12               # the budget was overflowed and held
    assert sorted(key_pos[0, row, kept]) == sorted(set(key_pos[0, row, kept]))
    for slot in kept:
      np.testing.assert_allclose(key(cache, row, slot), key(full, row, key_pos[0, row, slot]),
                                 rtol=1e-5, atol=1e-5)
