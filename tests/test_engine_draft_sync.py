"""The lazy draft cache (`jaxspec.engine.draft_sync`): K = 0 rounds never run the draft, the probe
scores the draft on exactly the tokens the target drew at K = 0, catch-ups over prefix-shared
pages leave a correct draft cache, the policy sees the catch-up seconds."""

import jax
import numpy as np
import pytest

from jaxspec.engine import Engine, compile_counts, spec_steps
from jaxspec.engine.acceptance import AlphaTracker
from jaxspec.engine.draft_sync import DraftSync
from jaxspec.engine.drafters import ModelDrafter
from jaxspec.engine.goodput import GoodputK
from jaxspec.engine.k_policy import KPolicy
from jaxspec.models import Transformer

L, K = 8, 3
SHAPES = dict(num_slots=3, page_size=L, chunk_size=8, num_pages=64)   # as test_engine_drafters


class Record(KPolicy):
  """K from a fixed cycle (candidates include 0, so the draft cache is lazy); records the
  observations that observed something."""

  def __init__(self, ks):
    super().__init__()
    self.ks, self.calls, self.seen, self.probes, self.probed_x = list(ks), 0, [], [], []

  @property
  def candidates(self):
    return tuple(sorted(set(self.ks) | {0}))

  def choose(self, request_ids):
    k = self.ks[self.calls % len(self.ks)]
    self.calls += 1
    return k, [k] * len(request_ids)

  def observe(self, request_id, k, accepted, successes, trials):
    if trials > 0:
      self.seen.append((request_id, k, accepted, successes, trials))

  def observe_probe(self, request_id, successes, trials, later_successes, later_trials,
                    confidence=None):
    self.probes.append((request_id, trials, later_successes, later_trials))
    self.probed_x.append(confidence)
    super().observe_probe(request_id, successes, trials, later_successes, later_trials)


def _prompts(lengths, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 64, size=n).tolist() for n in lengths]


def test_k0_rounds_never_run_the_draft(tiny, tiny_draft):
  config, params = tiny
  policy = Record([0])
  engine = Engine(config, params, draft=tiny_draft[0], draft_params=tiny_draft[1], k=K,
                  k_policy=policy, drafter=ModelDrafter(probe_every=None), **SHAPES)
  draft_pages = np.asarray(engine.caches[1].k_pages).copy()
  ids = [engine.add_request(p, max_tokens=12) for p in _prompts([5, 13], seed=0)]
  outs = engine.run()
  assert [len(outs[i].tokens) for i in ids] == [12, 12]
  assert engine.draft_sync.num_calls == 0 and policy.seen == []
  np.testing.assert_array_equal(np.asarray(engine.caches[1].k_pages), draft_pages)


def test_probe_scores_the_draft_on_what_the_target_drew(tiny, tiny_draft):
  # Greedy: β = q(x) = [draft argmax after the context so far == x] for every token x the target
  # drew in a K = 0 round; the first token (drawn by prefill) has no known p and is not scored.
  # Recomputed here from one causal pass of the draft over the whole context.
  config, params = tiny
  draft, draft_params = tiny_draft
  policy = Record([0])
  engine = Engine(config, params, draft=draft, draft_params=draft_params, k=K, k_policy=policy,
                  drafter=ModelDrafter(probe_every=4, probe_rows=2, probe_budget=None,
                                          observe_tokens=L), **SHAPES)
  prompts = _prompts([6, 11], seed=1)
  ids = [engine.add_request(p, max_tokens=17) for p in prompts]
  outs = engine.run()
  assert engine.draft_sync.num_calls >= 5
  for rid, prompt in zip(ids, prompts):
    context = prompt + outs[rid].tokens
    positions = np.arange(len(context), dtype=np.int32)[None]
    logits, _ = Transformer(draft).apply(draft_params, np.asarray(context, np.int32)[None],
                                         positions, None)
    hits = np.argmax(np.asarray(logits[0]), axis=-1)[:-1] == np.asarray(context[1:])
    target_logits, _ = Transformer(config).apply(params, np.asarray(context, np.int32)[None],
                                                 positions, None)
    p_drawn = np.asarray(jax.nn.softmax(target_logits[0], axis=-1)).max(axis=-1)  # greedy
    got = [(s, t) for r, k, _, s, t in policy.seen if r == rid]
    assert all(k == 0 for r, k, *_ in policy.seen)
    trials = int(sum(t for _, t in got))
    # Scored: outputs 2.. (K = 0 draws) up to what the last probe before the end caught up.
    assert 3 <= trials <= 16
    first = len(prompt)                             # index in context of output 1
    expected = hits[first:first + trials].sum()     # predictions of outputs 2 .. trials + 1
    assert sum(s for s, _ in got) == expected
    # Each probe scored the next run of consecutive outputs; its pairs of neighbours tell β:
    # later trials Σ hit_j over the pairs, later successes Σ hit_j hit_{j+1}.
    start = first
    # Its confidence: the target's mean max softmax probability over the tokens it scored.
    for (_, n, later_successes, later_trials), confidence in [
        (p, x) for p, x in zip(policy.probes, policy.probed_x) if p[0] == rid]:
      run = hits[start:start + int(n)].astype(int)
      assert later_trials == run[:-1].sum() and later_successes == (run[:-1] * run[1:]).sum()
      if n < AlphaTracker.FIT_TOKENS:                     # too few tokens to fit on
        assert confidence is None
      else:
        np.testing.assert_allclose(confidence, p_drawn[start:start + int(n)].mean(), rtol=1e-4)
      start += int(n)
    assert start == first + trials
  assert sum(p[2] for p in policy.probes) > 0                # some neighbours both hit
  assert any(x is not None for x in policy.probed_x)         # a probe of enough tokens


