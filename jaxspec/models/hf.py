"""Hugging Face checkpoints (Llama, Mistral, Qwen2 families): load and save the standard layout.

A model directory holds

    config.json                     architecture and shapes (transformers' format)
    model.safetensors               the weights, or sharded as
    model-0000N-of-0000M.safetensors + model.safetensors.index.json ("weight_map": name -> file)
    tokenizer.json                  optional here (see `jaxspec.data.Tokenizer.load`)

Names map one to one onto our params tree; nn.Linear weights are [out, in] and ours [in, out]:

    model.embed_tokens.weight                       params/embed/embedding           [V, D]
    model.layers.{i}.input_layernorm.weight         params/layer_{i}/attn_norm/scale [D]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  params/layer_{i}/attn/{q,k,v,o}/kernel (T)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias    params/layer_{i}/attn/{q,k,v}/bias  (Qwen2)
    model.layers.{i}.post_attention_layernorm.weight  params/layer_{i}/mlp_norm/scale
    model.layers.{i}.mlp.{gate,up,down}_proj.weight params/layer_{i}/mlp/{gate,up,down}/kernel (T)
    model.norm.weight                               params/final_norm/scale
    lm_head.weight                                  params/lm_head/kernel (T; absent when tied)

The config.json translation is `jaxspec.models.hf_config` (re-exported here).

No permutation of q/k is needed: `apply_rope` rotates the two halves of each head
(transformers' `rotate_half`), the convention these checkpoints are stored in. The golden-logits
tests (tests/test_hf.py) are the proof.

Reading is lazy: one tensor at a time is read from its file, transposed and cast, so a checkpoint
is never held twice in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxspec.checks import check_int, is_int_in
from jaxspec.models.checkpoint import CheckpointError, check_fits, param_shapes
from jaxspec.models.config import ModelConfig
# The config.json half lives in hf_config; its names stay importable from here.
from jaxspec.models.hf_config import (ARCHITECTURES, config_from_hf,  # noqa: F401
                                      config_to_hf, is_pretrained)

INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'
DEFAULT_SHARD_BYTES = 5 * 2**30          # transformers' default max_shard_size ("5GB")
_IGNORED_SUFFIXES = ('.rotary_emb.inv_freq',)   # buffers some old checkpoints stored
_DTYPES = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16, 'float16': np.float16}


def tensor_names(config: ModelConfig) -> dict:
  """{Hugging Face tensor name: (path of our param as a tuple of keys, transposed?)} for every
  param of `config` (lm_head absent when embeddings are tied)."""
  names = {'model.embed_tokens.weight': (('embed', 'embedding'), False),
           'model.norm.weight': (('final_norm', 'scale'), False)}
  if not config.tie_embeddings:
    names['lm_head.weight'] = (('lm_head', 'kernel'), True)
  for i in range(config.num_layers):
    hf, ours = f'model.layers.{i}', f'layer_{i}'
    names[f'{hf}.input_layernorm.weight'] = ((ours, 'attn_norm', 'scale'), False)
    names[f'{hf}.post_attention_layernorm.weight'] = ((ours, 'mlp_norm', 'scale'), False)
    for p in 'qkvo':
      names[f'{hf}.self_attn.{p}_proj.weight'] = ((ours, 'attn', p, 'kernel'), True)
      if config.qkv_bias and p != 'o':
        names[f'{hf}.self_attn.{p}_proj.bias'] = ((ours, 'attn', p, 'bias'), False)
    for p in ('gate', 'up', 'down'):
      names[f'{hf}.mlp.{p}_proj.weight'] = ((ours, 'mlp', p, 'kernel'), True)
  return {k: (('params',) + path, t) for k, (path, t) in names.items()}


_FLOAT_STORAGE = ('F16', 'BF16', 'F32', 'F64')   # safetensors dtype names load_pretrained reads


def _dtype_name(dtype) -> str:
  """'bfloat16', jnp.bfloat16 and np.float16 alike as a name in _DTYPES (ValueError if not)."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in _DTYPES:
    raise ValueError(f'dtype must be one of {list(_DTYPES)}, got {dtype!r}')
  return name


def _weight_files(path: pathlib.Path) -> dict:
  """{file: [tensor names it should hold] or None (= every tensor in it)}. As transformers:
  model.safetensors when it exists, else the index's shards."""
  if (path / SINGLE).is_file():
    return {path / SINGLE: None}
  if (path / INDEX).is_file():
    try:
      weight_map = json.loads((path / INDEX).read_text())['weight_map']
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise CheckpointError(f'{path / INDEX} is not a valid index (needs "weight_map"): {e}') from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
      raise CheckpointError(f'{path / INDEX}: "weight_map" must map tensor names to file names, '
                            f'got {str(weight_map)[:80]}')
    files: dict = {}
    for name, file in weight_map.items():
      files.setdefault(path / file, []).append(name)
    for file in files:
      if not file.is_file():
        raise CheckpointError(f'shard {file.name} named in {path / INDEX} is missing')
    return files
  shards = sorted(path.glob('*.safetensors'))
  if shards:
    raise CheckpointError(f'{path} has {len(shards)} .safetensors files but no {INDEX}')
  other = sorted(p.name for p in path.glob('*.bin')) + sorted(p.name for p in path.glob('*.pth'))
  hint = f' (found {other}: convert them to safetensors)' if other else ''
  raise CheckpointError(f'{path} has no {SINGLE} or {INDEX}{hint}')


