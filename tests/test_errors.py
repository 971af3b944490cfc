"""Bad input gets a clear error naming the value, never a silent wrong result."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.checks import check_int, check_real, is_int_in
from jaxspec.decoding import (ContextOverflowError, PrefixCachedGenerator, SamplingParams,
                              generate)
from jaxspec.decoding.steps import LocalSteps
from jaxspec.models import ModelConfig


def test_prompt_longer_than_context(tiny):
  config, params = tiny
  prompt = [5] * (config.max_seq_len - 10)
  with pytest.raises(ContextOverflowError,
                     match=rf'prompt 0 of {len(prompt)} tokens .* exceeds the context '
                           rf'of {config.max_seq_len}'):
    generate(config, params, [prompt], max_new_tokens=20)


def test_speculation_slack_counts_against_the_context(tiny):
  config, params = tiny
  prompt = [5] * (config.max_seq_len - 24)
  generate(config, params, [prompt], max_new_tokens=20)           # fits without a draft
  with pytest.raises(ContextOverflowError, match='exceeds the context'):
    generate(config, params, [prompt], max_new_tokens=20, draft=config, draft_params=params, k=8)


def test_a_draft_context_too_short_is_named_as_the_drafts(tiny):
  config, params = tiny
  draft = dataclasses.replace(config, max_seq_len=16)
  with pytest.raises(ValueError, match="= 17 exceeds the draft's context of 16"):
    generate(config, params, [[5] * 9], max_new_tokens=5, draft=draft, draft_params=params, k=2)


def test_seeds_apart_only_above_32_bits_give_apart_samples(tiny):
  # With 64-bit mode off PRNGKey keeps the low 32 bits: 1, 2**32 + 1 and 2**40 + 1 drew alike.
  from jaxspec.checks import seed_key  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  seeds = (1, 2 ** 32 + 1, 2 ** 40 + 1, -1, 2 ** 32 - 1, 2 ** 63 - 1, -2 ** 63, 0)
  keys = {tuple(np.asarray(seed_key(s)).tolist()) for s in seeds}
  assert len(keys) == len(seeds)
  np.testing.assert_array_equal(seed_key(12345), jax.random.PRNGKey(12345))   # unchanged below
  config, params = tiny
  run = lambda seed: generate(config, params, [[5, 6, 7]], max_new_tokens=12, seed=seed,
                              sampling=SamplingParams(1.0)).tokens
  assert not np.array_equal(run(1), run(2 ** 32 + 1))
  with pytest.raises(ValueError, match='seed must be a 64-bit int, got 18446744073709551616'):
    seed_key(2 ** 64)


def test_draft_tokens_refuses_k_below_one(tiny):
  from jaxspec.decoding.speculative import draft_tokens  # pylint: disable=import-outside-toplevel
  config, params = tiny
  with pytest.raises(ValueError, match='speculation length K must be an int >= 1, got 0'):
    draft_tokens(config, params, None, jnp.zeros((1,), jnp.int32), None, k=0,
                 sampling=SamplingParams())


@pytest.mark.parametrize('k', [0, -1, 17, 2.5, True, '2'])
def test_k_out_of_range(tiny, k):
  config, params = tiny
  with pytest.raises(ValueError, match=rf'K must be an int in \[1, 16\], got {k!r}'):
    generate(config, params, [[1, 2, 3]], max_new_tokens=4, draft=config, draft_params=params, k=k)


def test_the_jitted_speculative_loop_checks_k_and_the_vocabulary_itself(tiny):
  # Called directly (it is exported), k=0 ran as autoregressive decoding, k=-1 divided by zero
  # and a one-token draft vocabulary broadcast into a wrong distribution.
  from jaxspec.decoding import decode_speculative  # pylint: disable=import-outside-toplevel
  config, params = tiny
  args = (params, params, None, None, jnp.zeros((1,), jnp.int32), None, jnp.zeros((0,), jnp.int32))
  for k, draft, bad in ((0, config, 'K must be an int >= 1, got k=0'),
                        (-1, config, 'got k=-1'),
                        (2, dataclasses.replace(config, vocab_size=1),
                         r'draft vocabulary \(1\) differs from the target vocabulary \(64\)')):
    with pytest.raises(ValueError, match=bad):
      decode_speculative(config, draft, *args, k=k, sampling=SamplingParams(), max_new_tokens=4)


def test_exact_verify_refuses_a_verification_past_its_exact_rows(tiny):
  # K + 1 > 32 rows fell back to one plain matmul: verification ~3e-5 off decode, no error.
  config, params = tiny
  with pytest.raises(ValueError, match=r'K = 32 with exact_verify: a verification of K \+ 1 = '
                                       r'33 tokens is past the 32 rows'):
    generate(config, params, [[1, 2, 3]], max_new_tokens=4, draft=config, draft_params=params,
             k=32, max_k=64)
  from jaxspec.decoding import decode_speculative  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match='K = 40 with exact_verify'):     # the jitted loop too
    decode_speculative(config, config, params, params, None, None, jnp.zeros((1,), jnp.int32),
                       None, jnp.zeros((0,), jnp.int32), k=40, sampling=SamplingParams(),
                       max_new_tokens=4)


def test_integer_checks_take_numpy_integers_and_refuse_the_rest():
  for value in (3, np.int64(3), np.uint8(3), np.array(3), jnp.int32(3)):
    assert check_int('n', value, 1) == 3 and type(check_int('n', value, 1)) is int
  for value in (True, np.bool_(True), jnp.array(True), 3.0, '3', None, np.array([3])):
    with pytest.raises(ValueError, match=rf'n must be an int >= 1, got {re.escape(repr(value))}'):
      check_int('n', value, 1)
  with pytest.raises(ValueError, match='n must be an int >= 1, got 0'):
    check_int('n', 0, 1)
  assert check_int('n', -5) == -5 and is_int_in(np.int16(4), 1, 4) and not is_int_in(5, 1, 4)


def test_real_checks_honour_each_end_of_the_interval():
  assert check_real('x', np.float32(0.5), 0, 1) == 0.5 and type(check_real('x', 1, 0, 1)) is float
  assert check_real('x', 0, 0, 1) == 0.0 and check_real('x', 1, 0, 1, low_open=True) == 1.0
  cases = [(0, dict(low_open=True), r'\(0, 1\]'), (1, dict(high_open=True), r'\[0, 1\)'),
           (0, dict(low_open=True, high_open=True), r'\(0, 1\)'), (1.5, {}, r'\[0, 1\]'),
           (float('nan'), {}, r'\[0, 1\]'), (True, {}, r'\[0, 1\]'), ('0.5', {}, r'\[0, 1\]')]
  for value, flags, bound in cases:
    with pytest.raises(ValueError, match=rf'x must be a finite number in {bound}, got '):
      check_real('x', value, 0, 1, **flags)


def test_draft_vocabulary_must_match(tiny):
  config, params = tiny
  other = dataclasses.replace(config, vocab_size=65)
  with pytest.raises(ValueError, match=r'draft vocabulary \(65\) differs from the target '
                                       r'vocabulary \(64\)'):
    generate(config, params, [[1, 2]], max_new_tokens=4, draft=other, draft_params=params, k=2)


@pytest.mark.parametrize('kwargs, match', [
    (dict(max_new_tokens=0), 'max_new_tokens must be an int >= 1, got 0'),
    (dict(max_new_tokens=4, stop_tokens=[64]), 'stop token id 64 outside'),
    (dict(max_new_tokens=4, stop_tokens=[2.7]), 'stop token ids must be ints, got 2.7'),
    (dict(max_new_tokens=4, stop_tokens=['5']), "stop token ids must be ints, got '5'"),
    (dict(max_new_tokens=4, stop_tokens=[3, True]), 'stop token ids must be ints, got True'),
])
def test_bad_generation_arguments(tiny, kwargs, match):
  config, params = tiny
  with pytest.raises(ValueError, match=match):
    generate(config, params, [[1, 2]], **kwargs)


def test_bad_prompts(tiny):
  config, params = tiny
  with pytest.raises(ValueError, match='prompt 1 is empty'):
    generate(config, params, [[1], []], max_new_tokens=2)
  with pytest.raises(ValueError, match='token id 99 outside the vocabulary'):
    generate(config, params, [[1, 99]], max_new_tokens=2)
  with pytest.raises(ValueError, match='prompt 0 holds the bool True, not a token id'):
    generate(config, params, [[1, True]], max_new_tokens=2)


def test_bad_model_config():
  with pytest.raises(ValueError, match='num_heads=6 is not a multiple of num_kv_heads=4'):
    ModelConfig.from_name('test-tiny', num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match="unknown model preset 'nope'"):
    ModelConfig.from_name('nope')
  # An odd head failed at the first forward pass inside jnp.split, naming no field.
  with pytest.raises(ValueError, match='ModelConfig.head_dim must be even .*got 7'):
    ModelConfig.from_name('test-tiny', head_dim=7)


def test_a_prompt_bucket_past_the_context_pads_only_to_it(tiny, tiny_draft):
  # prompt_bucket=100000 sized the pool for 100000 tokens: RESOURCE_EXHAUSTED (320 GB).
  config, params = tiny
  draft, draft_params = tiny_draft
  draft = dataclasses.replace(draft, max_seq_len=config.max_seq_len - 8)  # the smaller context

  class Seen(Exception):
    pass

  class Recording(LocalSteps):
    """Records the width of the first prefill and stops there (nothing compiles)."""

    @staticmethod
    def prefill(model, model_params, cache, tokens, *args, **kwargs):
      del model, model_params, cache, args, kwargs
      raise Seen(tokens.shape[1])

  spec = dict(draft=draft, draft_params=draft_params, k=3, steps=Recording())
  with pytest.raises(Seen) as seen:
    generate(config, params, [[1, 5, 9], [2, 7]], max_new_tokens=5, prompt_bucket=10 ** 9,
             **spec)
  # Padded to the smaller context less max_new_tokens and K + 1 slack.
  assert seen.value.args == (draft.max_seq_len - 5 - 4,)
  gen = PrefixCachedGenerator(config, params, num_pages=64, prompt_bucket=10 ** 9, **spec)
  with pytest.raises(Seen) as seen:
    gen.generate([1, 5, 9], max_new_tokens=5)
  assert seen.value.args == (draft.max_seq_len,)


@pytest.mark.parametrize('kwargs, match', [
    (dict(prompt_bucket=0), 'prompt_bucket must be an int >= 1, got 0'),
    (dict(page_size=-8), 'page_size must be an int >= 1, got -8'),
    (dict(max_new_tokens=3.5), r'max_new_tokens must be an int >= 1, got 3\.5'),
    (dict(k=4), 'k=4 / draft_params given without a draft model'),
    (dict(seed=2 ** 63), 'seed must be a 64-bit int'),              # OverflowError in jax
    (dict(seed=1.5), 'seed must be a 64-bit int, got 1.5'),
    (dict(seed=True), 'seed must be a 64-bit int, got True'),       # ran as seed 1
    (dict(sampling={'temperature': 1.0}), 'sampling must be a SamplingParams'),
    (dict(sampling=None), 'sampling must be a SamplingParams, got None'),
    (dict(stop_tokens=5), 'stop_tokens must be a sequence of token ids, got 5'),
    (dict(stop_tokens=None), 'stop_tokens must be a sequence of token ids, got None'),
    (dict(max_k='a'), "max_k must be an int >= 1, got 'a'"),
])
def test_more_bad_generation_arguments(tiny, kwargs, match):
  config, params = tiny
  kwargs = {'max_new_tokens': 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    generate(config, params, [[1, 2]], **kwargs)
  with pytest.raises(ValueError, match='needs draft_params'):
    generate(config, params, [[1, 2]], max_new_tokens=4, draft=config, k=2)
  with pytest.raises(ValueError, match='flat sequence of int token ids'):
    generate(config, params, [[1.5, 2.0]], max_new_tokens=4)


def test_prompts_as_an_array_are_rows_and_a_generator_is_named(tiny):
  config, params = tiny
  rows = [[1, 2, 3], [4, 5, 6]]
  listed = generate(config, params, rows, max_new_tokens=3).tokens
  assert generate(config, params, np.array(rows), max_new_tokens=3).tokens == listed
  assert generate(config, params, jnp.array(rows), max_new_tokens=3).tokens == listed
  with pytest.raises(ValueError, match='prompts must be a list of token-id sequences .*generator'):
    generate(config, params, (r for r in rows), max_new_tokens=3)


def test_a_module_passed_as_the_model_config_is_named(tiny):
  """`Transformer(config)` where the config belongs: a TypeError naming the argument and the
  type, from every entry point, before flax fails on a missing field."""
  from jaxspec.engine import Engine  # pylint: disable=import-outside-toplevel
  from jaxspec.models import Transformer, save_model  # pylint: disable=import-outside-toplevel
  config, params = tiny
  module = Transformer(config)
  with pytest.raises(TypeError, match='target must be a jaxspec ModelConfig .* got Transformer'):
    generate(module, params, [[1, 2]], max_new_tokens=2)
  with pytest.raises(TypeError, match='draft must be a jaxspec ModelConfig .* got Transformer'):
    generate(config, params, [[1, 2]], max_new_tokens=2, draft=module, draft_params=params, k=2)
  with pytest.raises(TypeError, match='target must be .* got Transformer'):
    Engine(module, params, num_slots=2, num_pages=16)
  with pytest.raises(TypeError, match='target must be .* got dict'):
    PrefixCachedGenerator(dict(vocab_size=64), params, num_pages=16)
  with pytest.raises(TypeError, match='the model of params given to save_model .* got str'):
    save_model('/nonexistent-never-written', 'test-tiny', params)


def test_params_of_another_model_are_named_before_anything_runs(tiny):
  from jaxspec.engine import Engine  # pylint: disable=import-outside-toplevel
  from jaxspec.models import CheckpointError  # pylint: disable=import-outside-toplevel
  from jaxspec.training import init_params  # pylint: disable=import-outside-toplevel
  config, params = tiny
  other = init_params(dataclasses.replace(config, d_model=config.d_model * 2), 0)
  with pytest.raises(CheckpointError, match=r'target_params: tensor \[.*has shape'):
    generate(config, other, [[1, 2]], max_new_tokens=2)
  with pytest.raises(CheckpointError, match='draft_params'):
    generate(config, params, [[1, 2]], max_new_tokens=2, draft=config, draft_params=other, k=2)
  with pytest.raises(CheckpointError, match='target_params'):
    Engine(config, other, num_slots=2, num_pages=16)


@pytest.mark.parametrize('max_seq_len, k', [(2, 0), (4, 2)])
def test_an_engine_whose_max_seq_len_admits_no_request_is_refused(tiny, max_seq_len, k):
  from jaxspec.engine import Engine  # pylint: disable=import-outside-toplevel
  config, params = tiny
  spec = dict(drafter='ngram', k=k) if k else {}
  with pytest.raises(ValueError, match=f'max_seq_len={max_seq_len} admits no request'):
    Engine(config, params, num_slots=2, num_pages=16, max_seq_len=max_seq_len, **spec)
  Engine(config, params, num_slots=2, num_pages=16, max_seq_len=max_seq_len + 1, **spec)


@pytest.mark.parametrize('temperature', [1e-40, float('inf'), float('nan'), 1e7, 1e39])
def test_temperatures_that_overflow_are_refused(temperature):
  from jaxspec.decoding import SamplingParams
  with pytest.raises(ValueError, match='temperature'):
    SamplingParams(temperature)


@pytest.mark.parametrize('field, value', [('rope_theta', 0.0), ('norm_eps', -1.0),
                                          ('rope_theta', float('nan'))])
def test_model_config_rejects_non_positive_floats(field, value):
  with pytest.raises(ValueError, match=field):
    ModelConfig.from_name('test-tiny', **{field: value})


def test_stop_ids_from_a_generator_or_a_jax_array_are_kept(tiny):
  # A one-shot iterable was read twice (checked, then tabled) and left an empty stop table.
  import jax.numpy as jnp
  from jaxspec.decoding.generate import check_request
  config, _ = tiny
  for stop in ((t for t in [5, 3]), jnp.asarray([5, 3]), np.array([3, 5], np.int64)):
    assert check_request(config, [[1, 2]], max_new_tokens=2, stop_tokens=stop)[2].tolist() == [3, 5]


def test_the_loops_under_eviction_name_bad_arguments(tiny):
  import jax  # pylint: disable=import-outside-toplevel
  from jaxspec.cache import init_eviction, make_policy  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from jaxspec.decoding import (SamplingParams, decode_autoregressive_evicting,
                                decode_speculative_evicting, prefill_evicting)
  from jaxspec.models import cache_for  # pylint: disable=import-outside-toplevel
  config, params = tiny
  policy = make_policy('h2o', 8, reuse_delay=3)

  def fresh():
    cache = cache_for(config, np.arange(1, 4)[None], 4, 8)
    return cache, init_eviction(policy, cache)

  tokens, rng, greedy = jnp.array([[1, 2, 3, 0]]), jax.random.PRNGKey(0), SamplingParams()
  for lengths, match in (([0], r'prompt_lengths must lie in \[1, P=4\], got 0'),
                         ([5], r'prompt_lengths must lie in \[1, P=4\], got 5'),
                         ([3, 3], 'tokens must be .B, P. and prompt_lengths .B.')):
    with pytest.raises(ValueError, match=match):
      prefill_evicting(config, params, *fresh(), tokens, jnp.array(lengths), rng, sampling=greedy)
  with pytest.raises(ValueError, match='tokens holds token id 999 outside the vocabulary'):
    prefill_evicting(config, params, *fresh(), tokens.at[0, 1].set(999), jnp.array([3]), rng,
                     sampling=greedy)
  first, cache, eviction = prefill_evicting(config, params, *fresh(), tokens.at[0, 3].set(999),
                                            jnp.array([3]), rng, sampling=greedy)  # padding
  stop = jnp.full((1, 1), -1, jnp.int32)
  with pytest.raises(ValueError, match='max_new_tokens must be an int >= 1, got -1'):
    decode_autoregressive_evicting(config, params, cache, eviction, first, rng, stop,
                                   sampling=greedy, max_new_tokens=-1)
  with pytest.raises(ValueError, match='first_token holds token id 500'):
    decode_autoregressive_evicting(config, params, cache, eviction, jnp.array([500]), rng, stop,
                                   sampling=greedy, max_new_tokens=2)
  draft_cache = cache_for(config, np.arange(1, 4)[None], 4, 8)
  with pytest.raises(ValueError, match='speculation length K must be an int >= 1, got -1'):
    decode_speculative_evicting(config, config, params, params, cache, eviction, draft_cache,
                                first, rng, stop, k=-1, sampling=greedy, max_new_tokens=2)
  # Types and rows: a float prompt length drew the first token from all-zero logits (token 0);
  # float tokens, a list of lengths, another batch, [B, 1] first tokens or [3, 2] stop ids for
  # B = 1 were errors from deep inside flax or lax.
  for bad_tokens, bad_lengths, match in (
      (tokens, jnp.array([2.5]), r'prompt_lengths must be an integer array \[B\] with B = 1 '
                                 r'\(the cache\'s rows\), got float32 of shape \(1,\)'),
      (tokens.astype(jnp.float32), jnp.array([3]), 'tokens must be an integer array .B, P.'),
      (jnp.concatenate([tokens, tokens]), jnp.array([3, 3]), 'with B = 1'),
      (tokens, [True], 'prompt_lengths must be an integer array')):
    with pytest.raises(ValueError, match=match):
      prefill_evicting(config, params, *fresh(), bad_tokens, bad_lengths, rng, sampling=greedy)
  assert prefill_evicting(config, params, *fresh(), tokens, [3], rng, sampling=greedy)[0].shape \
      == (1,)                                                     # a list of lengths is fine
  for bad_first, bad_stop, match in ((first[:, None], stop, 'first_token must be an integer'),
                                     (first.astype(jnp.float32), stop, 'first_token must be'),
                                     (first, jnp.zeros((3, 2), jnp.int32), 'stop_tokens must be'),
                                     (first, [0.5], 'stop_tokens must be an integer')):
    with pytest.raises(ValueError, match=match):
      decode_autoregressive_evicting(config, params, cache, eviction, bad_first, rng, bad_stop,
                                     sampling=greedy, max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
      decode_speculative_evicting(config, config, params, params, cache, eviction, draft_cache,
                                  bad_first, rng, bad_stop, k=2, sampling=greedy,
                                  max_new_tokens=2)


def test_a_full_policy_cache_too_small_for_the_sequence_is_named(tiny, tiny_draft):
  # A token with no slot went to the null page: the worker experiment's 'full' run silently kept
  # 576 of 768 tokens.
  import jax  # pylint: disable=import-outside-toplevel
  from jaxspec.cache import init_eviction, make_policy  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from jaxspec.decoding import (SamplingParams, decode_autoregressive_evicting,
                                decode_speculative_evicting, generate, prefill_evicting)
  from jaxspec.models import cache_for  # pylint: disable=import-outside-toplevel
  config, params = tiny
  draft, draft_params = tiny_draft
  greedy, rng, stop = SamplingParams(), jax.random.PRNGKey(0), jnp.full((1, 1), -1, jnp.int32)

  def prefilled(pages, reuse_delay=0, model=config, model_params=params):
    cache = cache_for(model, np.arange(1, pages + 1)[None], pages + 1, 8)   # 8 slots a page
    eviction = init_eviction(make_policy('full', reuse_delay=reuse_delay), cache)
    return prefill_evicting(model, model_params, cache, eviction, jnp.array([[5, 6, 7]]),
                            jnp.array([3]), rng, sampling=greedy)

  with pytest.raises(ValueError, match=r"prompts under policy 'full' need 3 cache slots per "
                                       r'sequence, the cache holds 0'):
    prefilled(0)
  first, cache, eviction = prefilled(3)                      # 24 slots: 3 + 22 - 1 tokens fit
  out, cache, eviction = decode_autoregressive_evicting(config, params, cache, eviction, first,
                                                        rng, stop, sampling=greedy,
                                                        max_new_tokens=22)
  assert int(eviction.num_live.max()) == int(cache.lengths[0]) == 24   # every token has a slot
  want = generate(config, params, [[5, 6, 7]], max_new_tokens=22, page_size=8).tokens[0]
  assert np.asarray(out.tokens)[0, :int(out.num_tokens[0])].tolist() == want
  first, cache, eviction = prefilled(3)
  with pytest.raises(ValueError, match=r"max_new_tokens=23 under policy 'full' need 25 cache "
                                       r'slots per sequence, the cache holds 24'):
    decode_autoregressive_evicting(config, params, cache, eviction, first, rng, stop,
                                   sampling=greedy, max_new_tokens=23)
  # Speculative: the same bound (a last round's drafts past it are rejected or cut).
  for max_new, fits in ((22, True), (23, False)):
    first, cache, eviction = prefilled(3, reuse_delay=3)
    _, draft_cache, _ = prefilled(3, model=draft, model_params=draft_params)
    call = lambda: decode_speculative_evicting(
        config, draft, params, draft_params, cache, eviction, draft_cache, first, rng, stop, k=2,
        sampling=greedy, max_new_tokens=max_new)
    if fits:
      out, _, cache, eviction, _ = call()
      assert int(eviction.num_live.max()) == int(cache.lengths[0]) == 24
      assert np.asarray(out.tokens)[0, :int(out.num_tokens[0])].tolist() == want
    else:
      with pytest.raises(ValueError, match=r"the target's cache, decoding max_new_tokens=23 under "
                                           r"policy 'full' need 25 cache slots"):
        call()


@pytest.mark.parametrize('change, match', [
    (dict(prefix_caching='no'), "prefix_caching='no': prefix caching is not supported"),
    (dict(host_pages=0.0), 'host_pages=0.0: the host tier is not supported'),
    (dict(prefill_rows=2.0), r'prefill_rows=2.0 must equal num_slots=2'),
    (dict(decode_buckets=[2.0]), r'decode_buckets=\[2.0\] must be None or \(num_slots,\)'),
])
def test_evicting_engine_names_the_value_it_refuses(tiny, change, match):
  from jaxspec.cache import make_policy  # pylint: disable=import-outside-toplevel
  from jaxspec.engine import EvictingEngine  # pylint: disable=import-outside-toplevel
  config, params = tiny
  with pytest.raises(ValueError, match=match):
    EvictingEngine(config, params, policy=make_policy('h2o', 8), num_slots=2, num_pages=8,
                   **change)