def test_the_first_round_of_a_new_request_sees_its_first_tokens_confidence(tiny, tiny_draft):
  # Prefill draws the first token: its max softmax probability is the request's first max_p,
  # so the policy prices the request's first decode round with a confidence (was None).
  config, params = tiny
  draft, draft_params = tiny_draft

  class Seen(Record):
    wants_confidences = True
    first_seen = {}

    def choose(self, request_ids):
      for rid, x, n in zip(request_ids, self.confidences, self.confidence_tokens):
        self.first_seen.setdefault(rid, (x, n))
      return super().choose(request_ids)

  policy = Seen([0])
  engine = Engine(config, params, draft=draft, draft_params=draft_params, k=K, k_policy=policy,
                  drafter=ModelDrafter(probe_every=None), **SHAPES)
  prompts = _prompts([6, 11], seed=2)                 # 11: two prefill chunks, a later start
  ids = [engine.add_request(p, max_tokens=4) for p in prompts]
  outs = engine.run()
  for rid, prompt in zip(ids, prompts):
    context = prompt + outs[rid].tokens
    positions = np.arange(len(context), dtype=np.int32)[None]
    logits, _ = Transformer(config).apply(params, np.asarray(context, np.int32)[None],
                                          positions, None)
    top = np.asarray(jax.nn.softmax(logits[0], axis=-1)).max(axis=-1)
    # Where prefill drew output 1 (the request's first round knew only that one).
    x, n = policy.first_seen[rid]
    np.testing.assert_allclose(x, top[len(prompt) - 1], rtol=1e-4)
    assert n == 1


@pytest.mark.parametrize('spec', [True, False])
def test_rounds_at_k_ge_1_report_the_confidence_of_every_token_they_emit(tiny, tiny_draft, spec):
  # A request that runs at K >= 1 from admission: for a policy that wants them there, its
  # confidence at each choice is the target's mean top probability over its last (at most 16)
  # outputs, those drawn by the verify passes included; else only its first token's (from
  # prefill) at every choice, and its later outputs record none.
  config, params = tiny
  draft, draft_params = tiny_draft

  class Seen(Record):
    wants_confidences = True
    wants_spec_confidences = spec
    chosen = []

    def choose(self, request_ids):
      self.chosen.extend(zip(request_ids, self.confidences, self.confidence_tokens, self.rooms))
      return super().choose(request_ids)

  policy = Seen([K])                                   # K >= 1 every round (0 a candidate)
  engine = Engine(config, params, draft=draft, draft_params=draft_params, k=K, k_policy=policy,
                  drafter=ModelDrafter(probe_every=None), **SHAPES)
  prompts, max_tokens = _prompts([6, 9], seed=4), 24
  ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
  requests = [engine._live[rid] for rid in ids]
  outs = engine.run()
  assert engine.k_rounds[0] == 0 and engine.k_rounds[K] > 0
  for rid, prompt, request in zip(ids, prompts, requests):
    context = prompt + outs[rid].tokens
    positions = np.arange(len(context), dtype=np.int32)[None]
    logits, _ = Transformer(config).apply(params, np.asarray(context, np.int32)[None],
                                          positions, None)
    top = np.asarray(jax.nn.softmax(logits[0], axis=-1)).max(axis=-1)
    drawn = top[len(prompt) - 1:-1]                    # where output i was drawn
    choices = [(x, n, room) for r, x, n, room in policy.chosen if r == rid]
    if not spec:
      np.testing.assert_allclose(request.max_p[0], drawn[0], rtol=1e-4)
      assert not any(request.max_p[1:])
      assert all(n == 1 for _, n, _ in choices)
      continue
    np.testing.assert_allclose(request.max_p, drawn, rtol=1e-4)   # every output, the last too
    assert max(n for _, n, _ in choices) == 16         # more than prefill's one token
    for x, n, room in choices:
      emitted = max_tokens - room
      assert n == min(emitted, 16)
      np.testing.assert_allclose(x, drawn[emitted - n:emitted].mean(), rtol=1e-4)