def load_pretrained(path, dtype: str = 'float32', *, max_seq_len: Optional[int] = None):
  """Read a Hugging Face Llama / Mistral / Qwen2 checkpoint directory.

  Args:
    path: the directory (config.json + model.safetensors, or shards + index).
    dtype: 'float32', 'bfloat16' or 'float16': the dtype of the returned params and the
      config's compute dtype (activations, KV cache).
    max_seq_len: context to use instead of config.json's max_position_embeddings (a smaller one
      only tightens the prompt-length checks; nothing is allocated by it).
  Returns:
    (ModelConfig, params) with params = {'params': {...}} as `Transformer(config).apply` takes.
  Raises:
    ValueError: a dtype not in the list above, max_seq_len not None or an int >= 1.
    CheckpointError: no directory / config.json / weights, unsupported architecture or feature,
      a missing config key, or a tensor missing, of the wrong shape, unexpected, or holding NaN
      or infinite values (or values past float16's range when loading in float16; each named).
  """
  dtype = _dtype_name(dtype)
  if max_seq_len is not None:
    max_seq_len = check_int('max_seq_len', max_seq_len, 1)
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise CheckpointError(f'no model directory at {path}')
  if not (path / 'config.json').is_file():
    raise CheckpointError(f'no config.json in {path}')
  try:
    fields = json.loads((path / 'config.json').read_text())
  except (OSError, ValueError) as e:        # JSONDecodeError, UnicodeDecodeError
    raise CheckpointError(f'{path / "config.json"} is not valid JSON: {e}') from e
  if max_seq_len is not None:
    fields = {**fields, 'max_position_embeddings': max_seq_len}
  config = config_from_hf(fields, dtype=dtype, where=str(path / 'config.json'))
  expected = dict((tuple(k.key for k in p), leaf.shape) for p, leaf in
                  jax.tree_util.tree_flatten_with_path(param_shapes(config))[0])
  names = tensor_names(config)
  flat, unexpected = {}, []
  files = _weight_files(path)
  indexed = {name for listed in files.values() for name in listed or []}
  for file, listed in files.items():
    try:
      with safe_open(str(file), framework='numpy') as f:
        keys = set(f.keys())
        for name in listed or []:
          if name not in keys:
            raise CheckpointError(f'tensor {name} is listed in {INDEX} but not in {file.name}')
        for name in sorted(keys):
          if name in indexed and name not in listed:   # the index places it in another shard
            continue
          if name not in names:
            if not (name.endswith(_IGNORED_SUFFIXES) or (name == 'lm_head.weight' and
                                                         config.tie_embeddings)):
              unexpected.append(name)
            continue
          ours, transpose = names[name]
          shape = tuple(f.get_slice(name).get_shape())
          want = expected[ours][::-1] if transpose else expected[ours]
          if shape != tuple(want):
            raise CheckpointError(f'{file.name}: tensor {name} has shape {shape}, '
                                  f'config.json implies {tuple(want)}')
          stored = f.get_slice(name).get_dtype()
          if stored not in _FLOAT_STORAGE:
            raise CheckpointError(f'{file.name}: tensor {name} is stored as {stored}; weights '
                                  f'must be floating point ({", ".join(_FLOAT_STORAGE)})')
          x = f.get_tensor(name)
          try:
            check_fits(name, x, _DTYPES[dtype], fix='load in {wider}')
          except ValueError as error:        # inf weights, then NaN logits, without a word
            raise CheckpointError(f'{file.name}: {error}') from error
          flat[ours] = jnp.asarray(x.T if transpose else x, dtype)
          del x
    except CheckpointError:
      raise
    except Exception as e:  # safetensors raises its own error types for damaged files
      raise CheckpointError(f'cannot read {file}: {e}') from e
  missing = [n for n, (ours, _) in names.items() if ours not in flat]
  if missing:
    raise CheckpointError(f'checkpoint {path} is missing tensor {missing[0]}'
                          + (f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''))
  if unexpected:
    raise CheckpointError(f'checkpoint {path} has unexpected tensors {unexpected[:5]}, not part '
                          f'of {fields.get("architectures") or fields.get("model_type")} with '
                          f'this config.json')
  params: dict = {}
  for keys, value in flat.items():
    node = params
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = value
  return config, params


