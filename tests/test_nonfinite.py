"""Non-finite logits (a float16 model that overflows, NaN weights) are an error, never a token:
`probabilities` gives such a row no distribution, `sample` draws INVALID_TOKEN from it, the
decode loops end the row there, `generate` raises naming the row, and the engine finishes only
that request with finish_reason 'error' while the others are served as before."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import (INVALID_TOKEN, NonFiniteLogitsError, PrefixCachedGenerator,
                              RowSampling, SamplingParams, cut_lengths, generate, probabilities,
                              rejection_sample, sample)
import jaxspec.engine as engine_module
from jaxspec.engine import Engine, KPolicy, ModelDrafter, check_outputs

V = 8
SETTINGS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=3, top_p=0.9),
            RowSampling.stack([SamplingParams(), SamplingParams(temperature=1.0),
                            SamplingParams(temperature=0.5, top_p=0.8), SamplingParams()])]


@pytest.mark.parametrize('params', SETTINGS, ids=['greedy', 'sampled', 'rows'])
def test_rows_with_nan_or_inf_logits_or_no_allowed_token_draw_the_invalid_token(params):
  logits = jnp.tile(jnp.linspace(-1.0, 1.0, V), (4, 1))
  logits = logits.at[1, 3].set(jnp.nan).at[2, 5].set(jnp.inf)
  mask = jnp.ones((4, V), bool).at[3].set(False)            # row 3: no token allowed
  probs = probabilities(logits, params, mask)
  np.testing.assert_allclose(probs[0].sum(), 1.0, rtol=1e-6)
  assert np.isnan(probs[1:]).all()
  tokens = sample(jax.random.PRNGKey(0), probs)
  assert 0 <= int(tokens[0]) < V and tokens[1:].tolist() == [INVALID_TOKEN] * 3


def test_sample_from_all_zero_probabilities_is_invalid():
  probs = jnp.zeros((2, V)).at[0, 2].set(1.0)
  assert sample(jax.random.PRNGKey(1), probs).tolist() == [2, INVALID_TOKEN]


def test_rejection_sampling_emits_the_invalid_token_where_the_target_is_not_finite():
  p = jax.nn.one_hot(jnp.array([[4, 5, 6, 7]]), V)                        # [1, K+1, V]
  p = p.at[0, 2].set(jnp.nan)                        # the target's row after x_2 is NaN
  xs = jnp.array([[4, 5, 6]])
  n, nxt = rejection_sample(jax.random.PRNGKey(0), xs, jax.nn.one_hot(xs, V), p)
  assert int(n[0]) == 2 and int(nxt[0]) == INVALID_TOKEN


def test_a_row_ends_at_the_invalid_token():
  window = jnp.array([[3, INVALID_TOKEN, 4], [3, 4, 5]])
  n, stopped = cut_lengths(window, jnp.array([3, 3]), jnp.zeros((0,), jnp.int32),
                           jnp.array([9, 9]))
  assert n.tolist() == [2, 3] and stopped.tolist() == [True, False]


def _poisoned(tiny, prompts, clean):
  """(params whose embedding of one token is NaN, that token, index in prompt 1's output of its
  first emission): prompt 0 never sees the token, prompt 1 emits it in decode, so prompt 1's
  logits turn NaN one step later."""
  config, params = tiny
  seen = set(prompts[0]) | set(clean[0]) | set(prompts[1])
  j = next(j for j in range(1, len(clean[1]) - 1)
           if clean[1][j] not in seen | set(clean[1][:j]))
  bad = clean[1][j]
  embed = params['params']['embed']['embedding']
  poisoned = {'params': {**params['params'], 'embed': {'embedding': embed.at[bad].set(jnp.nan)}}}
  return poisoned, j


PROMPTS = [[5, 9, 11, 13, 17], [7, 8, 20, 22]]
MAX_NEW = 12


@pytest.mark.parametrize('speculative', [False, True], ids=['autoregressive', 'speculative'])
def test_generate_raises_naming_the_row_whose_logits_turned_nan(tiny, tiny_draft, speculative):
  config, params = tiny
  spec = dict(draft=tiny_draft[0], draft_params=tiny_draft[1], k=3) if speculative else {}
  clean = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8, **spec).tokens
  poisoned, j = _poisoned(tiny, PROMPTS, clean)
  with pytest.raises(NonFiniteLogitsError, match=f'prompt 1 at token {j + 1}: a float16'):
    generate(config, poisoned, PROMPTS, max_new_tokens=MAX_NEW, page_size=8, **spec)


def test_a_draft_whose_logits_turn_nan_is_counted_warned_and_refused_for_measurement(
    tiny, tiny_draft):
  # Its proposals are INVALID_TOKEN and rejected, so the tokens are the target's; the run then
  # reported alpha = 0 as a measurement of the draft, without a word.
  config, params = tiny
  draft, draft_params = tiny_draft
  want = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8)
  clean = generate(draft, draft_params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8).tokens
  poisoned, _ = _poisoned((draft, draft_params), PROMPTS, clean)   # prompt 1's rows turn NaN
  spec = dict(draft=draft, page_size=8, k=3)
  with pytest.warns(UserWarning, match=r"the draft's logits were not finite \(NaN or \+inf\) in "
                                       r'\d+ of \d+ rounds'):
    got = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, draft_params=poisoned, **spec)
  assert got.tokens == want.tokens and 0 < got.draft_failed < got.target_calls
  with pytest.raises(NonFiniteLogitsError, match=rf"the draft \(x\)'s logits .* in "
                                                 rf'{got.draft_failed} of {got.target_calls}'):
    got.check_draft('the draft (x)')
  fine = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, draft_params=draft_params,
                  **spec)
  assert fine.draft_failed == 0 and fine.check_draft() is fine


def test_the_engine_counts_rounds_whose_draft_failed_and_check_outputs_refuses_them(
    tiny, tiny_draft):
  config, params = tiny
  draft, draft_params = tiny_draft
  want = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8).tokens
  clean = generate(draft, draft_params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8).tokens
  poisoned, _ = _poisoned((draft, draft_params), PROMPTS, clean)   # prompt 1's rows turn NaN
  engine = Engine(config, params, num_slots=2, num_pages=24, page_size=8, chunk_size=8,
                  draft=draft, draft_params=poisoned, k=3)
  ids = [engine.add_request(p, max_tokens=MAX_NEW) for p in PROMPTS]
  outs = engine.run()
  assert [outs[i].tokens for i in ids] == want                # served: the target's tokens
  assert outs[ids[0]].metrics.draft_failed == 0 < outs[ids[1]].metrics.draft_failed
  with pytest.raises(NonFiniteLogitsError, match=r"the draft's logits were not finite .* "
                                                 r'\(requests 1\)'):
    check_outputs(outs)
  assert check_outputs([outs[ids[0]]]) == [outs[ids[0]]]


class AlwaysK0(KPolicy):
  """K = 0 every round (candidates 0..K_max, so the draft is kept and probed)."""

  def choose(self, request_ids):
    return 0, [0] * len(request_ids)


@pytest.mark.parametrize('lazy', [True, False], ids=['lazy_probes', 'eager_k0_rounds'])
def test_a_failed_draft_is_counted_in_k0_rounds_and_probes_too(tiny, tiny_draft, lazy):
  # A lazy draft's catch-ups and an eager draft's K = 0 rounds scored a NaN draft as alpha = 0
  # without a count: a goodput run at K = 0 throughout passed check_outputs.
  config, params = tiny
  draft, draft_params = tiny_draft
  broken = {'params': {**draft_params['params'], 'final_norm': jax.tree.map(
      lambda x: x * jnp.nan, draft_params['params']['final_norm'])}}
  engine = Engine(config, params, num_slots=2, num_pages=24, page_size=8, chunk_size=8,
                  draft=draft, draft_params=broken, k=3, k_policy=AlwaysK0(),
                  drafter=ModelDrafter(probe_every=2, probe_budget=None) if lazy else
                  ModelDrafter(lazy=False))
  ids = [engine.add_request(p, max_tokens=MAX_NEW) for p in PROMPTS]
  outs = engine.run()
  want = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8).tokens
  assert [outs[i].tokens for i in ids] == want and set(engine.k_rounds) == {0}
  failed = [outs[i].metrics.draft_failed for i in ids]      # probes catch up some requests
  assert (any if lazy else all)(n > 0 for n in failed)
  with pytest.raises(NonFiniteLogitsError, match="the draft's logits were not finite"):
    check_outputs(outs)


@pytest.mark.parametrize('k', [0, 3])
def test_engine_fails_only_the_request_whose_logits_turned_nan(tiny, tiny_draft, k):
  config, params = tiny
  clean = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8).tokens
  poisoned, j = _poisoned(tiny, PROMPTS, clean)
  spec = dict(draft=tiny_draft[0], draft_params=tiny_draft[1], k=k) if k else {}
  engine = Engine(config, poisoned, num_slots=3, num_pages=24, page_size=8, chunk_size=8, **spec)
  ids = [engine.add_request(p, max_tokens=MAX_NEW) for p in PROMPTS]
  outs = engine.run()
  assert outs[ids[0]].tokens == clean[0] and outs[ids[0]].finish_reason == 'length'
  failed = outs[ids[1]]
  assert failed.finish_reason == 'error' and failed.tokens == clean[1][:j + 1]
  assert 'not finite' in failed.error and INVALID_TOKEN not in failed.tokens
  assert engine.prefix.num_held == 0
  for given in (outs.values(), outs):      # the mapping run() returns: its keys were iterated
    with pytest.raises(NonFiniteLogitsError, match=r'1 request failed \(1\)'):
      check_outputs(given)
  with pytest.raises(TypeError, match=r'check_outputs takes RequestOutputs .* got int \d'):
    check_outputs(list(outs))
  assert engine_module.NonFiniteLogitsError is NonFiniteLogitsError   # importable beside it


def test_prefix_generator_raises_and_caches_nothing_of_the_failed_request(tiny):
  config, params = tiny
  clean = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8).tokens
  poisoned, j = _poisoned(tiny, PROMPTS, clean)
  gen = PrefixCachedGenerator(config, poisoned, num_pages=16, page_size=4)
  with pytest.raises(NonFiniteLogitsError, match=f'prompt at token {j + 1}'):
    gen.generate(PROMPTS[1], max_new_tokens=MAX_NEW)
  assert gen.prefix.num_cached == 0 and gen.prefix.num_held == 0


def test_a_failed_request_leaves_no_page_in_the_prefix_cache(tiny):
  """A's prompt is a full page of healthy tokens, then a token whose embedding is NaN; B shares
  the page. Inside A's prefill chunk the NaN value at the later slot reaches the earlier queries
  (weight 0 times NaN), so the page A computed holds NaN: B, served from it, failed. A failed
  request's pages are not cached; B computes its own."""
  config, params = tiny
  config = dataclasses.replace(config, exact_verify=False)   # the whole chunk in one product
  head = [5, 9, 11, 13, 17, 19, 23, 29]                        # one page of 8 tokens
  poisoned = {'params': {**params['params'], 'embed': {
      'embedding': params['params']['embed']['embedding'].at[63].set(jnp.nan)}}}
  shapes = dict(num_slots=2, num_pages=24, page_size=8, chunk_size=16)
  alone = Engine(config, poisoned, **shapes)
  rid = alone.add_request(head + [31, 33], max_tokens=6)
  want = alone.run()[rid].tokens
  engine = Engine(config, poisoned, **shapes)
  failed = engine.add_request(head + [63, 30], max_tokens=6)
  assert engine.run()[failed].finish_reason == 'error'
  assert engine.prefix.num_cached == 0 and engine.prefix.num_free == 23
  rid = engine.add_request(head + [31, 33], max_tokens=6)
  out = engine.run()[rid]
  assert out.finish_reason == 'length' and out.tokens == want
  assert out.metrics.cached_tokens == 0