def test_prefill_calls_feed_the_live_ratio_that_prices_a_split(tiny, tiny_draft):
  config, params = tiny
  draft, draft_params = tiny_draft
  engine = Engine(config, params, draft=draft, draft_params=draft_params, k=K,
                  k_policy=GoodputK(), **SHAPES)
  engine.warm_up(cost_repeats=1, decode_rounds=1)
  assert engine.prefill_costs and engine.prefill_live.value == 1.0
  for p in _prompts([5, 13, 7], seed=3):
    engine.add_request(p, max_tokens=3)
  engine.run()
  # One ratio per prefill call (13 tokens: two chunks), each live seconds over its bucket's.
  assert len(engine.prefill_live._ratios) >= 2
  assert all(r > 0 for r in engine.prefill_live._ratios)


def test_catch_up_over_prefix_shared_pages_leaves_a_correct_draft(tiny):
  # The second request finds the first's prompt pages in the prefix cache; their draft half was
  # never written (the first prefilled the target only). With draft = target, every proposal is
  # accepted only if the catch-up rebuilt the draft cache of both requests correctly.
  config, params = tiny
  policy = Record([0, 0, K])
  engine = Engine(config, params, draft=config, draft_params=params, k=K, k_policy=policy,
                  **SHAPES)
  prompt = _prompts([3 * L + 2], seed=2)[0]
  first = engine.add_request(prompt, max_tokens=14)
  for _ in range(4):
    engine.step()
  second = engine.add_request(prompt, max_tokens=14)
  outs = engine.run()
  assert outs[second].metrics.cached_tokens >= 3 * L
  for rid in (first, second):
    m = outs[rid].metrics
    assert m.proposed > 0 and m.accepted == m.proposed
  assert outs[first].tokens == outs[second].tokens


def test_prefill_fills_the_draft_while_the_engine_speculates(tiny):
  # Before any round at K >= 1 a prompt goes to the target alone; once the engine speculates, a
  # new request's prefill writes the draft's cache in the same call (nothing to catch up). A
  # self-draft then accepts every proposal only if that cache is right.
  config, params = tiny
  engine = Engine(config, params, draft=config, draft_params=params, k=K,
                  k_policy=Record([K]), drafter=ModelDrafter(probe_every=None), **SHAPES)
  first, second = _prompts([7, 6], seed=4)                # one prefill chunk each
  a = engine.add_request(first, max_tokens=12)
  engine.step()                                           # prefill: the target alone
  request = engine._live[a]
  assert request.draft_computed == 0 and not engine.draft_sync.eager
  engine.step()                                           # catch-up, then a round at K
  assert engine.draft_sync.num_calls == 1 and engine.draft_sync.eager
  b = engine.add_request(second, max_tokens=12)
  engine.step()                                           # b's prefill fills the draft too
  assert engine._live[b].draft_computed == engine._live[b].num_computed == len(second)
  outs = engine.run()
  assert engine.draft_sync.num_calls == 1                 # b never needed a catch-up
  for rid in (a, b):
    m = outs[rid].metrics
    assert m.proposed > 0 and m.accepted == m.proposed


