"""The evicting engine: greedy outputs equal each request decoded alone by the evicting loops
(staggered arrivals, prompts longer than the budget, a forced preemption), a budget covering the
whole sequence equals the plain engine, fixed page accounting and more requests at once than the
plain engine in the same pages, the Pallas kernels in the engine, bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import init_eviction, make_policy, pages_needed
from jaxspec.decoding import SamplingParams
from jaxspec.decoding.evicting import decode_autoregressive_evicting, prefill_evicting
from jaxspec.engine import Engine, EvictingEngine, FixedK, GoodputK, ScheduleK, State
from jaxspec.engine.device_evicting import compile_counts
from jaxspec.models import cache_for
from test_engine import _check_pool, _prompts, _run_staggered

L = 8            # page size
M = 24           # longest max_tokens in these tests
P_MAX = 48       # longest prompt in these tests
BUDGET = 12      # live tokens per request and layer: 2 pages
SHAPES = dict(num_slots=4, num_pages=9, page_size=L, chunk_size=8)   # 8 usable pages


@pytest.fixture(scope='module')
def alone(tiny):
  """expected(policy, prompt, max_tokens): the greedy output of the prompt decoded alone (batch
  1) by `prefill_evicting` + `decode_autoregressive_evicting` under `policy`, with a cache of
  ceil(policy.slots / L) pages as the engine gives a long request. Prompts are right-padded to
  P_MAX (padding changes no eviction state) and decoded for M tokens, so each policy compiles
  once; a greedy output with fewer max_tokens is a prefix of the longest one."""
  config, params = tiny

  @functools.lru_cache(maxsize=None)
  def free(policy, prompt):
    per = pages_needed(policy.slots, L)
    cache = cache_for(config, np.arange(1, 1 + per)[None], 1 + per, L)
    tokens = np.zeros((1, P_MAX), np.int32)
    tokens[0, :len(prompt)] = prompt
    first, cache, eviction = prefill_evicting(
        config, params, cache, init_eviction(policy, cache), jnp.asarray(tokens),
        jnp.asarray([len(prompt)], jnp.int32), jax.random.PRNGKey(0), sampling=SamplingParams())
    out, _, _ = decode_autoregressive_evicting(
        config, params, cache, eviction, first, jax.random.PRNGKey(1), jnp.zeros((0,), jnp.int32),
        sampling=SamplingParams(), max_new_tokens=M)
    return np.asarray(out.tokens[0, :int(out.num_tokens[0])]).tolist()

  return lambda policy, prompt, max_tokens: free(policy, tuple(prompt))[:max_tokens]


def _check_fixed_pages(engine):
  """Every admitted request holds min(ceil(span / L), ceil(slots / L)) pages, span = prompt +
  max_tokens + K + 1 (`Engine.window`), from admission on: nothing grows."""
  for r in engine.scheduler.running:
    span = len(r.prompt) + r.max_tokens + engine.window
    assert len(r.handle.pages) == min(pages_needed(span, L), engine.request_pages)


@pytest.mark.parametrize('kind', ['h2o', 'sinks'])
def test_greedy_every_request_equals_it_decoded_alone_under_eviction(tiny, alone, kind):
  config, params = tiny
  policy = make_policy(kind, BUDGET)
  # Prompts shorter than, around and far past the budget (12) and the chunk (8).
  lengths = [5, 30, 9, 41, 17, 48, 12]
  prompts = _prompts(lengths, seed=1)
  max_tokens = [M, 12, 20, 7, M, 15, 1]
  requests = [(p, m, ()) for p, m in zip(prompts, max_tokens)]
  engine = EvictingEngine(config, params, policy=policy, **SHAPES)
  engine.warm_up()
  before = compile_counts()
  checked = []
  original_step = engine.step

  def step():                        # check the page accounting after every step
    out = original_step()
    _check_fixed_pages(engine)
    checked.append(len(engine.scheduler.running))
    return out

  engine.step = step
  outs = _run_staggered(engine, requests, arrivals=[0, 0, 1, 2, 2, 5, 9])
  for (prompt, m, _), out in zip(requests, outs):
    assert out.tokens == alone(policy, prompt, m), (kind, len(prompt), m)
    assert out.finish_reason == 'length' and len(out.tokens) == m
  assert max(checked) == SHAPES['num_slots']     # the pool (8 pages, 2 a request) held all four
  assert compile_counts() == before             # new lengths compiled nothing new
  assert engine.prefix.num_held == 0 and engine.prefix.num_free == SHAPES['num_pages'] - 1


def test_preempted_request_resumes_exactly_under_eviction(tiny, alone):
  """Preemption by recomputation: prefilling prompt + output again retraces the eviction
  decisions, so the output continues exactly (also with a pool that queues requests); a stop
  token ends only its own request."""
  config, params = tiny
  policy = make_policy('h2o', BUDGET)
  engine = EvictingEngine(config, params, policy=policy, **SHAPES)
  prompts = _prompts([37, 11, 26, 44, 20], seed=2)
  # Request 1 stops at a token first seen at index >= 3 of its output; the others run to M.
  free = alone(policy, prompts[1], M)
  index = next(i for i in range(3, M) if free.index(free[i]) == i)
  stops = [(), (free[index],), (), (), ()]
  ids = [engine.add_request(p, max_tokens=M, stop_tokens=s)      # 5 requests, 4 fit at once
         for p, s in zip(prompts, stops)]
  a = ids[0]
  while len(engine._live[a].output) < 9:                           # past the budget by now
    engine.step()
  request = engine._live[a]
  emitted = list(request.output)
  engine.scheduler.preempt(request)
  assert request.state is State.WAITING and request.handle is None
  engine.run()
  outs = engine.outputs                         # request 1 may have stopped before run()
  assert outs[a].tokens[:len(emitted)] == emitted
  for i, p, stop in zip(ids, prompts, stops):
    if stop:
      assert outs[i].tokens == free[:index + 1] and outs[i].finish_reason == 'stop'
    else:
      assert outs[i].tokens == alone(policy, p, M) and outs[i].finish_reason == 'length'
  m = outs[a].metrics
  assert m.preemptions == 1 and engine.scheduler.num_preemptions == 1
  assert m.prefill_tokens == 2 * len(prompts[0]) + len(emitted) - 1    # all recomputed
  assert m.cached_tokens == 0
  assert engine.prefix.num_held == 0 and engine.prefix.num_free == SHAPES['num_pages'] - 1


def test_per_request_sampling_under_eviction(tiny, alone):
  """A sampled request (temperature 1) beside greedy ones: the greedy ones still equal their
  evicting decode alone, the sampled one differs from greedy, and a seed repeats it."""
  config, params = tiny
  policy = make_policy('h2o', BUDGET)
  prompts = _prompts([33, 21, 40], seed=6)

  def run(seed):
    engine = EvictingEngine(config, params, policy=policy, seed=seed, **SHAPES)
    ids = [engine.add_request(p, max_tokens=M, sampling=SamplingParams(temperature=1.0) if i == 1
                              else None) for i, p in enumerate(prompts)]
    outs = engine.run()
    return [outs[i].tokens for i in ids]

  first, again = run(0), run(0)
  assert first == again
  assert first[0] == alone(policy, prompts[0], M) and first[2] == alone(policy, prompts[2], M)
  assert first[1] != alone(policy, prompts[1], M) and len(first[1]) == M


def test_pallas_kernels_in_the_engine_match_decoding_alone(tiny, alone):
  """use_kernel=True: selection and attention by the Pallas kernels (interpret mode on CPU)."""
  config, params = tiny
  policy = make_policy('h2o', BUDGET)
  engine = EvictingEngine(config, params, policy=policy, use_kernel=True, interpret=True, **SHAPES)
  prompts = _prompts([30, 19], seed=5)
  ids = [engine.add_request(p, max_tokens=16) for p in prompts]
  outs = engine.run()
  for i, p in zip(ids, prompts):
    assert outs[i].tokens == alone(policy, p, 16)


def test_budget_covering_the_sequence_equals_the_plain_engine(tiny):
  config, params = tiny
  prompts = _prompts([5, 30, 17, 40, 9], seed=3)
  max_tokens = [M, 20, 11, 22, 16]           # every span <= 63 tokens < budget 64
  plain = Engine(config, params, max_seq_len=64, prefix_caching=False, **SHAPES)
  evicting = EvictingEngine(config, params, policy=make_policy('h2o', 64), **SHAPES)
  assert evicting.request_pages == plain.pages_per_seq == 8     # same attention width
  outs = []
  for engine in (plain, evicting):
    ids = [engine.add_request(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
    result = engine.run()
    outs.append([result[i].tokens for i in ids])
  assert outs[1] == outs[0]
  assert [len(t) for t in outs[0]] == max_tokens


def test_more_requests_run_at_once_than_plain_in_the_same_pages(tiny):
  """Same 8 usable pages, long prompts (40 tokens + 16 new): the plain engine holds ~6-7 pages
  per request and runs one at a time; under a budget of 12 (2 pages) four run at once."""
  config, params = tiny
  prompts = _prompts([40, 39, 40, 38, 40, 37], seed=4)
  concurrency = {}
  for name in ('plain', 'evicting'):
    if name == 'plain':
      engine = Engine(config, params, max_seq_len=64, prefix_caching=False, **SHAPES)
    else:
      engine = EvictingEngine(config, params, policy=make_policy('h2o', BUDGET), **SHAPES)
    ids = [engine.add_request(p, max_tokens=16) for p in prompts]
    running = []
    while engine.has_unfinished():
      engine.step()
      _check_pool(engine)
      running.append(len(engine.scheduler.running))
      assert len(running) < 400
    assert all(len(engine.outputs[i].tokens) == 16 for i in ids)
    assert engine.prefix.num_held == 0
    concurrency[name] = (max(running), float(np.mean(running)))
  assert concurrency['plain'][0] == 1 and concurrency['evicting'][0] == 4, concurrency
  assert concurrency['evicting'][1] > 2 * concurrency['plain'][1], concurrency


def test_fixed_k_instance_means_no_speculation_as_in_the_plain_engine(tiny, alone):
  """k_policy=FixedK() at K = 0 is what 'fixed' is: no K policy, no drafter, the policy left
  unbound (as `Engine` leaves it), and the same greedy outputs."""
  config, params = tiny
  policy = make_policy('h2o', BUDGET)
  fixed = FixedK()
  engine = EvictingEngine(config, params, policy=policy, k_policy=fixed, **SHAPES)
  plain = Engine(config, params, k_policy=FixedK(), **SHAPES)
  assert engine.policy is None and engine.drafter is None and fixed.k_max is None
  assert plain.policy is None and plain.drafter is None
  prompts = _prompts([20, 14], seed=8)
  ids = [engine.add_request(p, max_tokens=8) for p in prompts]
  outs = engine.run()
  for i, p in zip(ids, prompts):
    assert outs[i].tokens == alone(policy, p, 8)


def test_numpy_sizes_act_as_ints_under_eviction(tiny, alone):
  config, params = tiny
  policy = make_policy('h2o', np.array(BUDGET))                  # a 0-d array budget
  assert policy == make_policy('h2o', BUDGET)                     # the same defaults (window)
  engine = EvictingEngine(config, params, policy=policy, num_slots=np.int64(4),
                          num_pages=np.array(9), page_size=np.int32(L), chunk_size=np.int64(8))
  assert type(engine.scheduler.num_slots) is int and engine.decode_buckets == (4,)
  prompt = _prompts([20], seed=9)[0]
  rid = engine.add_request(prompt, max_tokens=np.int64(8))
  assert engine.run()[rid].tokens == alone(policy, prompt, 8)


def test_bad_evicting_engine_arguments(tiny):
  config, params = tiny
  policy = make_policy('h2o', BUDGET)
  bad = [
      (dict(k=2, draft=config, draft_params=params), 'fixed K only.*k=2, draft=a model'),
      (dict(drafter='ngram'), 'needs the speculation length k >= 1'),
      (dict(k_policy='goodput'), "fixed K only.*k_policy='goodput'"),
      (dict(k_policy='schedule'), "fixed K only.*k_policy='schedule'"),
      (dict(k_policy=ScheduleK()), 'fixed K only.*k_policy=<.*ScheduleK'),
      (dict(k_policy=GoodputK()), 'fixed K only.*k_policy=<.*GoodputK'),
      (dict(k_policy=FixedK), "fixed K only.*k_policy=<class .*FixedK'>"),   # the class itself
      (dict(k_policy='Fixed'), "fixed K only.*k_policy='Fixed'"),
      (dict(prefix_caching=True), 'prefix_caching=True'),
      (dict(host_pages=4), 'host_pages=4'),
      (dict(prefill_rows=2), 'prefill_rows=2 must equal num_slots=4'),
      (dict(decode_buckets=(1, 4)), r'decode_buckets=\(1, 4\) must be None or \(num_slots,\)'),
      (dict(decode_buckets=4), 'decode_buckets=4 must be None'),
      (dict(policy=make_policy('h2o', 80)), 'needs 10 pages of 8 per request.* = 8'),
      (dict(policy=make_policy('full')), "policy 'full' has no budget"),
      (dict(policy='h2o'), "policy must be an EvictionPolicy.*'h2o'"),
      (dict(num_slots=0), 'num_slots must be an int >= 1, got 0'),
      (dict(prefill_group=3), 'prefill_group must be an int >= 1 dividing chunk_size=8, got 3'),
  ]
  for kwargs, message in bad:
    args = dict(SHAPES, policy=policy)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
      EvictingEngine(config, params, **args)
  engine = EvictingEngine(config, params, policy=policy, max_seq_len=64, **SHAPES)
  with pytest.raises(ValueError, match="request 0: .* = 65 exceeds the engine's max_seq_len=64"):
    engine.add_request([5] * 60, max_tokens=4)      # positions stay bounded by max_seq_len
  assert engine.add_request([5] * 59, max_tokens=4) == 1    # far past the budget: accepted


def test_eviction_batching_metrics_and_memory():
  """The experiment's quality metrics and pool sizing (configs/eviction_batching.py)."""
  from configs.eviction_batching import get_config
  from experiments.eviction_batching import match, memory, validate
  exact, prefix = match([[1, 2, 3, 4], [1, 5, 3, 4], [9, 9, 9, 9]],
                        [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
  assert exact == pytest.approx(1 / 3) and prefix == pytest.approx((1 + 0.25 + 0) / 3)
  config = get_config()
  mem = memory(config)
  # 384 + 128 + 1 = 513 tokens = 33 pages of 16; 4 whole requests + the null page; prompt + 1 =
  # 385 tokens = 25 pages, so the pool admits 5 at once on prompt pages.
  assert mem == dict(span=513, num_pages=133, plain_slots=5, max_seq_len=528)
  # A prompt-lookup twin's request spans 513 + K: at K = 16 that is 34 pages, and with one
  # request of memory the pool (sized at K = 0) could never admit it (found after compiling).
  config.lookup_k, config.memory_requests = 16, 1
  assert memory(config) == dict(span=513, num_pages=35, plain_slots=1, max_seq_len=544)
  config = get_config()
  config.max_tokens = 0
  with pytest.raises(ValueError, match='config.max_tokens must be >= 1, got 0'):
    memory(config)
  config = get_config()
  for bad in (-1, 17):
    config.lookup_k = bad
    with pytest.raises(ValueError, match=rf'config.lookup_k must be in \[0, 16\], got {bad}'):
      validate(config)                  # before any model loads
  for field, bad, message in [('policies', 'window,full', "config.policies names 'full'"),
                              ('budgets', '64,0', 'config.budgets must list ints >= 1'),
                              ('budgets', '100000', 'budget 100000 .* more than the pool')]:
    config = get_config()
    config[field] = bad
    with pytest.raises(ValueError, match=message):
      validate(config)


def test_a_model_with_a_sliding_window_is_refused_under_eviction(tiny):
  # attend_and_evict masks kept slots by causality only: a Mistral window was dropped silently
  # (policy 'full' gave logits 2.6 away from the model's own on 16 tokens with a window of 4).
  config, params = tiny
  windowed = dataclasses.replace(config, sliding_window=4)
  message = r'sliding_window=4 < max_seq_len=256: eviction does not apply a window'
  with pytest.raises(ValueError, match=message):
    EvictingEngine(windowed, params, policy=make_policy('h2o', BUDGET), **SHAPES)
  # A window as long as the context masks nothing (Mistral's 4096 loaded at <= 4096 tokens).
  EvictingEngine(dataclasses.replace(config, sliding_window=config.max_seq_len), params,
                 policy=make_policy('h2o', BUDGET), **SHAPES)
  cache = cache_for(windowed, np.arange(1, 4)[None], 4, L)
  tokens = jnp.ones((1, 8), jnp.int32)
  for policy in (make_policy('full'), make_policy('h2o', BUDGET)):
    with pytest.raises(ValueError, match=message):
      prefill_evicting(windowed, params, cache, init_eviction(policy, cache), tokens,
                       jnp.asarray([8], jnp.int32), jax.random.PRNGKey(0),
                       sampling=SamplingParams())


def test_a_chunk_past_the_context_stays_a_multiple_of_the_prefill_group(tiny):
  """Engine takes a chunk past max_seq_len as max_seq_len; under eviction it is rounded up to a
  multiple of prefill_group (checked against the chunk the caller passed), and the scheduler
  gets the same chunk."""
  config, params = tiny
  policy = make_policy('h2o', BUDGET)
  shapes = dict(num_slots=1, num_pages=9, page_size=L)
  kept = EvictingEngine(config, params, policy=policy, chunk_size=64, prefill_group=8,
                        max_seq_len=60, **shapes)       # refused when checked against 60
  assert kept.chunk_size == kept.scheduler.chunk_size == 64 and kept.prefill_group == 8
  cut = EvictingEngine(config, params, policy=policy, chunk_size=2 ** 20, max_seq_len=48,
                       **shapes)
  assert cut.chunk_size == cut.scheduler.chunk_size == 48 and cut.prefill_group == 4
  with pytest.raises(ValueError, match='prefill_group must be an int >= 1 dividing '
                                       'chunk_size=64, got 6'):
    EvictingEngine(config, params, policy=policy, chunk_size=64, prefill_group=6, **shapes)
