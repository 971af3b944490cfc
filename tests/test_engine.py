"""The continuous-batching engine: greedy outputs equal each request decoded alone (with and
without speculation, with preemption), page accounting, stop tokens, bad input, compile counts."""

import collections
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import ContextOverflowError, SamplingParams, cut_lengths, generate, prefill
from jaxspec.engine import Engine, State, compile_counts
from jaxspec.models import cache_for

L = 8          # page size
M = 24         # longest max_tokens in these tests
K = 3
SHAPES = dict(num_slots=3, page_size=L, chunk_size=8)   # shared so the tests share compiles
BIG, SMALL = 64, 12                                     # pool sizes in pages


@pytest.fixture(scope='module')
def alone(tiny):
  """expected(prompt, max_tokens, stop): greedy output of the prompt decoded alone by `generate`
  (a greedy output with fewer tokens or a stop token is a prefix of the longest one)."""
  config, params = tiny

  @functools.lru_cache(maxsize=None)
  def free(prompt):
    return generate(config, params, [list(prompt)], max_new_tokens=M, page_size=L).tokens[0]

  def expected(prompt, max_tokens, stop=()):
    out = free(tuple(prompt))[:max_tokens]
    cut = [i for i, t in enumerate(out) if t in stop]
    return out[:cut[0] + 1] if cut else out

  return expected


def _prompts(lengths, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 64, size=n).tolist() for n in lengths]


def _engine(tiny, tiny_draft, k, num_pages, **kw):
  config, params = tiny
  spec = dict(draft=tiny_draft[0], draft_params=tiny_draft[1], k=k) if k else {}
  return Engine(config, params, num_pages=num_pages, **SHAPES, **spec, **kw)


def _check_pool(engine):
  """Every page is free, held by a running request, or cached; nothing else."""
  prefix = engine.prefix
  held = {p for r in engine.scheduler.running for p in r.handle.pages}
  assert prefix.num_held == len(held)
  assert not held & set(prefix.cached_pages())
  assert prefix.num_free + prefix.num_cached + len(held) == prefix.num_pages - 1


def _run_staggered(engine, requests, arrivals):
  """Add requests[i] = (prompt, max_tokens, stop) at step arrivals[i]; run until idle."""
  ids, step = {}, 0
  while len(ids) < len(requests) or engine.has_unfinished():
    for i, (prompt, max_tokens, stop) in enumerate(requests):
      if arrivals[i] == step:
        ids[i] = engine.add_request(prompt, max_tokens=max_tokens, stop_tokens=stop)
    engine.step()
    _check_pool(engine)
    step += 1
    assert step < 500
  return [engine.outputs[ids[i]] for i in range(len(requests))]


@pytest.mark.parametrize('k', [0, K])
@pytest.mark.parametrize('num_pages,host_pages', [(BIG, 0), (SMALL, 0), (SMALL, 32)])
def test_greedy_every_request_equals_it_decoded_alone(tiny, tiny_draft, alone, k, num_pages,
                                                      host_pages):
  # Prompt lengths around page (8) and chunk (8) boundaries and longer than several chunks.
  lengths = [5, 8, 9, 17, 30, 3, 16, 24]
  prompts = _prompts(lengths, seed=1)
  prompts[6] = prompts[4][:16]                     # shares two full pages with prompt 4
  max_tokens = [M, 7, 1, 20, 12, M, 9, 15]
  requests = [(p, m, ()) for p, m in zip(prompts, max_tokens)]
  engine = _engine(tiny, tiny_draft, k, num_pages, host_pages=host_pages)
  outs = _run_staggered(engine, requests, arrivals=[0, 0, 1, 2, 2, 5, 9, 9])
  for (prompt, m, stop), out in zip(requests, outs):
    assert out.tokens == alone(prompt, m, stop)
    assert out.finish_reason == 'length' and out.metrics.num_tokens == len(out.tokens) == m
  preemptions = sum(o.metrics.preemptions for o in outs)
  if num_pages == SMALL:
    assert preemptions > 0                          # the tiny pool forced recomputation
  else:
    assert preemptions == 0
  if host_pages:
    assert engine.prefix.stats['demoted_pages'] > 0
  if k:
    assert 0 < sum(o.metrics.accepted for o in outs) < sum(o.metrics.proposed for o in outs)
  # Nothing leaked: every page is free or cached once the engine is idle.
  assert engine.prefix.num_held == 0
  assert engine.prefix.num_free + engine.prefix.num_cached == num_pages - 1


