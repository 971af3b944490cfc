"""`Engine.abort`: a request stopped while queued, prefilling, decoding or preempted gives its pages
and slot back and ends with the tokens it emitted; every other request's greedy output is still
the one it has decoded alone; unknown and finished ids are refused."""

import pytest

from jaxspec.cache import make_policy
from jaxspec.engine import Engine, EvictingEngine, State
from test_engine import K, SHAPES, SMALL, _check_pool, _prompts, alone  # noqa: F401 (fixture)
from test_engine_eviction import SHAPES as EVICT_SHAPES
from test_engine_eviction import alone as alone_evicting  # noqa: F401 (fixture)


def _check_idle_pool(engine):
  prefix = engine.prefix
  assert prefix.num_held == 0 and not engine.scheduler.waiting
  assert all(s is None for s in engine.scheduler.slots)
  cached = set(prefix.cached_pages())
  refs = [prefix.allocator.ref_count(p) for p in range(1, prefix.num_pages)]
  assert all(r == (1 if p in cached else 0) for p, r in zip(range(1, prefix.num_pages), refs))


@pytest.mark.parametrize('k', [0, K])
def test_abort_in_every_state_frees_its_pages_and_spares_the_others(tiny, tiny_draft, alone, k):
  config, params = tiny
  spec = dict(draft=tiny_draft[0], draft_params=tiny_draft[1], k=k) if k else {}
  engine = Engine(config, params, num_pages=SMALL, host_pages=8, **SHAPES, **spec)
  # Slots: 3. Request 1's 30-token prompt prefills over four 8-token chunks; 4 and 5 wait.
  prompts = _prompts([9, 30, 12, 7, 11, 5], seed=7)
  max_tokens = [20, 16, 20, 18, 12, 10]
  ids = [engine.add_request(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
  engine.step()
  engine.step()
  assert engine._live[ids[1]].state is State.PREFILL
  assert engine._live[ids[4]].state is State.WAITING
  aborted = {ids[1]: engine.abort(ids[1]),          # mid-prefill, no token yet
             ids[4]: engine.abort(ids[4])}          # queued, never admitted
  _check_pool(engine)
  while len(engine._live[ids[0]].output) < 5:
    engine.step()
  decoding = engine._live[ids[0]]
  assert decoding.state is State.DECODE
  aborted[ids[0]] = engine.abort(ids[0])            # mid-decode
  _check_pool(engine)
  engine.step()
  victim = engine.scheduler.running[-1]
  engine.scheduler.preempt(victim)                  # back in the queue with its output
  assert victim.state is State.WAITING and victim.output
  aborted[victim.id] = engine.abort(victim.id)
  _check_pool(engine)
  outs = engine.run()
  _check_idle_pool(engine)
  for i, rid in enumerate(ids):
    out = engine.outputs[rid]
    expected = alone(prompts[i], max_tokens[i])
    if rid in aborted:
      assert out is aborted[rid] and rid not in outs
      assert out.finish_reason == 'abort' and out.metrics.finish_s is not None
      assert out.tokens == expected[:len(out.tokens)] and len(out.tokens) < max_tokens[i]
      assert out.metrics.num_tokens == len(out.tokens)
    else:
      assert out.tokens == expected and out.finish_reason == 'length'
  assert aborted[ids[1]].tokens == [] and aborted[ids[4]].tokens == []
  assert len(aborted[ids[0]].tokens) >= 5 and len(aborted[victim.id].tokens) >= 1


def test_abort_refuses_unknown_and_finished_requests(tiny, alone):
  config, params = tiny
  engine = Engine(config, params, num_pages=SMALL, **SHAPES)
  rid = engine.add_request([5, 6, 7], max_tokens=2)
  engine.run()
  with pytest.raises(ValueError, match=r"request 0 already finished \('length'\)"):
    engine.abort(rid)
  with pytest.raises(KeyError, match='no request has id 7'):
    engine.abort(7)
  with pytest.raises(KeyError, match=r'no request has id \[1\]'):
    engine.abort([1])
  other = engine.add_request([5, 6, 7], max_tokens=2, request_id='a')
  engine.abort(other)
  with pytest.raises(ValueError, match="request 'a' already finished \\('abort'\\)"):
    engine.abort(other)
  assert engine.outputs[rid].tokens == alone([5, 6, 7], 2)
  _check_idle_pool(engine)


def test_abort_under_eviction_frees_the_slot_for_the_next_request(tiny, alone_evicting):
  """The aborted request's slot is reset for the request admitted into it: that one's output is
  the one it has decoded alone under the same policy."""
  config, params = tiny
  policy = make_policy('h2o', 12)
  engine = EvictingEngine(config, params, policy=policy, **EVICT_SHAPES)
  prompts = _prompts([20, 9, 14, 17, 6], seed=3)
  ids = [engine.add_request(p, max_tokens=12) for p in prompts[:4]]
  for _ in range(6):
    engine.step()
  assert engine._live[ids[1]].state is State.DECODE
  slot = engine._live[ids[1]].slot
  engine.abort(ids[1])
  late = engine.add_request(prompts[4], max_tokens=12)
  engine.step()
  assert engine._live[late].slot == slot
  engine.run()
  assert engine.prefix.num_held == 0 and engine.prefix.num_free == EVICT_SHAPES['num_pages'] - 1
  for rid, prompt in zip(ids + [late], prompts):
    out = engine.outputs[rid]
    expected = alone_evicting(policy, prompt, 12)
    if rid == ids[1]:
      assert out.finish_reason == 'abort' and out.tokens == expected[:len(out.tokens)]
    else:
      assert out.tokens == expected, rid