def save_pretrained(path, config: ModelConfig, params, tokenizer=None, *,
                    architecture: Optional[str] = None, dtype: str = 'bfloat16',
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
  """Write `params` as a Hugging Face checkpoint directory that `load_pretrained` and
  transformers' `AutoModelForCausalLM.from_pretrained` read.

  Args:
    path: directory (created; files of the same names are overwritten).
    config, params: the model ({'params': {...}}).
    tokenizer: optional `jaxspec.data.Tokenizer`, written as tokenizer.json; its bos/eos/pad ids
      go into config.json.
    architecture: see `config_to_hf`.
    dtype: storage dtype ('bfloat16', 'float32' or 'float16').
    max_shard_bytes: files above this size are split into model-0000N-of-0000M.safetensors with
      model.safetensors.index.json (a single tensor larger than this gets a shard of its own).
  Raises:
    ValueError: unknown dtype or architecture, max_shard_bytes < 1, params that do not match
      `config`: a tensor missing, of another shape, or extra (named), or a tensor with NaN or
      infinite values or values outside the dtype's range (float16's 65504: they would be
      stored as inf; named).
  """
  dtype = _dtype_name(dtype)
  if not is_int_in(max_shard_bytes, 1, math.inf):
    raise ValueError(f'max_shard_bytes must be a positive int, got {max_shard_bytes!r}')
  fields = config_to_hf(config, architecture)
  if tokenizer is not None:
    fields.update(bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id,
                  eos_token_id=(list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1
                                else tokenizer.eos_id))
  fields['torch_dtype'] = dtype
  leaves = {tuple(k.key for k in p): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  expected = {tuple(k.key for k in p): leaf.shape
              for p, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
  for keys, shape in expected.items():
    if keys not in leaves or tuple(leaves[keys].shape) != tuple(shape):
      got = tuple(leaves[keys].shape) if keys in leaves else 'missing'
      raise ValueError(f'param {"/".join(keys)} is {got}, config implies {tuple(shape)}')
  extra = sorted('/'.join(map(str, keys)) for keys in set(leaves) - set(expected))
  if extra:            # they would be left out of the checkpoint without a word
    raise ValueError(f'params hold tensors the config has no place for: {extra[:5]}')
  names = tensor_names(config)
  for name, (ours, _) in names.items():       # before any file is touched
    check_fits(name, leaves[ours], _DTYPES[dtype])
  itemsize = np.dtype(_DTYPES[dtype]).itemsize
  shards, size = [[]], 0
  for name, (ours, _) in names.items():
    nbytes = math.prod(expected[ours]) * itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  for stale in [path / INDEX, path / SINGLE, *path.glob('model-*-of-*.safetensors')]:
    stale.unlink(missing_ok=True)
  weight_map = {}
  for n, shard in enumerate(shards):
    file = SINGLE if len(shards) == 1 else f'model-{n + 1:05d}-of-{len(shards):05d}.safetensors'
    tensors = {}
    for name in shard:
      ours, transpose = names[name]
      x = np.asarray(jax.device_get(leaves[ours])).astype(_DTYPES[dtype])
      tensors[name] = np.ascontiguousarray(x.T if transpose else x)
      weight_map[name] = file
    save_file(tensors, str(path / file), metadata={'format': 'pt'})
    del tensors
  if len(shards) > 1:
    total = sum(math.prod(expected[ours]) * itemsize for ours, _ in names.values())
    (path / INDEX).write_text(json.dumps(
        {'metadata': {'total_size': total}, 'weight_map': weight_map}, indent=2) + '\n')
  (path / 'config.json').write_text(json.dumps(fields, indent=2) + '\n')
  if tokenizer is not None:
    tokenizer.save(path / 'tokenizer.json')


def truncate_vocab(config: ModelConfig, params, vocab_size: int):
  """Keep the first `vocab_size` rows of the embedding and output head.

  For a draft and target whose tokenizers agree but whose embedding matrices are padded to
  different sizes (Qwen2.5-0.5B: 151,936; Qwen2.5-7B: 152,064; the tokenizer has 151,665 ids):
  ids at or above the tokenizer's size never stand for a token, so dropping them changes nothing
  but the padding's (tiny, never-trained) share of the softmax.

  Returns:
    (config with vocab_size, params); the arrays are slices of the originals.
  Raises:
    ValueError: vocab_size larger than config.vocab_size or < 1.
  """
  if not 1 <= vocab_size <= config.vocab_size:
    raise ValueError(f'cannot truncate a vocabulary of {config.vocab_size} to {vocab_size}')
  p = dict(params['params'])
  p['embed'] = {'embedding': p['embed']['embedding'][:vocab_size]}
  if 'lm_head' in p:
    p['lm_head'] = {'kernel': p['lm_head']['kernel'][:, :vocab_size]}
  return dataclasses.replace(config, vocab_size=vocab_size), {**params, 'params': p}


__all__ = ['ARCHITECTURES', 'config_from_hf', 'config_to_hf', 'is_pretrained', 'load_pretrained',
           'save_pretrained', 'tensor_names', 'truncate_vocab']