@pytest.mark.parametrize('host_pages,prefix_caching', [(0, True), (16, True), (0, False)])
def test_preempted_request_resumes_where_it_was(tiny, tiny_draft, alone, host_pages,
                                                 prefix_caching):
  engine = _engine(tiny, tiny_draft, K, BIG, host_pages=host_pages, prefix_caching=prefix_caching)
  prompts = _prompts([19, 11], seed=2)
  a = engine.add_request(prompts[0], max_tokens=M)
  b = engine.add_request(prompts[1], max_tokens=M)
  while len(engine._live[a].output) < 6:
    engine.step()
  request = engine._live[a]
  emitted = list(request.output)
  engine.scheduler.preempt(request)
  assert request.state is State.WAITING and request.handle is None
  if host_pages:  # its committed pages leave the device for the host tier before it returns
    engine._apply_plan(engine.prefix.reclaim(engine.prefix.num_cached))
    assert engine.prefix.stats['demoted_pages'] > 0
  outs = engine.run()
  assert outs[a].tokens[:len(emitted)] == emitted
  assert outs[a].tokens == alone(prompts[0], M)
  assert outs[b].tokens == alone(prompts[1], M)
  m = outs[a].metrics
  assert m.preemptions == 1
  # The readmission found its committed full pages (prompt + output but the pending token).
  if prefix_caching:
    assert m.cached_tokens == (len(prompts[0]) + len(emitted) - 1) // L * L > 0
  else:
    assert m.cached_tokens == 0
    assert m.prefill_tokens == 2 * len(prompts[0]) + len(emitted) - 1   # all recomputed
  assert m.num_tokens == M and sum(m.accepted_lengths) == M - 1
  if host_pages:  # ... and come back from it as hits
    assert engine.prefix.stats['promoted_pages'] * L == m.cached_tokens


def test_stop_token_inside_accepted_run_ends_only_that_request(tiny, alone):
  config, params = tiny
  prompts = _prompts([13, 10, 21], seed=3)
  free = alone(prompts[0], M)
  # With the target as its own draft every proposal is accepted: rounds emit K + 1 tokens
  # (indices 1..4, 5..8, ...). Pick a stop token first seen at a non-bonus index of a round.
  index = next(i for i in range(5, M) if free.index(free[i]) == i and (i - 1) % (K + 1) < K)
  stop = free[index]
  engine = Engine(config, params, num_pages=BIG, draft=config, draft_params=params, k=K,
                  **SHAPES)
  ids = [engine.add_request(prompts[0], max_tokens=M, stop_tokens=[stop]),
         engine.add_request(prompts[1], max_tokens=M),
         engine.add_request(prompts[2], max_tokens=M, stop_tokens=[63 if stop != 63 else 62])]
  outs = engine.run()
  assert outs[ids[0]].tokens == free[:index + 1] and outs[ids[0]].finish_reason == 'stop'
  for i in (1, 2):
    stops = (63 if stop != 63 else 62,) if i == 2 else ()
    assert outs[ids[i]].tokens == alone(prompts[i], M, stops)
  m = outs[ids[0]].metrics
  # Metrics count emitted tokens only: the cut round's tokens past the stop are not counted.
  assert m.num_tokens == index + 1 and sum(m.accepted_lengths) == index
  assert m.accepted_lengths[-1] < K + 1
  assert m.accepted == sum(min(e, K) for e in m.accepted_lengths)
  # Proposals past the stop were never in reach: the cut round counts its emitted tokens only,
  # so a draft equal to the target reads α = 1 on the stopped request too.
  assert m.proposed == K * (len(m.accepted_lengths) - 1) + m.accepted_lengths[-1]
  assert m.acceptance_rate == 1.0 and outs[ids[1]].metrics.acceptance_rate == 1.0


@pytest.mark.parametrize('max_tokens', [6, 7, 8, 9])
def test_a_max_tokens_cut_does_not_count_proposals_out_of_reach(tiny, max_tokens):
  # A self-draft accepts everything; the last round, cut by max_tokens, must not count the
  # proposals past the limit as proposed (it read 4/6 at max_tokens 6, K = 3).
  config, params = tiny
  engine = Engine(config, params, num_pages=BIG, draft=config, draft_params=params, k=K,
                  **SHAPES)
  rid = engine.add_request(_prompts([4], seed=9)[0], max_tokens=max_tokens)
  m = engine.run()[rid].metrics
  assert m.num_tokens == max_tokens
  assert (m.accepted_lengths[-1] < K + 1) == (max_tokens < 9)      # 9 = 1 + two full rounds
  assert m.accepted == sum(min(e, K) for e in m.accepted_lengths)
  assert m.proposed == m.accepted and m.acceptance_rate == 1.0


