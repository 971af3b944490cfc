"""Prompt lookup under eviction in the continuous-batching engine (`EvictingEngine` with
drafter='ngram' at a fixed K): greedy outputs equal each request decoded alone at K = 0 under the
same policy, with proposals accepted whole, in part and not at all, stop tokens inside an accepted
run, staggered arrivals and a forced preemption; sampled rounds follow the target's
distribution; the reuse-delay rule and the refusals."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.cache import init_eviction, make_policy, pages_needed
from jaxspec.decoding import SamplingParams
from jaxspec.decoding.evicting import prefill_evicting
from jaxspec.decoding.sampling import RowSampling, probabilities
from jaxspec.engine import EvictingEngine, NGramDrafter, State
from jaxspec.engine.device_evicting import compile_counts, lookup_round_evicting
from jaxspec.models import Transformer, cache_for
from test_engine import _prompts, _run_staggered
from test_engine_eviction import BUDGET, L, M, SHAPES, _check_fixed_pages, alone  # noqa: F401

K = 3


class OracleLookup(NGramDrafter):
  """Proposes each request's own greedy continuation (decoded alone beforehand), scripted per
  (request, output index) by a seeded draw: 0..K proposals (K most often), each replaced by a
  wrong token with probability `wrong`, so rounds propose fewer than K or none and accept all,
  some or none. Requests are recognised by their prompts; `log` keeps (proposed, correct
  leading proposals) per proposing row."""

  def __init__(self, references: dict, wrong: float):
    super().__init__()
    self.references, self.wrong, self.log = references, wrong, []

  def propose(self, contexts, caps, k):
    b = len(contexts)
    proposals, num = np.zeros((b, k), np.int32), np.zeros((b,), np.int32)
    for row, context in enumerate(contexts):
      if context is None or caps[row] <= 0:
        continue
      prompt, expected = next((p, e) for p, e in self.references.items()
                              if tuple(context[:len(p)]) == p)
      done = len(context) - len(prompt)
      draw = random.Random(1000 * len(prompt) + done)
      count = min(int(caps[row]), draw.choice([k, k, k, k - 1, 1, 0]))
      correct = None
      for j, token in enumerate(expected[done:done + count]):
        bad = draw.random() < self.wrong
        proposals[row, j] = (token + 1) % 64 if bad else token
        num[row] = j + 1
        correct = j if bad and correct is None else correct
      self.log.append((int(num[row]), int(num[row]) if correct is None else correct))
    return proposals, num


@pytest.mark.parametrize('kind', ['h2o', 'sinks'])
def test_lookup_under_eviction_equals_each_request_alone_at_k0(tiny, alone, kind):
  """Rounds proposing K, fewer or none and accepting all, some or none, prompts shorter than and
  far past the budget, a request short enough that its K + 1 slots of slack set its page count,
  staggered arrivals, one stop token: each output is the request decoded alone at K = 0 under
  the same policy (rejected proposals leave no trace in the eviction state: later tokens would
  differ)."""
  config, params = tiny
  policy = make_policy(kind, BUDGET, reuse_delay=K + 1)
  prompts = _prompts([5, 30, 9, 41, 17, 48, 3], seed=3)
  max_tokens = [M, 12, 20, 7, M, 15, 4]
  references = {tuple(p): alone(policy, p, M) for p in prompts}
  # Request 2 stops at a token first seen at output index >= 3 (inside a round, as likely as not).
  free = references[tuple(prompts[2])]
  index = next(i for i in range(3, M) if free.index(free[i]) == i)
  stops = [(), (), (free[index],), (), (), (), ()]
  drafter = OracleLookup(references, wrong=0.3)
  engine = EvictingEngine(config, params, policy=policy, k=K, drafter=drafter, **SHAPES)
  engine.warm_up()
  before = compile_counts()
  original_step = engine.step

  def step():
    out = original_step()
    _check_fixed_pages(engine)
    return out

  engine.step = step
  outs = _run_staggered(engine, list(zip(prompts, max_tokens, stops)), [0, 0, 1, 3, 3, 6, 6])
  for i, (p, m) in enumerate(zip(prompts, max_tokens)):
    if i == 2:
      assert outs[i].tokens == free[:index + 1] and outs[i].finish_reason == 'stop'
    else:
      assert outs[i].tokens == alone(policy, p, m) and outs[i].finish_reason == 'length'
  # The script proposed K, fewer and none, with the first proposal wrong, a later one, or none.
  assert {n for n, _ in drafter.log} == set(range(K + 1))
  assert {(n, c) for n, c in drafter.log if n} >= {(K, 0), (K, 1), (K, K)}
  lengths = [e for o in outs for e in o.metrics.accepted_lengths]
  assert K + 1 in lengths and 1 in lengths and 0 < sum(o.metrics.accepted for o in outs)
  assert engine.k_rounds[K] > 0 and set(engine.k_rounds) == {K}
  assert compile_counts() == before                   # one compile per shape, none per request
  assert engine.prefix.num_held == 0


def test_preempted_request_resumes_exactly_with_lookup_under_eviction(tiny, alone):
  config, params = tiny
  policy = make_policy('h2o', BUDGET, reuse_delay=K + 1)
  prompts = _prompts([37, 11, 26, 44, 20], seed=4)
  references = {tuple(p): alone(policy, p, M) for p in prompts}
  engine = EvictingEngine(config, params, policy=policy, k=K,
                          drafter=OracleLookup(references, wrong=0.3), **SHAPES)
  ids = [engine.add_request(p, max_tokens=M) for p in prompts]     # 5 requests, 4 fit at once
  a = ids[0]
  while len(engine._live[a].output) < 9:
    engine.step()
  request = engine._live[a]
  emitted = list(request.output)
  engine.scheduler.preempt(request)
  assert request.state is State.WAITING
  outs = engine.run()
  assert outs[a].tokens[:len(emitted)] == emitted and outs[a].metrics.preemptions == 1
  for i, p in zip(ids, prompts):
    assert outs[i].tokens == alone(policy, p, M)


def test_prompt_lookup_drafter_under_eviction_equals_k0(tiny, alone):
  """The real n-gram drafter: a repetitive prompt gives it matches; outputs still equal K = 0."""
  config, params = tiny
  policy = make_policy('h2o', BUDGET, reuse_delay=K + 1)
  prompts = _prompts([20, 33], seed=5) + [[5, 6, 7, 8] * 6]
  engine = EvictingEngine(config, params, policy=policy, k=K, drafter='ngram', **SHAPES)
  ids = [engine.add_request(p, max_tokens=M) for p in prompts]
  outs = engine.run()
  for i, p in zip(ids, prompts):
    assert outs[i].tokens == alone(policy, p, M)
  assert sum(outs[i].metrics.proposed for i in ids) > 0


def test_lookup_under_eviction_refusals(tiny):
  config, params = tiny
  bad = [
      (dict(k=K, drafter='ngram', policy=make_policy('h2o', BUDGET, reuse_delay=K)),
       r"K = 3 under eviction needs the policy's reuse_delay >= K \+ 1 = 4.*got 3"),
      (dict(k=K, drafter='ngram', k_policy='goodput'), "fixed K only.*k_policy='goodput'"),
      (dict(k=K, drafter='model', draft=config, draft_params=params), 'fixed K only.*a model'),
      (dict(k=K, drafter='model'), "fixed K only.*drafter='model'"),
      (dict(drafter='ngram'), 'needs the speculation length k >= 1'),
      (dict(k=K), "fixed K only.*k=3, draft=None, drafter=None"),
  ]
  for kwargs, message in bad:
    args = dict(SHAPES, policy=make_policy('h2o', BUDGET, reuse_delay=K + 1))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
      EvictingEngine(config, params, **args)
  engine = EvictingEngine(config, params, policy=make_policy('h2o', BUDGET, reuse_delay=K + 1),
                          k=K, drafter='ngram', **SHAPES)
  with pytest.raises(ValueError, match='decodes at K = 0 or its k=3, got k=2'):
    engine._call_decode(None, None, None, None, None, None, k=2)
  # A prompt past the model's context: the message counts prompt lookup's K + 1 slack.
  context = config.max_seq_len
  with pytest.raises(ValueError, match=rf'max_tokens=1 \+ 4 tokens of decoding slack = '
                                       rf'{context + 1} exceeds the context of {context}'):
    engine.add_request([5] * (context - 4), max_tokens=1)


def _pvalue(tokens, probs):
  """Chi-square p-value of sampled token ids against probs [V]; none may fall outside the
  support."""
  counts = np.bincount(tokens, minlength=probs.size)
  support = probs > 0
  assert counts[~support].sum() == 0
  return stats.chisquare(counts[support], probs[support] / probs[support].sum() *
                         len(tokens)).pvalue


def test_sampled_lookup_round_under_eviction_follows_the_target(tiny):
  """Temperature 1, N identical rows whose prompt is past the budget (eviction active), two
  fixed proposals: the first emitted token follows the target's p after the prompt and, where
  the first proposal was accepted, the second follows p after it (modified rejection sampling
  with one-hot q keeps the target's distribution under eviction too)."""
  config, params = tiny
  policy = make_policy('h2o', BUDGET, reuse_delay=K + 1)
  n = 1024                       # rows (draws); 2048 took twice as long in CI for little power
  prompt = _prompts([20], seed=6)[0]
  per = pages_needed(policy.slots, L)
  cache = cache_for(config, 1 + np.arange(n * per).reshape(n, per), 1 + n * per, L)
  first, cache, eviction = prefill_evicting(
      config, params, cache, init_eviction(policy, cache),
      jnp.asarray(np.tile(prompt, (n, 1)), jnp.int32), jnp.full((n,), len(prompt), jnp.int32),
      jax.random.PRNGKey(0), sampling=SamplingParams())
  # The target's distributions at the two verified positions (exact-verify numerics: the same
  # logits the round computes), taken before the round donates the cache.
  target = jax.jit(Transformer(config).apply)
  p0 = np.asarray(probabilities(target(
      params, first[:, None], cache.lengths[:, None], cache, eviction)[0][0, 0],
      SamplingParams(1.0)), np.float64)
  x1 = int(np.argmax(p0))
  verify = jnp.stack([first, jnp.full((n,), x1, jnp.int32)], axis=1)
  positions = cache.lengths[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
  p1 = np.asarray(probabilities(target(
      params, verify, positions, cache, eviction)[0][0, 1], SamplingParams(1.0)), np.float64)
  x2 = int(np.argmax(p1))
  window, accepted, emitted, _, _ = lookup_round_evicting(
      config, params, cache, eviction, first, jnp.tile(jnp.asarray([[x1, x2]], jnp.int32), (n, 1)),
      jnp.full((n,), 2, jnp.int32), jnp.full((n,), 10, jnp.int32), jnp.full((n, 1), -1, jnp.int32),
      jax.random.PRNGKey(1), RowSampling.stack([SamplingParams(1.0)] * n))
  window, accepted = np.asarray(window), np.asarray(accepted)
  assert (np.asarray(emitted) == accepted + 1).all()
  # One-hot q: the first proposal is accepted with probability p(x1) (both sides are taken).
  rate = (accepted >= 1).mean()
  assert abs(rate - p0[x1]) < 4 * np.sqrt(p0[x1] * (1 - p0[x1]) / n) and 0.05 < rate < 0.95
  assert _pvalue(window[:, 0], p0) > 1e-3
  assert _pvalue(window[accepted >= 1, 1], p1) > 1e-3