def test_a_rejected_proposal_whose_key_value_is_nan_changes_nothing(tiny):
  """The draft proposes token x, whose target embedding is NaN and which the target never emits;
  verification runs pending + K proposals in one product (exact_verify off). The NaN value of
  the rejected x reached the earlier queries as weight 0 times NaN, and the healthy rows
  failed; cached as key NaN, value 0 (`write_keys_values`), it reaches no one."""
  config, params = tiny
  config = dataclasses.replace(config, exact_verify=False)
  clean = generate(config, params, PROMPTS, max_new_tokens=MAX_NEW, page_size=8).tokens
  x = next(t for t in range(config.vocab_size)
           if all(t not in p + c for p, c in zip(PROMPTS, clean)))
  embed = params['params']['embed']['embedding']
  target = {'params': {**params['params'], 'embed': {'embedding': embed.at[x].set(jnp.nan)}}}
  head = params['params']['lm_head']['kernel']
  draft = {'params': {**params['params'], 'lm_head': {'kernel': head.at[:, x].add(50.0)}}}
  out = generate(config, target, PROMPTS, max_new_tokens=MAX_NEW, page_size=8, draft=config,
                 draft_params=draft, k=3)
  assert out.tokens == clean and out.proposed > 0 and out.accepted < out.proposed