def test_sampled_self_draft_accepts_everything_and_is_seeded(tiny):
  # Draft = target at temperature 1: q equals p exactly (exact-verify numerics), so every
  # proposal of every row is accepted; a row mix-up between draft and verify would reject.
  config, params = tiny
  prompts = _prompts([6, 19, 11, 27], seed=5)

  def run(seed):
    engine = Engine(config, params, num_pages=BIG, draft=config, draft_params=params, k=K,
                    sampling=SamplingParams(temperature=1.0), seed=seed, **SHAPES)
    ids = [engine.add_request(p, max_tokens=M) for p in prompts]
    outs = engine.run()
    return [outs[i] for i in ids]

  first, again, other = run(0), run(0), run(1)
  assert all(o.metrics.acceptance_rate == 1.0 and len(o.tokens) == M for o in first)
  assert [o.tokens for o in first] == [o.tokens for o in again]
  assert [o.tokens for o in first] != [o.tokens for o in other]


def test_bad_input_fails_that_request_only(tiny, alone):
  config, params = tiny
  engine = Engine(config, params, num_pages=SMALL, **SHAPES)
  good = _prompts([12, 7], seed=4)
  first = engine.add_request(good[0], max_tokens=10)
  engine.step()
  bad = [
      (dict(prompt_tokens=[3 + i % 50 for i in range(250)], max_tokens=10), 'exceeds the context'),
      (dict(prompt_tokens=good[1], max_tokens=0),
       'request 2: max_tokens must be an int >= 1, got 0'),
      (dict(prompt_tokens=good[1], max_tokens=5, stop_tokens=[64]), 'stop token id 64'),
      (dict(prompt_tokens=[], max_tokens=5), 'is empty'),
      (dict(prompt_tokens=[3, 99], max_tokens=5), 'token id 99'),
      (dict(prompt_tokens=good[1], max_tokens=5, stop_tokens=list(range(9))), 'max_stop_tokens'),
      (dict(prompt_tokens=good[1], max_tokens=100), 'needs 14 pages, the pool has 11'),
      (dict(prompt_tokens=good[1], max_tokens=5, request_id=first), 'already in use'),
      (dict(prompt_tokens=good[1], max_tokens=5, request_id=float('nan')),
       'request id nan does not equal itself'),
      (dict(prompt_tokens=good[1], max_tokens=5, stop_tokens=[2.5]),
       'stop token ids must be ints, got 2.5'),
      (dict(prompt_tokens=b'\x05\x06\x07', max_tokens=5), 'got bytes .text. encode it first'),
      (dict(prompt_tokens={5, 6, 7}, max_tokens=5),
       'must be a list, tuple or 1-D array .* got set'),
      (dict(prompt_tokens={5: 'a'}, max_tokens=5), 'got dict'),
      (dict(prompt_tokens=(t for t in good[1]), max_tokens=5), 'got generator'),
  ]
  for kwargs, message in bad:
    with pytest.raises(ValueError, match=message) as raised:
      engine.add_request(**kwargs)
    # A prompt past the context, and only that, is the typed ContextOverflowError.
    assert isinstance(raised.value, ContextOverflowError) == (message == 'exceeds the context')
    engine.step()                                   # the engine keeps serving
  second = engine.add_request(good[1], max_tokens=10, request_id='second')
  engine.run()
  assert set(engine.outputs) == {first, 'second'}
  assert engine.outputs[first].tokens == alone(good[0], 10)
  assert engine.outputs[second].tokens == alone(good[1], 10)