def test_pending_seconds_and_the_policy_choice(tiny, tiny_draft):
  config, params = tiny
  engine = Engine(config, params, draft=tiny_draft[0], draft_params=tiny_draft[1], k=K,
                  k_policy=Record([0]), **SHAPES)
  sync = engine.draft_sync
  sync.costs = {1: 0.5, 2: 0.75, 3: 1.0}                  # seconds per call, per row bucket

  class Req:
    def __init__(self, computed, drafted):
      self.num_computed, self.draft_computed = computed, drafted

  assert sync.pending_s([Req(9, 9), Req(4, 4)]) == 0.0
  assert sync.pending_s([Req(9, 2), Req(4, 4)]) == 0.5                 # 1 row, 1 pass
  # 2 rows (18 and 4 behind), then the one left for 2 more passes (10, then 2 tokens).
  assert sync.pending_s([Req(20, 2), Req(4, 0), Req(5, 5)]) == 0.75 + 0.5 + 0.5
  # Goodput pays the catch-up before a round at K >= 1 only.
  policy = GoodputK(costs={0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6})
  policy.setup(K)
  for _ in range(20):
    policy.observe('r', 2, 2, 2.0, 2.0)                  # α -> 1
  assert policy.choose(['r'])[0] == K
  policy.sync_s, policy.rooms = 10.0, [4]               # one round left: pays it all
  assert policy.choose(['r'])[0] == 0
  policy.rooms = [4000]                                  # ~1000 rounds share it
  assert policy.choose(['r'])[0] == K


def test_one_slow_catch_up_does_not_price_the_later_ones(tiny, tiny_draft, monkeypatch):
  """A catch-up that recompiled (after `jax.clear_caches()`: seconds against a table's
  milliseconds) moves the live / table ratio of later catch-ups by no more than one sample in a
  median: an exponential average priced them ~300x too high for good."""
  config, params = tiny
  engine = Engine(config, params, draft=tiny_draft[0], draft_params=tiny_draft[1], k=K,
                  k_policy=Record([0]), **SHAPES)
  sync = engine.draft_sync
  sync.costs = {1: 0.01, 2: 0.01, 3: 0.01}               # seconds per call, per row bucket
  clock, durations = [0.0], [3.0] + [0.012] * 4          # a recompile, then 1.2x the table

  class Req:
    def __init__(self):
      self.num_computed, self.draft_computed = 6, 2      # one chunk pass of one row: 0.01 s

  def call(group):                                       # the device call, on a fake clock
    clock[0] += durations.pop(0)
    for r in group:
      r.draft_computed = r.num_computed

  monkeypatch.setattr(sync, '_call', call)
  monkeypatch.setattr('jaxspec.engine.draft_sync.time.perf_counter', lambda: clock[0])
  sync.catch_up([Req()])
  assert sync.live_ratio == 1.0                          # median of [300, 1, 1] (the prior)
  for _ in range(4):
    sync.catch_up([Req()])
  assert sync.live_ratio == pytest.approx(1.2) and sync.pending_s([Req()]) == pytest.approx(0.012)


def test_short_catch_up_calls_price_and_rebuild_the_draft(tiny, monkeypatch):
  # A chunk pass whose rows all have at most short_width tokens to catch up runs the narrow
  # call measured at warm-up: priced by its own table, and (a self-draft accepts every
  # proposal only then) leaving the same draft cache as full-width calls.
  monkeypatch.setattr(DraftSync, 'SHORT_WIDTH', 4)       # < chunk_size 8: a short call exists
  config, params = tiny
  engine = Engine(config, params, draft=config, draft_params=params, k=K,
                  k_policy=Record([0, 0, 0, K]), drafter=ModelDrafter(probe_every=None),
                  **SHAPES)
  sync = engine.draft_sync
  assert sync.short_width == 4 and not sync.short_costs
  engine.warm_up(cost_repeats=1, decode_rounds=1)
  assert set(sync.short_costs) == set(sync.costs) == set(engine.prefill_buckets)

  class Req:
    def __init__(self, computed, drafted):
      self.num_computed, self.draft_computed = computed, drafted

  sync.costs, sync.short_costs = {1: 1.0, 2: 1.5, 3: 2.0}, {1: 0.25, 2: 0.5, 3: 0.75}
  assert sync.live_ratio == 1.0                               # no catch-up ran yet
  assert sync.pending_s([Req(6, 3), Req(9, 5)]) == 0.5           # 3 and 4 behind: one short
  # 20 and 2 behind: [2 rows full], [1 row full, 12 left], [1 row short, 4 left].
  assert sync.pending_s([Req(22, 2), Req(4, 2)]) == 1.5 + 1.0 + 0.25
  widths = []
  catch_up = spec_steps.draft_catch_up

  def recorded(*args):
    widths.append(args[3].shape[1])                       # tokens [rows, width]
    return catch_up(*args)
  monkeypatch.setattr(spec_steps, 'draft_catch_up', recorded)
  compiled = compile_counts()
  ids = [engine.add_request(p, max_tokens=14) for p in _prompts([3, 19], seed=6)]
  outs = engine.run()
  assert set(widths) == {4, 8} and compile_counts() == compiled     # both built at warm-up
  for rid in ids:
    m = outs[rid].metrics
    assert m.proposed > 0 and m.accepted == m.proposed


