"""Hugging Face checkpoints: logits parity with transformers, greedy and speculative decoding with
loaded models, save/load round trips, tokenizers and errors a pair's setup meets (bad checkpoints:
test_hf_errors.py).

The fixtures (tests/fixtures/hf/<family>/) and their golden outputs come from
scripts/make_hf_fixtures.py (transformers on the CPU, float32); these tests never import torch.
"""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxspec.data import Tokenizer
from jaxspec.decoding import SamplingParams, generate
from jaxspec.models import (CheckpointError, ModelConfig, Transformer, load_model, load_pretrained,
                            param_shapes, save_pretrained)
from jaxspec.models import hf

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
FAMILIES = ('llama', 'llama-draft', 'mistral', 'qwen2')
# float32 logits agree with transformers' to 1.5e-5 on these fixtures (logits of std ~1.5);
# the bound leaves room for other CPUs' transcendental functions and summation orders.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope='module')
def loaded():
  """{family: (config, params, golden)}, each checkpoint read once."""
  out = {}
  for name in FAMILIES:
    config, params = load_pretrained(FIXTURES / name)
    out[name] = config, params, dict(np.load(FIXTURES / name / 'golden.npz'))
  return out


def _texts(golden):
  """Per prompt: the token ids of prompt + greedy continuation, minus the last token."""
  return [np.concatenate([golden['prompts'][i, :n], golden['greedy'][i]])[:-1]
          for i, n in enumerate(golden['prompt_lengths'])]


def _logits(config, params, ids):
  apply = jax.jit(Transformer(config).apply)
  positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
  return np.asarray(apply(params, jnp.asarray(ids, jnp.int32)[None], positions)[0][0])


@pytest.mark.parametrize('family', FAMILIES)
def test_logits_match_transformers_golden(loaded, family):
  config, params, golden = loaded[family]
  for i, ids in enumerate(_texts(golden)):
    assert len(ids) > 20                      # prompts cross many positions (and Mistral's window)
    np.testing.assert_allclose(_logits(config, params, ids), golden['logits'][i, :len(ids)],
                               rtol=0, atol=LOGITS_ATOL, err_msg=f'{family} prompt {i}')


@pytest.mark.parametrize('family', FAMILIES)
def test_greedy_continuations_match_transformers_exactly(loaded, family):
  config, params, golden = loaded[family]
  prompts = [golden['prompts'][i, :n].tolist() for i, n in enumerate(golden['prompt_lengths'])]
  out = generate(config, params, prompts, max_new_tokens=golden['greedy'].shape[1], page_size=8,
                 sampling=SamplingParams(temperature=0.0))
  assert out.tokens == golden['greedy'].tolist()


@pytest.mark.parametrize('family, change', [
    ('llama', dict(rope_scaling=())),              # the llama3 scaling is exercised ...
    ('mistral', dict(sliding_window=None)),        # ... and so is the sliding window
])
def test_fixture_exercises_the_feature(loaded, family, change):
  config, params, golden = loaded[family]
  ids = _texts(golden)[1]
  wrong = _logits(dataclasses.replace(config, **change), params, ids)
  assert np.abs(wrong - golden['logits'][1, :len(ids)]).max() > 100 * LOGITS_ATOL


def test_loaded_configs_have_each_familys_features(loaded):
  llama, mistral, qwen = (loaded[n][0] for n in ('llama', 'mistral', 'qwen2'))
  assert dict(llama.rope_scaling)['rope_type'] == 'llama3' and not llama.tie_embeddings
  assert mistral.sliding_window == 8 and mistral.head_dim * mistral.num_heads != mistral.d_model
  assert qwen.qkv_bias and qwen.tie_embeddings and 'lm_head' not in loaded['qwen2'][1]['params']
  assert loaded['qwen2'][1]['params']['layer_0']['attn']['q']['bias'].shape == (32,)


@pytest.mark.parametrize('target, draft', [('llama', 'llama-draft'), ('mistral', 'perturbed')])
def test_speculative_with_loaded_pair_equals_greedy_target(loaded, target, draft):
  tc, tp, golden = loaded[target]
  if draft == 'perturbed':                   # Mistral's window, through rollback and verification
    from conftest import perturbed
    dc, dp = tc, perturbed(tp, 0.3, 0)
  else:
    dc, dp, _ = loaded[draft]
  tc, dc = (dataclasses.replace(c, exact_verify=True) for c in (tc, dc))
  prompts = [golden['prompts'][i, :n].tolist() for i, n in enumerate(golden['prompt_lengths'])]
  ar = generate(tc, tp, prompts, max_new_tokens=24, page_size=8)
  assert [t[:12] for t in ar.tokens] == golden['greedy'].tolist()
  sp = generate(tc, tp, prompts, max_new_tokens=24, page_size=8, draft=dc, draft_params=dp, k=3)
  assert sp.tokens == ar.tokens
  assert 0.0 < sp.acceptance_rate < 1.0       # both accept and reject paths were taken