def test_bad_engine_arguments(tiny, tiny_draft):
  config, params = tiny
  with pytest.raises(ValueError, match="prefix_caching must be True or False, got 'off'"):
    Engine(config, params, num_slots=2, num_pages=8, prefix_caching='off')
  with pytest.raises(ValueError, match='host_pages=4 needs prefix caching on'):
    Engine(config, params, num_slots=2, num_pages=8, host_pages=4, prefix_caching=False)
  for seed in (1.5, 2 ** 70, True):
    with pytest.raises(ValueError, match=f'seed must be a 64-bit int, got {seed!r}'):
      Engine(config, params, num_slots=2, num_pages=8, seed=seed)
  with pytest.raises(ValueError, match='k=3'):
    Engine(config, params, num_slots=2, num_pages=8, k=3)
  with pytest.raises(ValueError, match='k=0'):
    Engine(config, params, num_slots=2, num_pages=8, draft=config, draft_params=params)
  with pytest.raises(ValueError, match='num_slots'):
    Engine(config, params, num_slots=0, num_pages=8)
  with pytest.raises(ValueError, match='prefill_rows=3'):
    Engine(config, params, num_slots=2, num_pages=8, prefill_rows=3)
  with pytest.raises(ValueError, match='max_seq_len=300'):
    Engine(config, params, num_slots=2, num_pages=8, max_seq_len=300)
  short = Engine(config, params, num_slots=2, num_pages=64, max_seq_len=64)
  with pytest.raises(ContextOverflowError,
                     match="request 0: .* = 65 exceeds the engine's max_seq_len=64"):
    short.add_request([5] * 60, max_tokens=4)
  assert short.add_request([5] * 59, max_tokens=4) == 1     # the refused request kept id 0


def test_numpy_integer_arguments_act_as_ints(tiny, tiny_draft, alone):
  # Sizes computed with numpy (a sweep's np.arange, a config read through np.int64) are ints.
  config, params = tiny
  engine = Engine(config, params, num_slots=np.int64(3), num_pages=np.int64(BIG),
                  page_size=np.int32(L), chunk_size=np.int64(8), draft=tiny_draft[0],
                  draft_params=tiny_draft[1], k=np.int64(K), seed=np.uint8(0))
  assert all(type(v) is int for v in (engine.num_slots, engine.chunk_size, engine.k))
  prompt = _prompts([9], seed=6)[0]
  rid = engine.add_request(np.asarray(prompt), max_tokens=np.int64(10))
  engine.run(max_steps=np.int32(100))
  assert engine.outputs[rid].tokens == alone(prompt, 10)
  assert engine.outputs[rid].metrics.num_tokens == 10


def test_a_chunk_past_the_context_is_taken_as_the_context(tiny, alone):
  # chunk_size=2**20 padded every prefill call to 2**20 tokens a row: 8.9 GB at this context.
  config, params = tiny
  engine = Engine(config, params, num_slots=1, num_pages=BIG, page_size=L,
                  chunk_size=2 ** 20, max_seq_len=48)
  assert engine.chunk_size == 48 and engine.scheduler.chunk_size == 48
  prompt = _prompts([9], seed=6)[0]
  rid = engine.add_request(prompt, max_tokens=6)
  assert engine.run()[rid].tokens == alone(prompt, 6)


@pytest.mark.parametrize('k,prefill_rows', [(0, 1), (K, None)])
def test_device_steps_compile_once_per_shape(tiny, tiny_draft, alone, k, prefill_rows):
  engine = _engine(tiny, tiny_draft, k, BIG, prefill_rows=prefill_rows, host_pages=4)
  engine.warm_up()
  before = compile_counts()
  requests = [(_prompts([n], seed=10 + i)[0], 3 + 2 * i, (i + 3,))   # new lengths, max tokens,
              for i, n in enumerate([1, 7, 8, 9, 23, 40])]          # stop ids
  ids = [engine.add_request(p, max_tokens=m, stop_tokens=s) for p, m, s in requests]
  engine.step()
  requests.append((_prompts([33], seed=20)[0], M, ()))
  ids.append(engine.add_request(requests[-1][0], max_tokens=M))
  engine.run()
  for i, (prompt, m, stop) in zip(ids, requests):
    assert engine.outputs[i].tokens == alone(prompt, m, stop)
  assert compile_counts() == before


def test_prefill_rows_without_new_tokens_write_nothing(tiny):
  # The engine binds idle rows to the null page; `prefill` itself also treats a row with zero
  # new tokens as padding: its pages and length stay as they were.
  config, params = tiny
  cache = cache_for(config, np.array([[1, 2], [3, 4]]), 5, L)
  tokens = jnp.asarray(_prompts([L, L], seed=6), jnp.int32)
  rng = jax.random.PRNGKey(0)
  _, cache = prefill(config, params, cache, tokens, jnp.array([0, 6]), rng,
                     sampling=SamplingParams())
  live = np.asarray(cache.k_pages[:, :, 3:5]).copy(), np.asarray(cache.v_pages[:, :, 3:5]).copy()
  _, cache = prefill(config, params, cache, tokens, jnp.array([5, 0]), rng,
                     sampling=SamplingParams())
  assert cache.lengths.tolist() == [5, 6]
  np.testing.assert_array_equal(np.asarray(cache.k_pages[:, :, 3:5]), live[0])
  np.testing.assert_array_equal(np.asarray(cache.v_pages[:, :, 3:5]), live[1])