class NotWorth(Record):
  """A policy at K = 0 that no probe could move (`worth_probing` False), cold or not."""

  def __init__(self, ks, cold=False):
    super().__init__(ks)
    self.is_cold = cold

  def worth_probing(self, request_ids):
    return False

  @property
  def cold(self):
    return self.is_cold


@pytest.mark.parametrize('case', ['within_reach', 'fill_off', 'out_of_reach', 'cold'])
def test_prefill_fills_the_draft_while_k_ge_1_is_within_reach(tiny, case):
  # With fill_prefill on, a prompt goes through the draft in the prefill call at K = 0 too while
  # the policy could still choose K >= 1 (it would probe, or is cold): no catch-up of the prompt
  # before a probe or a switch. Not once its answers put K >= 1 out of reach, nor with
  # fill_prefill off. A self-draft then accepts every proposal only if the filled cache is right.
  config, params = tiny
  policy = Record([0, 0, 0, K]) if case in ('within_reach', 'fill_off') else \
      NotWorth([0], cold=case == 'cold')
  engine = Engine(config, params, draft=config, draft_params=params, k=K, k_policy=policy,
                  drafter=ModelDrafter(probe_every=1, probe_budget=None), **SHAPES)
  sync = engine.draft_sync
  assert not sync.fill_prefill                            # off by default
  sync.fill_prefill = case != 'fill_off'
  first, second = _prompts([7, 6], seed=7)
  a = engine.add_request(first, max_tokens=12)
  for _ in range(3):                                      # prefill, then K = 0 rounds
    engine.step()
  assert not sync.eager
  if case == 'out_of_reach':                              # "not worth it" grew the gap
    assert sync.backoff > sync.probe_every
  b = engine.add_request(second, max_tokens=12)
  engine.step()                                           # b's prefill
  filled = engine._live[b].draft_computed == engine._live[b].num_computed == len(second)
  assert filled == (case in ('within_reach', 'cold'))
  if case != 'fill_off':
    assert engine._live[b].draft_computed in (0, len(second))
  outs = engine.run()
  if case == 'within_reach':
    for rid in (a, b):
      m = outs[rid].metrics
      assert m.proposed > 0 and m.accepted == m.proposed


def test_warm_up_compiles_both_prefill_calls_and_times_the_target_alone(tiny, monkeypatch):
  # The prefill table (what a split is priced with) times the target's call alone whatever
  # fill_prefill says; the call that fills the draft too is compiled once per row bucket.
  config, params = tiny
  engine = Engine(config, params, draft=config, draft_params=params, k=K,
                  k_policy=GoodputK(), **SHAPES)
  engine.draft_sync.fill_prefill = True
  flags, call = [], engine._call_prefill
  monkeypatch.setattr(engine, '_call_prefill', lambda *a: flags.append(a[5]) or call(*a))
  engine.warm_up(cost_repeats=1, decode_rounds=1)
  buckets = len(engine.prefill_buckets)
  assert flags.count(True) == buckets and flags.count(False) > buckets    # timed: repeated
  assert flags[-buckets:] == [True] * buckets and engine.draft_sync.fill_prefill
  assert set(engine.prefill_costs) == set(engine.prefill_buckets)