def _run_experiment(tmp_path, **overrides):
  from configs.speculative import get_config
  from experiments.records import Results
  from experiments import speculative
  config = get_config('smoke')
  config.update(dict(workloads='json', num_prompts=1, prompt_len=64, max_new_tokens=8, k=2,
                     exact_verify=True), **overrides)
  results = Results(tmp_path / 'run', config, verbose=False)
  speculative.run(config, results)
  return results.records


def test_experiment_runs_with_hugging_face_directories(tmp_path):
  records = _run_experiment(tmp_path, target=str(FIXTURES / 'llama'),
                            draft=str(FIXTURES / 'llama-draft'))
  assert records[0]['matches_autoregressive'] is True
  assert records[0]['tokens_generated'] >= 1


def test_draft_tokenizer_that_differs_is_a_clear_error(tmp_path):
  from experiments.speculative import load_pair
  draft = tmp_path / 'draft'
  shutil.copytree(FIXTURES / 'llama-draft', draft)
  vocab = json.loads((draft / 'tokenizer.json').read_text())
  model_vocab = vocab['model']['vocab']
  a, b = sorted(model_vocab, key=model_vocab.get)[100:102]
  model_vocab[a], model_vocab[b] = model_vocab[b], model_vocab[a]   # two ids swapped
  (draft / 'tokenizer.json').write_text(json.dumps(vocab))
  config = ml_collections.ConfigDict(dict(target=str(FIXTURES / 'llama'), draft=str(draft),
                                          tokenizer=''))
  with pytest.raises(ValueError, match=r'the tokenizer in use .*llama/tokenizer.json\) and the '
                                       r'draft tokenizer .*differ.*has id'):
    load_pair(config)
  # The shipped target with a Hugging Face draft: different vocabularies, named.
  config.target = ''
  config.draft = str(FIXTURES / 'llama-draft')
  with pytest.raises(ValueError, match=r'in use .*assets/tokenizer.json\) and the draft '
                                       r'tokenizer .*differ, in that order: vocabularies of 4096 '
                                       r'and 299 tokens'):
    load_pair(config)


def test_hugging_face_target_left_with_the_shipped_draft_is_a_clear_error():
  # Paired silently before: the shipped draft (4096 ids) cut to the target's 300, α = 0.
  from experiments.speculative import load_pair
  config = ml_collections.ConfigDict(dict(target=str(FIXTURES / 'llama'), draft='',
                                          tokenizer=''))
  with pytest.raises(ValueError, match=r'in use .*llama/tokenizer.json\) and the draft '
                                       r'tokenizer .*assets/tokenizer.json\) differ, in that '
                                       r'order: vocabularies of 299 and 4096 tokens.*'
                                       r'the shipped draft '
                                       r'speaks the shipped tokenizer: give a draft .*'
                                       r'--config.draft'):
    load_pair(config)


def test_a_mistyped_model_path_is_named_before_tokenizers_are_compared():
  # Was: 'the draft tokenizer ... differs from the tokenizer in use' (the typo fell back to the
  # shipped tokenizer).
  from experiments.speculative import load_pair
  config = ml_collections.ConfigDict(dict(target='/models/lama-typo',
                                          draft=str(FIXTURES / 'llama-draft'), tokenizer=''))
  with pytest.raises(CheckpointError, match=r'no model directory at /models/lama-typo '
                                            r'\(config.target\)'):
    load_pair(config)


def test_load_pretrained_names_a_missing_directory_as_missing(tmp_path):
  # Was 'no config.json in /x', as if the directory were there.
  with pytest.raises(CheckpointError, match=r'no model directory at .*/absent$'):
    load_pretrained(tmp_path / 'absent')
  with pytest.raises(CheckpointError, match=r'no config.json in .*/empty$'):
    (tmp_path / 'empty').mkdir()
    load_pretrained(tmp_path / 'empty')


def test_a_missing_tokenizer_is_named_before_any_model_loads(monkeypatch):
  from experiments import speculative
  monkeypatch.setattr(speculative, 'load_at_dtype', lambda *a: pytest.fail('loaded a model'))
  config = ml_collections.ConfigDict(dict(target='', draft='', tokenizer='/nothere.json'))
  with pytest.raises(FileNotFoundError, match='tokenizer file not found: /nothere.json'):
    speculative.load_pair(config)