COVERAGE = collections.Counter()


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 16), st.integers(0, 6),
                                     st.booleans()), min_size=1, max_size=7),
                  st.integers(0, 2 ** 31 - 1))
def test_no_page_leaks_or_double_frees_under_random_requests(tiny, tiny_draft, spec, seed):
  engine = _engine(tiny, tiny_draft, K, SMALL, host_pages=8)
  rng = np.random.default_rng(seed)
  requests = [(rng.integers(3, 64, size=n).tolist(), m, (int(rng.integers(3, 64)),) if s else ())
              for n, m, _, s in spec]
  outs = _run_staggered(engine, requests, arrivals=[a for _, _, a, _ in spec])
  COVERAGE['preemptions'] += engine.scheduler.num_preemptions
  COVERAGE['stops'] += sum(o.finish_reason == 'stop' for o in outs)
  for (prompt, m, stop), out in zip(requests, outs):
    assert 1 <= len(out.tokens) <= m
    if out.finish_reason == 'stop':
      assert out.tokens[-1] in stop and not set(out.tokens[:-1]) & set(stop)
    else:
      assert len(out.tokens) == m and not set(out.tokens) & set(stop)
  prefix = engine.prefix
  assert prefix.num_held == 0 and not engine.scheduler.waiting
  assert prefix.num_free + prefix.num_cached == prefix.num_pages - 1
  # Reference counts: free pages 0, cached pages exactly the index's own reference.
  refs = [prefix.allocator.ref_count(p) for p in range(1, prefix.num_pages)]
  cached = set(prefix.cached_pages())
  assert all(r == (1 if p in cached else 0) for p, r in zip(range(1, prefix.num_pages), refs))


def test_random_requests_reach_preemption_and_stops():
  """The property test above is not vacuous: its examples preempted and stopped."""
  if not COVERAGE:
    pytest.skip('run together with the property test')
  assert COVERAGE['preemptions'] > 0 and COVERAGE['stops'] > 0, COVERAGE


def test_cut_lengths_per_row_stops_and_room():
  window = jnp.array([[5, 7, 9], [7, 5, 5], [4, 4, 7]], jnp.int32)
  stop = jnp.array([[7, -1], [-1, -1], [7, 4]], jnp.int32)          # per row, -1 pads
  n, stopped = cut_lengths(window, jnp.array([3, 2, 3]), stop, jnp.array([5, 1, 3]))
  assert n.tolist() == [2, 1, 1] and stopped.tolist() == [True, False, True]
  # A stop id past a row's real candidates does not count; the shared [S] form agrees.
  n, stopped = cut_lengths(window, jnp.array([1, 3, 3]), jnp.array([7]), jnp.array([5, 5, 5]))
  assert n.tolist() == [1, 1, 3] and stopped.tolist() == [False, True, True]


@pytest.mark.parametrize('prefill_rows,buckets', [(1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)),
                                                  (6, (1, 2, 4, 6))])
def test_prefill_calls_use_the_smallest_row_bucket(tiny, prefill_rows, buckets, monkeypatch):
  config, params = tiny
  engine = Engine(config, params, num_slots=8, num_pages=BIG, page_size=L, chunk_size=8,
                  prefill_rows=prefill_rows)
  assert engine.prefill_buckets == buckets
  widths = []
  call = engine._call_prefill
  monkeypatch.setattr(engine, '_call_prefill',
                      lambda table, *a: widths.append(len(table)) or call(table, *a))
  engine.add_request(_prompts([5], seed=30)[0], max_tokens=2)
  engine.step()                                        # a lone admission: one row
  assert widths == [1]


def test_request_metrics_repr_shows_ttft_tpot_and_acceptance():
  from jaxspec.engine.request import RequestMetrics  # pylint: disable=import-outside-toplevel
  m = RequestMetrics(arrival_s=1.0, first_token_s=1.5, finish_s=2.5, num_tokens=5, proposed=4,
                     accepted=3, accepted_lengths=[2, 3])
  assert repr(m).startswith('RequestMetrics(ttft_s=0.5, tpot_s=0.25, acceptance_rate=0.75, '
                            'mean_accepted_length=2.5, num_tokens=5,')
