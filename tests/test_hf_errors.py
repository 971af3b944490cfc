"""Hugging Face checkpoints, bad input: every broken config, tensor, shard, index or dtype is
named in the error (the loading and parity tests: test_hf.py)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxspec.models import CheckpointError, load_model, load_pretrained, save_pretrained
from jaxspec.models import hf
from test_hf import FIXTURES, loaded  # noqa: F401  (a fixture)


def _copy(tmp_path, family='llama'):
  path = tmp_path / family
  shutil.copytree(FIXTURES / family, path)
  return path


def _edit_config(path, **changes):
  fields = json.loads((path / 'config.json').read_text())
  for key, value in changes.items():
    if value is None:
      fields.pop(key, None)
    else:
      fields[key] = value
  (path / 'config.json').write_text(json.dumps(fields))


@pytest.mark.parametrize('changes, match', [
    (dict(architectures=['GPT2LMHeadModel']), r"unsupported architecture \['GPT2LMHeadModel'\]"),
    (dict(hidden_size=None), "missing key 'hidden_size'"),
    (dict(rms_norm_eps=None), "missing key 'rms_norm_eps'"),
    (dict(rope_parameters={'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 1e4}),
     "rope_scaling type 'yarn' is not supported"),
    (dict(rope_parameters={'rope_type': 'llama3', 'factor': 8.0, 'rope_theta': 1e4}),
     "rope_scaling of type 'llama3' is missing 'low_freq_factor'"),
    (dict(attention_bias=True), 'attention_bias=True is not supported'),
    (dict(hidden_act='gelu'), "hidden_act='gelu' is not supported"),
    (dict(num_attention_heads=3), 'num_heads=3 is not a multiple of num_kv_heads=2'),
    (dict(rope_parameters=[1, 2]), r'rope_parameters must be an object, got \[1, 2\]'),
    (dict(tie_word_embeddings='false'), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(head_dim=0), 'head_dim must be an int >= 1, got 0'),        # not "use the default"
    (dict(head_dim=None, hidden_size=30, num_attention_heads=4, num_key_value_heads=2),
     r'hidden_size=30 is not a multiple of num_attention_heads=4 \(and no head_dim is given\)'),
    (dict(num_key_value_heads=0), 'num_kv_heads must be an int >= 1, got 0'),
    (dict(architectures=7), 'architectures must be a list of names, got 7'),
    # Each was loaded silently: a half-rotary model with full rotary, the 4 layout's RoPE winning.
    (dict(partial_rotary_factor=0.5), r'partial_rotary_factor=0.5 is not supported'),
    (dict(rope_parameters={'rope_type': 'default', 'rope_theta': 1e4,
                           'partial_rotary_factor': 0.25}),
     r'rope_parameters.partial_rotary_factor=0.25 is not supported'),
    (dict(rope_theta=10000.0, rope_parameters={'rope_type': 'default', 'rope_theta': 500000.0}),
     r'rope_theta=10000.0 and rope_parameters.rope_theta=500000.0 disagree'),
    (dict(rope_scaling={'rope_type': 'linear', 'factor': 2.0},
          rope_parameters={'rope_type': 'linear', 'factor': 4.0, 'rope_theta': 1e4}),
     r"rope_scaling=\{'rope_type': 'linear', 'factor': 2.0\} and rope_parameters=.* disagree"),
])
def test_bad_config_is_named(tmp_path, changes, match):
  path = _copy(tmp_path)
  _edit_config(path, **changes)
  with pytest.raises(CheckpointError, match=match):
    load_pretrained(path)


def test_both_rope_layouts_load_when_they_agree(tmp_path):
  path = _copy(tmp_path)
  fields = json.loads((path / 'config.json').read_text())
  want = load_pretrained(path)[0]
  scaling = {k: v for k, v in fields['rope_parameters'].items() if k != 'rope_theta'}
  _edit_config(path, rope_theta=fields['rope_parameters']['rope_theta'], rope_scaling=scaling,
               partial_rotary_factor=1.0)
  assert load_pretrained(path)[0] == want


def test_qwen2_window_on_some_layers_is_rejected(tmp_path):
  path = _copy(tmp_path, 'qwen2')
  _edit_config(path, use_sliding_window=True, sliding_window=4, max_window_layers=1,
               layer_types=None)
  with pytest.raises(CheckpointError, match='sliding window on only some layers') as error:
    load_pretrained(path)
  assert str(error.value).count('config.json') == 1        # was named twice
  _edit_config(path, max_window_layers=0)                  # every layer: honoured
  assert load_pretrained(path)[0].sliding_window == 4



def test_load_sharded_names_a_hugging_face_directory_and_the_way_to_shard_it(tmp_path):
  # It failed on ModelConfig(architectures=...), naming neither the layout nor load_pretrained.
  from jaxspec.parallel import load_sharded, make_mesh  # pylint: disable=import-outside-toplevel
  path = _copy(tmp_path, 'llama')
  with pytest.raises(CheckpointError, match=r'is a Hugging Face model directory; .*load_pretrained '
                                            r'.*shard_params'):
    load_sharded(path, make_mesh(1, 1))


def test_window_keys_are_read_as_transformers_reads_them(tmp_path):
  # Llama ignores sliding_window (a Mistral relabelled as Llama carries it); Qwen2 without
  # max_window_layers defaults to 28 (_edit_config's None removes a key), so a smaller model has
  # no windowed layer; Mistral and Qwen2 without the sliding_window key default to 4096 (Qwen2's
  # was read as no window). Each was read otherwise (golden logits off by 6-9, no error).
  llama = _copy(tmp_path / 'l', 'llama')
  _edit_config(llama, sliding_window=4)
  assert load_pretrained(llama)[0].sliding_window is None
  qwen = _copy(tmp_path / 'q', 'qwen2')
  _edit_config(qwen, use_sliding_window=True, sliding_window=4, max_window_layers=None,
               layer_types=None)
  assert load_pretrained(qwen)[0].sliding_window is None
  _edit_config(qwen, sliding_window=None, max_window_layers=0)     # no key: transformers' 4096
  assert load_pretrained(qwen)[0].sliding_window == 4096
  _edit_config(qwen, max_window_layers=1)                          # ... on some layers only
  with pytest.raises(CheckpointError, match='sliding window on only some layers'):
    load_pretrained(qwen)
  mistral = _copy(tmp_path / 'm', 'mistral')
  fields = json.loads((mistral / 'config.json').read_text())
  (mistral / 'config.json').write_text(json.dumps({**fields, 'sliding_window': None}))
  assert load_pretrained(mistral)[0].sliding_window is None          # null: no window
  _edit_config(mistral, sliding_window=None)                         # (removes the key)
  assert load_pretrained(mistral)[0].sliding_window == 4096


def _rewrite_tensors(file, edit):
  tensors = load_file(str(file))
  edit(tensors)
  save_file(tensors, str(file), metadata={'format': 'pt'})


@pytest.mark.parametrize('family, edit, match', [
    ('mistral', lambda t: t.pop('model.layers.1.mlp.up_proj.weight'),
     'missing tensor model.layers.1.mlp.up_proj.weight'),
    ('qwen2', lambda t: t.update({'model.layers.0.self_attn.k_proj.bias': np.zeros(8, np.float32)}),
     r'tensor model.layers.0.self_attn.k_proj.bias has shape \(8,\), config.json implies \(16,\)'),
    ('mistral', lambda t: t.update({'model.layers.0.self_attn.o_proj.bias': np.zeros(32,
                                                                                     np.float32)}),
     r"unexpected tensors \['model.layers.0.self_attn.o_proj.bias'\]"),
], ids=['missing', 'wrong_shape', 'unexpected'])
def test_a_missing_misshapen_or_unexpected_tensor_is_named(tmp_path, family, edit, match):
  path = _copy(tmp_path, family)
  _rewrite_tensors(path / 'model.safetensors', edit)
  with pytest.raises(CheckpointError, match=match):
    load_pretrained(path)


def test_missing_shard_and_missing_weights_are_named(tmp_path):
  path = _copy(tmp_path, 'llama')
  (path / 'model-00002-of-00003.safetensors').unlink()
  with pytest.raises(CheckpointError, match='shard model-00002-of-00003.safetensors named in'):
    load_pretrained(path)
  (path / hf.INDEX).unlink()
  with pytest.raises(CheckpointError, match=r'has 2 .safetensors files but no model.safetensors'
                                            r'.index.json'):
    load_pretrained(path)
  for f in path.glob('*.safetensors'):
    f.unlink()
  (path / 'pytorch_model.bin').write_bytes(b'')
  with pytest.raises(CheckpointError, match=r"no model.safetensors .*pytorch_model.bin.*convert"):
    load_pretrained(path)
  with pytest.raises(CheckpointError, match=r"no model.safetensors .*pytorch_model.bin.*convert"):
    load_model(path)                       # the layout is told by config.json, not the weights
  with pytest.raises(CheckpointError, match='no config.json'):
    load_pretrained(tmp_path)


def test_save_pretrained_rejects_params_that_do_not_match(loaded, tmp_path):
  config, params, _ = loaded['llama']
  with pytest.raises(ValueError, match=r'param params/layer_0/mlp/down/kernel is \(64, 32\), '
                                       r'config implies \(128, 32\)'):
    save_pretrained(tmp_path, dataclasses.replace(config, d_ff=128), params)
  with pytest.raises(ValueError, match='LlamaForCausalLM has no sliding window'):
    save_pretrained(tmp_path, dataclasses.replace(config, sliding_window=4), params,
                    architecture='LlamaForCausalLM')
  extra = {'params': {**params['params'], 'lora_a': jnp.zeros((4, 4))}}   # was dropped silently
  with pytest.raises(ValueError, match=r"tensors the config has no place for: \['params/lora_a'\]"):
    save_pretrained(tmp_path, config, extra)


@pytest.mark.parametrize('weight_map', [[], 'x', {'model.norm.weight': None}])
def test_an_index_whose_weight_map_is_malformed_is_named(tmp_path, weight_map):
  path = _copy(tmp_path, 'llama')
  (path / hf.INDEX).write_text(json.dumps({'weight_map': weight_map}))
  with pytest.raises(CheckpointError, match='"weight_map" must map tensor names to file names'):
    load_pretrained(path)


def test_a_config_that_is_not_utf8_or_bad_arguments_are_named(tmp_path):
  path = _copy(tmp_path, 'llama')
  with pytest.raises(ValueError, match="dtype must be one of .*got 'float64'"):
    load_pretrained(path, dtype='float64')
  with pytest.raises(ValueError, match='max_seq_len must be an int >= 1, got 0'):
    load_pretrained(path, max_seq_len=0)
  (path / 'config.json').write_bytes(b'\xff\xfe{')
  with pytest.raises(CheckpointError, match='is not valid JSON'):
    load_pretrained(path)
  with pytest.raises(CheckpointError,
                     match="config.json is not a valid ModelConfig: 'utf-8' codec"):
    load_model(path)
  (path / 'config.json').write_text(json.dumps({'hidden_size': 32, 'vocab_size': 64}))
  with pytest.raises(CheckpointError, match="a Hugging Face config.json. it names no "
                                            "'architectures' or 'model_type'"):
    load_model(path)


def test_the_index_decides_which_shard_a_tensor_comes_from(tmp_path):
  # A stray copy of a tensor in another shard was loaded when that shard came later.
  path = _copy(tmp_path, 'llama')
  weight_map = json.loads((path / hf.INDEX).read_text())['weight_map']
  files = list(dict.fromkeys(weight_map.values()))          # in the order they are read
  elsewhere = next(n for n, f in weight_map.items() if f == files[0])
  _, want = load_pretrained(_copy(tmp_path / 'ref', 'llama'))

  def add_zeroed(tensors):                                   # into the last shard read
    with safe_open(str(path / files[0]), framework='numpy') as f:
      tensors[elsewhere] = np.zeros_like(f.get_tensor(elsewhere))
  _rewrite_tensors(path / files[-1], add_zeroed)
  _, got = load_pretrained(path)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize('dtype', [np.int32, np.bool_])
def test_weights_that_are_not_floating_point_are_refused(tmp_path, dtype):
  # Cast silently before (an int32 norm weight: golden logits off by 595).
  path = _copy(tmp_path, 'mistral')
  _rewrite_tensors(path / 'model.safetensors', lambda t: t.update(
      {'model.norm.weight': np.ones_like(t['model.norm.weight'], dtype)}))
  with pytest.raises(CheckpointError, match=r'tensor model.norm.weight is stored as (I32|BOOL); '
                                            r'weights must be floating point'):
    load_pretrained(path)