def test_embeddings_padded_differently_are_cut_to_the_smaller(loaded, tmp_path):
  from experiments.speculative import load_pair
  dc, dp, golden = loaded['llama-draft']
  padded = jax.tree.map(lambda x: x, dp)
  rows = jax.random.normal(jax.random.PRNGKey(0), (20, dc.d_model))
  padded['params']['embed']['embedding'] = jnp.concatenate([dp['params']['embed']['embedding'],
                                                            rows])
  padded['params']['lm_head']['kernel'] = jnp.concatenate([dp['params']['lm_head']['kernel'],
                                                           rows.T], axis=1)
  save_pretrained(tmp_path / 'draft', dataclasses.replace(dc, vocab_size=320), padded,
                  Tokenizer.load(FIXTURES / 'llama-draft'), dtype='float32')
  config = ml_collections.ConfigDict(dict(target=str(FIXTURES / 'llama'),
                                          draft=str(tmp_path / 'draft'), tokenizer=''))
  tc, _, dc2, dp2, tokenizer = load_pair(config)
  assert tc.vocab_size == dc2.vocab_size == 300 and tokenizer.vocab_size == 299
  ids = _texts(golden)[0]
  np.testing.assert_allclose(_logits(dc2, dp2, ids), golden['logits'][0, :len(ids)],
                             rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize('family', ['llama', 'mistral', 'qwen2'])
def test_save_pretrained_round_trip_is_exact_in_float32(loaded, family, tmp_path):
  config, params, _ = loaded[family]
  tok = Tokenizer.load(FIXTURES / family)
  save_pretrained(tmp_path / family, config, params, tok, dtype='float32', max_shard_bytes=50_000)
  assert (tmp_path / family / hf.INDEX).is_file()          # sharded: 150 KB in 50 KB files
  assert len(list((tmp_path / family).glob('model-*-of-*.safetensors'))) >= 3
  config2, params2 = load_model(tmp_path / family)         # load_model dispatches on the layout
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  tok2 = Tokenizer.load(tmp_path / family)
  assert tok2.vocabulary_difference(tok) is None and tok2.eos_ids == tok.eos_ids


def test_bfloat16_storage_and_loading(loaded, tmp_path):
  config, params, golden = loaded['llama']
  save_pretrained(tmp_path / 'm', config, params)                 # bfloat16 by default
  assert not (tmp_path / 'm' / hf.INDEX).exists()                 # one file under 5 GiB
  assert json.loads((tmp_path / 'm' / 'config.json').read_text())['torch_dtype'] == 'bfloat16'
  config32, params32 = load_pretrained(tmp_path / 'm')
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  jax.tree.map(np.testing.assert_array_equal, params32, rounded)
  config16, params16 = load_pretrained(tmp_path / 'm', dtype='bfloat16')
  assert config16.dtype == 'bfloat16'
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params16))
  ids = _texts(golden)[1]
  # bfloat16 weights and activations: measured max |logit error| 0.15 (logits' std is 1.6).
  assert np.abs(_logits(config16, params16, ids) - golden['logits'][1, :len(ids)]).max() < 0.5


def test_hugging_face_tokenizer_special_ids():
  llama = Tokenizer.load(FIXTURES / 'llama')                # eos list from config.json
  assert (llama.bos_id, llama.eos_ids, llama.pad_id) == (296, (297, 298), None)
  mistral = Tokenizer.load(FIXTURES / 'mistral' / 'tokenizer.json')  # from tokenizer_config.json
  assert (mistral.bos_id, mistral.eos_ids) == (296, (297,))
  text = 'def f(x):\n    return {"a": [1, 2]}  # é\n'
  assert llama.decode(llama.encode(text)) == text
  assert 297 not in llama.encode('<|end_of_text|>')         # literal text is not special


def test_tokenizer_without_our_specials_or_a_model_config_is_an_error(tmp_path):
  shutil.copy(FIXTURES / 'llama' / 'tokenizer.json', tmp_path / 'tokenizer.json')
  with pytest.raises(ValueError, match=r"tokenizer .*tokenizer.json: special token '<\|pad\|>' "
                                       r'has id None.*no Hugging Face config beside it'):
    Tokenizer.load(tmp_path)


