"""Drafters and adaptive K in the engine: greedy outputs equal each request decoded alone (prompt
lookup, schedule / goodput / scripted K sequences with K = 0 rounds, preemption), one-hot-q
verification keeps the target distribution, n-gram lookup, compile counts, bad arguments (the
policies on their own: tests/test_k_policies.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decoding import SamplingParams, generate, probabilities, rejection_sample
from jaxspec.cache import make_policy
from jaxspec.engine import Engine, EvictingEngine, FixedK, compile_counts
from jaxspec.engine.drafters import ModelDrafter, NGramDrafter, lookup, make_drafter
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.k_policy import KPolicy, ScheduleK
from jaxspec.engine.spec_steps import host_q

L, M, K = 8, 24, 3
SHAPES = dict(num_slots=3, page_size=L, chunk_size=8)   # as tests/test_engine.py: shared compiles
BIG, SMALL = 64, 10


@pytest.fixture(scope='module')
def alone(tiny):
  """expected(prompt, max_tokens): greedy output of the prompt decoded alone by `generate`."""
  config, params = tiny

  @functools.lru_cache(maxsize=None)
  def free(prompt):
    return generate(config, params, [list(prompt)], max_new_tokens=M, page_size=L).tokens[0]

  return lambda prompt, max_tokens: free(tuple(prompt))[:max_tokens]


def _prompts(lengths, seed, repeat=False):
  """Random prompts; with repeat, each is a short random phrase repeated (n-gram hits)."""
  rng = np.random.default_rng(seed)
  if not repeat:
    return [rng.integers(3, 64, size=n).tolist() for n in lengths]
  return [(rng.integers(3, 64, size=5).tolist() * n)[:n] for n in lengths]


def _run_staggered(engine, requests, arrivals):
  ids, step = {}, 0
  while len(ids) < len(requests) or engine.has_unfinished():
    for i, (prompt, max_tokens) in enumerate(requests):
      if arrivals[i] == step:
        ids[i] = engine.add_request(prompt, max_tokens=max_tokens)
    engine.step()
    step += 1
    assert step < 500
  return [engine.outputs[ids[i]] for i in range(len(requests))]


class Scripted(KPolicy):
  """K from a fixed cycle; odd rows capped one lower (so per-row caps, 0 included, are used)."""

  def __init__(self, ks):
    super().__init__()
    self.ks, self.calls = list(ks), 0

  @property
  def candidates(self):
    return tuple(sorted(set(self.ks)))

  def choose(self, request_ids):
    k = self.ks[self.calls % len(self.ks)]
    self.calls += 1
    return k, [max(0, k - j % 2) for j in range(len(request_ids))]


def _requests(seed):
  lengths = [5, 9, 17, 30, 3, 16]
  prompts = _prompts(lengths[:3], seed) + _prompts(lengths[3:], seed, repeat=True)
  return list(zip(prompts, [M, 7, 20, 12, M, 15])), [0, 0, 1, 2, 5, 9]


@pytest.mark.parametrize('drafter,policy,num_pages', [
    ('ngram', 'scripted', SMALL),
    ('model', 'scripted', SMALL),           # a lazy draft cache (the policy has K = 0)
    ('eager', 'scripted', SMALL),           # the draft runs in K = 0 rounds too
    ('model', 'schedule', BIG),
    ('model', 'goodput', BIG),
])
def test_greedy_every_request_equals_it_decoded_alone(tiny, tiny_draft, alone, drafter, policy,
                                                      num_pages):
  config, params = tiny
  spec = dict(draft=tiny_draft[0], draft_params=tiny_draft[1]) if drafter != 'ngram' else {}
  drafter = ModelDrafter(lazy=False) if drafter == 'eager' else drafter
  k_policy = Scripted([3, 0, 1, 0, 0, 3, 1]) if policy == 'scripted' else policy
  if policy == 'goodput':
    # Starting from α 0.9 it speculates (a loaded machine made a default one run K = 0
    # throughout); the estimates then follow the draft, so K still moves.
    k_policy = GoodputK(tracker=AlphaTracker(prior=0.9))
  engine = Engine(config, params, num_pages=num_pages, drafter=drafter, k=K, k_policy=k_policy,
                  **spec, **SHAPES)
  if policy == 'goodput':
    # Priced on a table where K >= 1 is cheap, not the one warm-up timed (under a CI run's load
    # one timed table held even α 0.9 at K = 0 throughout); live rounds rescale it after.
    engine.warm_up(cost_repeats=1, decode_rounds=1)
    engine.policy.set_costs({k: engine.step_costs[0] * (1 + 0.1 * k) for k in range(K + 1)})
  requests, arrivals = _requests(seed=1)
  outs = _run_staggered(engine, requests, arrivals)
  for (prompt, m), out in zip(requests, outs):
    assert out.tokens == alone(prompt, m)
  proposed = sum(o.metrics.proposed for o in outs)
  accepted = sum(o.metrics.accepted for o in outs)
  # Rejections too (rollback exercised), except under goodput, whose K choices follow timing.
  assert 0 < accepted <= proposed and (policy == 'goodput' or accepted < proposed)
  if num_pages == SMALL:
    assert sum(o.metrics.preemptions for o in outs) > 0
  if policy == 'scripted':                        # really switched K, K = 0 rounds included
    assert set(engine.k_rounds) == {0, 1, 3}
    lazy = isinstance(drafter, str) and drafter == 'model'
    assert (engine.draft_sync is not None) == lazy
  if policy == 'goodput':
    assert set(engine.step_costs) == {0, 1, 2, 3}
  assert engine.prefix.num_held == 0


@pytest.mark.parametrize('lazy', [True, False])
def test_goodput_leaves_k0_when_the_draft_agrees(tiny, lazy):
  # The tracker starts at α = 0, so the first rounds run K = 0; a draft equal to the target
  # scores 1 on what the target drew (lazy: the first early probe, after one K = 0 round;
  # eager: Σ min(p, q) = 1 in each K = 0 round), the estimate rises and the policy moves to
  # K_max.
  config, params = tiny
  policy = GoodputK(tracker=AlphaTracker(prior=0.0), costs={k: 1.0 for k in range(K + 1)},
                    spec_margin=0.0)
  drafter = ModelDrafter(probe_every=4, probe_budget=None) if lazy else ModelDrafter(lazy=False)
  engine = Engine(config, params, num_pages=BIG, draft=config, draft_params=params, k=K,
                  k_policy=policy, drafter=drafter, **SHAPES)
  prompt = _prompts([11], seed=3)[0]
  rid = engine.add_request(prompt, max_tokens=M)
  out = engine.run()[rid]
  assert out.tokens == generate(config, params, [prompt], max_new_tokens=M,
                                page_size=L).tokens[0]
  assert engine.k_rounds[0] >= 1 and engine.k_rounds[K] >= 1
  lengths = out.metrics.accepted_lengths                  # K = 0 rounds first, then no rejection
  assert lengths[0] == 1 and K + 1 in lengths and set(lengths[:-1]) <= {1, K + 1}
  if lazy:                                                # one K = 0 round, then the probe
    assert lengths[:2] == [1, K + 1]


@pytest.mark.parametrize('lazy', [True, False])
def test_sampled_self_draft_stays_in_sync_across_k_switches(tiny, lazy):
  # Draft = target at temperature 1 (exact-verify numerics): while the draft cache is in sync,
  # every proposal is accepted and every K = 0 observation is 1 (eager: Σ min(p, q) per round;
  # lazy: min(1, q(x) / p(x)) per token the catch-up scores). A K = 0 round that skipped the
  # draft (or a catch-up that wrote the wrong token or scored the wrong position) would make
  # later q differ from p.
  config, params = tiny
  seen = []

  class Record(Scripted):
    def observe(self, request_id, k, accepted, successes, trials):
      seen.append((k, accepted, successes, trials))

  engine = Engine(config, params, num_pages=BIG, draft=config, draft_params=params, k=K,
                  k_policy=Record([K, 0, 0]), sampling=SamplingParams(temperature=1.0),
                  drafter=ModelDrafter(lazy=lazy), **SHAPES)
  ids = [engine.add_request(p, max_tokens=M) for p in _prompts([6, 19, 11], seed=7)]
  outs = engine.run()
  assert all(len(outs[i].tokens) == M for i in ids)
  zero = [s / t for k, _, s, t in seen if k == 0 and t > 0]   # K = 0 (cap 0: no trial)
  trials = sum(t for k, _, _, t in seen if k == 0)
  assert trials > 10 and zero == pytest.approx([1.0] * len(zero), abs=1e-5)
  assert all(a == k for k, a, _, _ in seen if k > 0)           # every capped proposal accepted


def test_ngram_k0_rounds_observe_lookup_hits(tiny):
  # A prompt repeating one phrase: lookup proposals usually equal the emitted token only if
  # the model continues the phrase, which the tiny model does not reliably do; the observation
  # must equal [proposal == emitted] exactly, whatever it is.
  config, params = tiny
  seen = []

  class Record(Scripted):
    def observe(self, request_id, k, accepted, successes, trials):
      seen.append((k, successes, trials))

  engine = Engine(config, params, num_pages=BIG, drafter='ngram', k=K, k_policy=Record([0]),
                  **SHAPES)
  prompt = _prompts([20], seed=4, repeat=True)[0]
  rid = engine.add_request(prompt, max_tokens=12)
  out = engine.run()[rid]
  context = prompt + out.tokens
  expected = []
  for i in range(len(prompt) + 1, len(context)):            # rounds emit context[i]
    proposal = lookup(context[:i], 1, 3, 1)
    expected.append((0, float(bool(proposal) and proposal[0] == context[i]), 1.0))
  assert seen == expected and any(s for _, s, _ in seen)


def test_compiles_once_per_k_used_and_never_per_request(tiny, tiny_draft):
  config, params = tiny
  before = compile_counts()
  engine = Engine(config, params, num_pages=BIG, draft=tiny_draft[0], draft_params=tiny_draft[1],
                  k=K, k_policy=Scripted([K, 0, 1]), **SHAPES)
  engine.warm_up(cost_repeats=1, decode_rounds=1)
  warm = compile_counts()
  added = {f: warm[f] - before[f] for f in warm}
  assert added['model_step'] <= 2 and added['lookup_step'] == 0
  assert added['model_sync_step'] == 0                      # a lazy draft cache: catch-ups
  assert set(engine.draft_sync.costs) == set(engine.prefill_buckets)   # compiled and timed
  assert set(engine.step_costs) == {0, 1, K} and all(t > 0 for t in engine.step_costs.values())
  requests = [(p, 3 + 2 * i) for i, p in enumerate(_prompts([1, 7, 9, 23, 40], seed=5))]
  _run_staggered(engine, requests, arrivals=[0, 0, 1, 3, 4])
  assert set(engine.k_rounds) == {0, 1, K}
  assert compile_counts() == warm


# ---------------------------------------------------------------- one-hot verification

N = 200_000
P_LOGITS = jnp.log(jnp.array([[0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02],
                              [0.02, 0.04, 0.06, 0.08, 0.10, 0.15, 0.25, 0.30],
                              [0.05, 0.30, 0.05, 0.20, 0.05, 0.20, 0.05, 0.10]]))


def _pvalue(tokens, probs):
  probs = np.asarray(probs, np.float64)
  counts = np.bincount(tokens, minlength=probs.size)
  assert counts[probs == 0].sum() == 0
  support = probs > 0
  return stats.chisquare(counts[support], probs[support] / probs[support].sum() *
                         len(tokens)).pvalue


@pytest.mark.parametrize('sampling', [SamplingParams(1.0), SamplingParams(0.8, top_k=5)])
def test_one_hot_verification_keeps_the_target_distribution(sampling):
  # Host proposals are fixed tokens, not samples: per row a proposal pair and a num_proposed in
  # {0, 1, 2} (one of the proposals has p = 0 under top-k). Every emitted position must follow p.
  p = probabilities(jnp.broadcast_to(P_LOGITS, (N, 3, 8)), sampling)
  rng = np.random.default_rng(0)
  proposals = jnp.asarray(rng.choice([0, 1, 3, 7], size=(N, 2)), jnp.int32)
  num_proposed = jnp.asarray(rng.integers(0, 3, size=N), jnp.int32)
  q = host_q(proposals, num_proposed, 8)
  n, nxt = jax.jit(rejection_sample)(jax.random.PRNGKey(1), proposals, q, p)
  n, nxt, num_proposed = np.asarray(n), np.asarray(nxt), np.asarray(num_proposed)
  assert (n <= num_proposed).all() and 0 < n.mean() < num_proposed.mean()
  padded = np.pad(np.asarray(proposals), ((0, 0), (0, 1)))
  window = np.where(np.arange(3)[None] < n[:, None], padded, nxt[:, None])
  assert _pvalue(window[:, 0], p[0, 0]) > 1e-3
  assert _pvalue(window[n >= 1, 1], p[0, 1]) > 1e-3
  assert _pvalue(window[n >= 2, 2], p[0, 2]) > 1e-3
  # A rejected proposal is never the correction token (drawn from p with it removed).
  rejected = n < num_proposed
  assert not (nxt[rejected] == np.asarray(proposals)[rejected, n[rejected]]).any()


def test_rejection_rejects_tokens_with_zero_draft_probability():
  # q = 0 at the proposed token (here: all of q zero, a position that is not a proposal) must
  # reject even when p gives the token most of its mass; the token is then drawn from p.
  p = jnp.broadcast_to(jnp.array([0.9, 0.1, 0.0]), (4096, 2, 3))
  draft = jnp.zeros((4096, 1), jnp.int32)
  n, nxt = rejection_sample(jax.random.PRNGKey(0), draft, jnp.zeros((4096, 1, 3)), p)
  assert (np.asarray(n) == 0).all()
  assert 0.85 < (np.asarray(nxt) == 0).mean() < 0.95
  q = jnp.broadcast_to(jnp.array([0.0, 1.0, 0.0]), (4096, 1, 3))    # q(x) = 0, q elsewhere
  n, _ = rejection_sample(jax.random.PRNGKey(1), draft, q, p)
  assert (np.asarray(n) == 0).all()


# ---------------------------------------------------------------- n-gram lookup

def test_lookup_longest_match_wins():
  # last 2 tokens (5, 6) recur at 2..3 -> 9; the last token alone recurs later at 7 -> 8.
  context = [1, 2, 5, 6, 9, 4, 0, 6, 8, 5, 6]
  assert lookup(context, 2, max_ngram=2, min_ngram=1) == [9, 4]
  assert lookup(context, 2, max_ngram=1, min_ngram=1) == [8, 5]


def test_lookup_most_recent_occurrence_and_short_continuations():
  context = [7, 1, 2, 7, 3, 4, 7]
  assert lookup(context, 2, 1, 1) == [3, 4]                    # the later of two matches
  assert lookup(context, 5, 1, 1) == [3, 4, 7]                 # fewer than K follow it
  assert lookup([4, 4], 3, 3, 1) == [4]                        # overlapping suffix is fine
  assert lookup([1, 2, 3, 4], 3, 3, 1) == []                   # no recurring n-gram
  assert lookup([5, 1, 2, 5], 3, 3, 2) == []                   # only a 1-gram recurs
  assert lookup([5], 3, 3, 1) == [] and lookup([5, 5, 5], 0, 3, 1) == []


def test_ngram_propose_respects_caps_and_idle_rows():
  drafter = NGramDrafter(max_ngram=2)
  proposals, num = drafter.propose([[7, 1, 2, 7], None, [7, 1, 2, 7], [1, 2, 3]],
                                   np.array([3, 3, 1, 3]), 3)
  assert num.tolist() == [3, 0, 1, 0]
  assert proposals[0].tolist() == [1, 2, 7] and proposals[2, 0] == 1
  with pytest.raises(ValueError, match='min_ngram=3 exceeds max_ngram=2'):
    NGramDrafter(max_ngram=2, min_ngram=3)
  with pytest.raises(ValueError, match='max_ngram must be an int >= 1, got 0'):
    NGramDrafter(max_ngram=0)


def test_make_drafter_builds_a_named_drafter_with_its_options_and_names_a_bad_one():
  drafter = make_drafter('model', True, probe_every=3, fill_prefill=True)
  assert isinstance(drafter, ModelDrafter) and drafter.probe_every == 3
  assert (drafter.fill_prefill, drafter.overlap_choice) == (True, True)
  assert make_drafter(None, True, probe_rows=2).probe_rows == 2     # None with a draft: 'model'
  assert make_drafter('ngram', False, max_ngram=5).max_ngram == 5
  assert make_drafter(drafter, True) is drafter and make_drafter(None, False) is None
  with pytest.raises(ValueError, match=r"drafter 'model' has no option 'probe_evry' \(known: "
                                       r".*probe_every"):
    make_drafter('model', True, probe_evry=4)
  with pytest.raises(ValueError, match=r"drafter 'model' with .*overlap_choice must be a bool"):
    make_drafter('model', True, overlap_choice=1)
  with pytest.raises(ValueError, match='need a drafter name, not'):
    make_drafter(drafter, True, probe_rows=2)
  with pytest.raises(ValueError, match='need a drafter name, not None'):
    make_drafter(None, False, max_ngram=2)                          # no draft model: no drafter
  with pytest.raises(ValueError, match="unknown drafter 'eagle'"):
    make_drafter('eagle', True, probe_rows=2)
  with pytest.raises(ValueError, match='fill_prefill=True .* with probe_every=None it never'):
    ModelDrafter(fill_prefill=True, probe_every=None)             # a switch that would do nothing


def test_bad_engine_arguments(tiny, tiny_draft):
  config, params = tiny
  draft = dict(draft=tiny_draft[0], draft_params=tiny_draft[1])
  base = dict(num_slots=2, num_pages=8)
  cases = [
      (dict(drafter='eagle', k=2), "unknown drafter 'eagle'"),
      (dict(drafter='ngram', k=2, **draft), "drafter='ngram'.*takes no draft model"),
      (dict(drafter='model', k=2), "drafter='model' needs a draft model"),
      (dict(drafter=ModelDrafter(), k=2), 'needs a draft model, got draft=None'),
      (dict(drafter='ngram'), "drafter='ngram', k=0"),
      (dict(drafter='ngram', k=17), 'got k=17'),
      (dict(k_policy='goodput'), "k_policy='goodput' chooses K but the engine does not"),
      (dict(drafter='ngram', k=2, k_policy='best'), "unknown k_policy 'best'"),
      (dict(drafter='ngram', k=2, k_policy=GoodputK(candidates=[0, 5])), r'candidates \(0, 5\)'),
      (dict(drafter='ngram', k=2, k_policy=GoodputK(costs={0: 1.0, 1: 1.0})), 'misses K in'),
      # Options of a lazy draft cache where the engine keeps none: a fixed K >= 1, lazy=False.
      (dict(drafter=ModelDrafter(probe_every=3, fill_prefill=True), k=2, **draft),
       r"drafter options \['fill_prefill', 'probe_every'\] act on the lazy draft cache, which "
       r"this engine does not keep \(its K policy, FixedK, never chooses K = 0"),
      (dict(drafter=ModelDrafter(lazy=False, probe_new=True), k=2, k_policy='goodput', **draft),
       r"drafter options \['probe_new'\] act on the lazy draft cache.*\(the drafter has "
       r"lazy=False\)"),
      (dict(drafter=ModelDrafter(probe_every=4), k=2, k_policy='schedule', **draft),
       r"\['probe_every'\] act on .*\(its K policy, ScheduleK, never chooses K = 0\)"),
  ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      Engine(config, params, **base, **kwargs)

  class Bad(Scripted):
    def choose(self, request_ids):
      return 2, [3] * len(request_ids)

  engine = Engine(config, params, num_pages=BIG, drafter='ngram', k=K, k_policy=Bad([2]),
                  **SHAPES)
  engine.add_request([3, 4, 5], max_tokens=4)
  with pytest.raises(ValueError, match=r'chose K=2 .* caps \[3\]'):
    engine.run()

  class BeyondKMax(KPolicy):          # declares a K above the engine's k: refused up front
    candidates = (0, 6)

    def choose(self, request_ids):
      return 6, [6] * len(request_ids)

  with pytest.raises(ValueError, match=r'declares candidates \(0, 6\): each must be an int in '
                                       r'\[0, k=1\]'):
    Engine(config, params, **base, drafter='ngram', k=1, k_policy=BeyondKMax())
  shared = ScheduleK()
  # An engine that fails to build gives the instance back (it was bound, and refused for the
  # corrected retry): a bad seed after setup, ScheduleK's own K_max check in setup.
  with pytest.raises(ValueError, match='seed must be a 64-bit int'):
    Engine(config, params, **base, drafter='ngram', k=2, k_policy=shared, seed=0.5)
  picky = ScheduleK(min_k=3)
  with pytest.raises(ValueError, match='ScheduleK min_k=3 exceeds K_max=2'):
    Engine(config, params, **base, drafter='ngram', k=2, k_policy=picky)
  Engine(config, params, **base, drafter='ngram', k=3, k_policy=picky)   # was: already bound
  # The same options where a lazy draft cache is kept; defaults anywhere; the refused engine's
  # policy instance freed for the next.
  lazy = Engine(config, params, **base, **draft, k=2, k_policy='goodput',
                drafter=ModelDrafter(probe_every=3, fill_prefill=True))
  assert (lazy.draft_sync.probe_every, lazy.draft_sync.fill_prefill) == (3, True)
  assert Engine(config, params, **base, **draft, k=2, drafter=ModelDrafter()).draft_sync is None
  fixed = FixedK()
  with pytest.raises(ValueError, match=r"\['probe_budget'\] act on the lazy draft cache"):
    Engine(config, params, **base, **draft, k=2, k_policy=fixed,
           drafter=ModelDrafter(probe_budget=0.5))
  Engine(config, params, **base, **draft, k=2, k_policy=fixed)
  Engine(config, params, **base, drafter='ngram', k=2, k_policy=shared)
  with pytest.raises(ValueError, match='already bound to an engine'):
    Engine(config, params, **base, drafter='ngram', k=2, k_policy=shared)
  assert shared.k_max == 2                          # the refusal left the first binding alone
  lookup_policy = FixedK()
  with pytest.raises(ValueError, match='prefill_group must be an int'):
    EvictingEngine(config, params, policy=make_policy('window', 8, reuse_delay=3), num_slots=2,
                   num_pages=8, page_size=L, chunk_size=8, drafter='ngram', k=2,
                   k_policy=lookup_policy, prefill_group=3)
  assert lookup_policy.k_max is None
  with pytest.raises(ValueError, match='initial must be an int'):
    ScheduleK(initial=2.5)


def test_lookup_and_run_refuse_bad_values(tiny):
  for args, message in [((2, 2, 0), 'min_ngram=0'), ((2, 1, 2), 'min_ngram=2, max_ngram=1'),
                        ((None, 2, 1), 'k must be an int, got None')]:
    with pytest.raises(ValueError, match=message):
      lookup([1, 2, 1, 2], *args)
  config, params = tiny
  engine = Engine(config, params, num_slots=2, num_pages=8, page_size=L, chunk_size=8)
  with pytest.raises(ValueError, match='max_steps must be an int >= 0, got -1'):
    engine.run(max_steps=-1)
  with pytest.raises(ValueError, match="stop_tokens must be token ids, got the string '12'"):
    engine.add_request([3, 4], max_tokens=2, stop_tokens='12')


def test_model_drafter_names_a_bad_probe_setting_and_takes_numpy_numbers():
  assert ModelDrafter(probe_budget=np.float32(0.25)).probe_budget == 0.25
  assert type(ModelDrafter(probe_budget=np.float32(0.25)).probe_budget) is float
  for bad in (0, 1.5, np.True_, '0.1', float('nan')):
    with pytest.raises(ValueError,
                       match=r'probe_budget \(or None\) must be a finite number in \(0, 1\]'):
      ModelDrafter(probe_budget=bad)