def test_rope_scaling_forms_and_errors():
  from jaxspec.models import rope
  base = rope.inverse_frequencies(8, 10000.0)
  linear = rope.inverse_frequencies(8, 10000.0, rope.normalize_scaling({'type': 'linear',
                                                                        'factor': 4.0}))
  np.testing.assert_allclose(linear, base / 4.0, rtol=1e-6)
  assert rope.normalize_scaling({'rope_type': 'default', 'rope_theta': 1e4}) == ()
  llama3 = dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
  config = ModelConfig.from_name('test-tiny', rope_scaling=llama3)
  assert hash(config) == hash(ModelConfig(**json.loads(json.dumps(dataclasses.asdict(config)))))
  scaled = np.asarray(rope.inverse_frequencies(8, 10000.0, config.rope_scaling))
  # wavelengths 6.3 (< 64/4: kept), 63 (between: interpolated), 628 and 6283 (> 64: / 8)
  np.testing.assert_allclose(scaled[[0, 2, 3]], np.asarray(base)[[0, 2, 3]] / [1, 8, 8], rtol=1e-6)
  assert base[1] / 8 < scaled[1] < base[1]
  for bad, match in [({'rope_type': 'dynamic', 'factor': 2.0}, "type 'dynamic' is not supported"),
                     ({'type': 'linear', 'factor': 0.5}, 'factor must be >= 1'),
                     ({**llama3, 'high_freq_factor': 1.0}, 'must exceed low_freq_factor'),
                     ({'factor': 4.0}, 'gives factor but no rope_type')]:   # was: dropped
    with pytest.raises(ValueError, match=match):
      ModelConfig.from_name('test-tiny', rope_scaling=bad)
  with pytest.raises(ValueError, match='sliding_window must be None or a positive int, got 0'):
    ModelConfig.from_name('test-tiny', sliding_window=0)
  # numpy scalars (as a config built with numpy arithmetic holds) are numbers, stored as Python's
  as_numpy = {k: np.float32(v) if isinstance(v, float) else v for k, v in llama3.items()}
  assert ModelConfig.from_name('test-tiny', rope_scaling=as_numpy) == config
  with pytest.raises(ValueError, match="rope_scaling factor must be a positive finite number"):
    ModelConfig.from_name('test-tiny', rope_scaling={**llama3, 'factor': np.True_})


def test_tensor_names_cover_every_param():
  for change in ({}, dict(tie_embeddings=True), dict(qkv_bias=True)):
    config = ModelConfig.from_name('test-tiny', **change)
    ours = {tuple(k.key for k in p) for p, _ in
            jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
    mapped = [path for path, _ in hf.tensor_names(config).values()]
    assert sorted(mapped) == sorted(ours)


# Shapes of real checkpoints' config.json (transformers 4 layout, as published), with their
# published parameter counts: the mapping of biases, tying and GQA is checked at full size.
REAL_CONFIGS = {
    'Llama-3.1-8B': (8_030_261_248, dict(
        architectures=['LlamaForCausalLM'], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192, rope_type='llama3'),
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act='silu',
        eos_token_id=128001, bos_token_id=128000)),
    'Llama-3.2-1B': (1_235_814_400, dict(
        architectures=['LlamaForCausalLM'], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(factor=32.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0,
                                               original_max_position_embeddings=8192,
                                               rope_type='llama3'),
        tie_word_embeddings=True, hidden_act='silu')),
    'Mistral-7B-v0.1': (7_241_732_096, dict(
        architectures=['MistralForCausalLM'], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=4096, tie_word_embeddings=False, hidden_act='silu')),
    'Qwen2.5-0.5B': (494_032_768, dict(
        architectures=['Qwen2ForCausalLM'], hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        sliding_window=32768, use_sliding_window=False, max_window_layers=24,
        tie_word_embeddings=True, hidden_act='silu')),
    'Qwen2.5-7B': (7_615_616_512, dict(
        architectures=['Qwen2ForCausalLM'], hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        sliding_window=131072, use_sliding_window=False, max_window_layers=28,
        tie_word_embeddings=False, hidden_act='silu')),
}


@pytest.mark.parametrize('name', sorted(REAL_CONFIGS))
def test_real_checkpoint_configs_map_to_their_parameter_counts(name):
  count, fields = REAL_CONFIGS[name]
  config = hf.config_from_hf(fields)
  assert config.num_params == count
  assert config.sliding_window == (4096 if name.startswith('Mistral') else None)
  assert hf.config_from_hf(hf.config_to_hf(config)) == config
  no_arch = {k: v for k, v in fields.items() if k != 'architectures'}
  no_arch['model_type'] = fields['architectures'][0][:-len('ForCausalLM')].lower()
  assert hf.config_from_hf(no_arch) == config
