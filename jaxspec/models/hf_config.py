"""Hugging Face config.json <-> `ModelConfig` (Llama, Mistral, Qwen2 families), read as
transformers reads it: defaults, sliding windows, RoPE scaling in the transformers 4 and 5
layouts. The weights are `jaxspec.models.hf`'s."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

from jaxspec.models.checkpoint import CheckpointError
from jaxspec.models import rope
from jaxspec.models.config import ModelConfig

ARCHITECTURES = ('LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM')
# Keys a config.json must have; the rest have the defaults transformers gives them.
REQUIRED_KEYS = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                 'num_attention_heads', 'rms_norm_eps', 'max_position_embeddings')


def is_pretrained(path) -> bool:
  """Whether `path` is a directory in the Hugging Face layout: a config.json naming an
  architecture or model_type (our own config.json has neither). Its weights are checked when it
  is loaded: `load_pretrained` names *.bin / *.pth files it cannot read."""
  path = pathlib.Path(path)
  if not (path / 'config.json').is_file():
    return False
  try:
    fields = json.loads((path / 'config.json').read_text())
  except (OSError, ValueError):        # JSONDecodeError and UnicodeDecodeError are ValueErrors
    return False
  return isinstance(fields, dict) and ('architectures' in fields or 'model_type' in fields)


def config_from_hf(fields: dict, *, dtype: str = 'float32', where: str = 'config.json'
                   ) -> ModelConfig:
  """Our ModelConfig from the fields of a transformers config.json.

  Reads both the transformers 4 layout (`rope_theta`, `rope_scaling`) and the 5 layout
  (`rope_parameters`). Qwen2 gets q/k/v biases; `tie_word_embeddings` ties the output head;
  `max_position_embeddings` becomes max_seq_len; Mistral's `sliding_window` is honoured, as is
  Qwen2's when it covers every layer.

  Raises:
    CheckpointError: naming an unsupported architecture, a missing key, or a feature we do not
      implement (o_proj/MLP biases, an activation other than SiLU, a rope_scaling type other than
      linear/llama3, a sliding window on only some layers, a partial_rotary_factor below 1),
      or RoPE settings of the transformers 4 and 5 layouts that disagree.
  """
  if not isinstance(fields, dict):
    raise CheckpointError(f'{where} is not a JSON object')
  archs = fields.get('architectures') or []
  if isinstance(archs, str):                       # one name instead of a list of one
    archs = [archs]
  if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
    raise CheckpointError(f'{where}: architectures must be a list of names, got {archs!r}')
  arch = next((a for a in archs if a in ARCHITECTURES), None)
  if not archs:                                    # some configs name only the model_type
    arch = {a[:-len('ForCausalLM')].lower(): a for a in ARCHITECTURES}.get(fields.get('model_type'))
  if arch is None:
    raise CheckpointError(f'{where}: unsupported architecture {archs or fields.get("model_type")!r}'
                          f'; supported: {", ".join(ARCHITECTURES)}')
  missing = [k for k in REQUIRED_KEYS if fields.get(k) is None]
  if missing:
    raise CheckpointError(f'{where} is missing key {missing[0]!r} (needed: {list(REQUIRED_KEYS)})')

  def reject_if(key, bad, why):
    if fields.get(key, False) not in (None, False) and bad(fields[key]):
      raise CheckpointError(f'{where}: {key}={fields[key]!r} is not supported ({why})')

  reject_if('hidden_act', lambda v: v != 'silu', 'only SiLU / SwiGLU MLPs')
  reject_if('attention_bias', bool, 'biases on all attention projections, o_proj included')
  reject_if('mlp_bias', bool, 'biases on the MLP projections')

  heads = fields['num_attention_heads']
  rope_params = fields.get('rope_parameters') or {}
  if not isinstance(rope_params, dict):
    raise CheckpointError(f'{where}: rope_parameters must be an object, got {rope_params!r}')
  for source, value in (('', fields.get('partial_rotary_factor')),
                        ('rope_parameters.', rope_params.get('partial_rotary_factor'))):
    if value not in (None, 1, 1.0):    # was ignored: every head dimension rotated
      raise CheckpointError(f'{where}: {source}partial_rotary_factor={value!r} is not supported '
                            f'(rotary embeddings over whole heads only)')
  _check_rope_layouts(fields, rope_params, where)
  scaling = fields.get('rope_scaling') or rope_params
  theta = fields.get('rope_theta', rope_params.get('rope_theta', 10000.0))
  tie = fields.get('tie_word_embeddings', False)
  if not isinstance(tie, bool):        # "false" is truthy: the file's lm_head would be dropped
    raise CheckpointError(f'{where}: tie_word_embeddings must be true or false, got {tie!r}')

  def given(key, default):             # a key present with 0 is an error, not "use the default"
    return default() if fields.get(key) is None else fields[key]

  def per_head():                      # head_dim absent: hidden_size must split over the heads
    hidden = fields['hidden_size']
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads:
      raise CheckpointError(f'{where}: hidden_size={hidden} is not a multiple of '
                            f'num_attention_heads={heads} (and no head_dim is given)')
    return hidden // heads

  try:
    return ModelConfig(
        vocab_size=fields['vocab_size'], d_model=fields['hidden_size'],
        num_layers=fields['num_hidden_layers'], num_heads=heads,
        num_kv_heads=given('num_key_value_heads', lambda: heads),
        head_dim=given('head_dim', per_head),
        d_ff=fields['intermediate_size'], max_seq_len=fields['max_position_embeddings'],
        rope_theta=theta, norm_eps=fields['rms_norm_eps'],
        tie_embeddings=tie,
        qkv_bias=arch == 'Qwen2ForCausalLM', rope_scaling=scaling,
        sliding_window=_sliding_window(fields, arch, where), dtype=dtype)
  except CheckpointError:                 # already names `where`
    raise
  except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
    raise CheckpointError(f'{where}: {e}') from e


def _check_rope_layouts(fields: dict, rope_params: dict, where: str) -> None:
  """CheckpointError when the transformers 4 keys (`rope_theta`, `rope_scaling`) and the 5
  layout's `rope_parameters` both give a RoPE setting and disagree: which one a model was
  trained with cannot be told (the 4 keys won silently)."""
  theta, theta5 = fields.get('rope_theta'), rope_params.get('rope_theta')
  if theta is not None and theta5 is not None and theta != theta5:
    raise CheckpointError(f'{where}: rope_theta={theta!r} and rope_parameters.rope_theta='
                          f'{theta5!r} disagree')
  if fields.get('rope_scaling') and rope_params:
    try:
      old, new = (rope.normalize_scaling({k: v for k, v in d.items() if k != 'rope_theta'})
                  for d in (fields['rope_scaling'], rope_params))
    except (TypeError, ValueError, AttributeError):
      return                             # ModelConfig names what is wrong with the one it uses
    if old != new:
      raise CheckpointError(f'{where}: rope_scaling={fields["rope_scaling"]!r} and '
                            f'rope_parameters={rope_params!r} disagree')


def _sliding_window(fields: dict, arch: str, where: str) -> Optional[int]:
  """The window every layer uses, or None; CheckpointError when only some layers use one.

  As transformers reads the fields: Llama has no window (a sliding_window key is ignored);
  Mistral's and Qwen2's default to 4096 when the key is absent (null: none); Qwen2 windows only
  with use_sliding_window, the layers from max_window_layers (default 28) on."""
  if arch == 'LlamaForCausalLM':
    return None
  window = fields.get('sliding_window', 4096)
  if arch == 'Qwen2ForCausalLM' and not fields.get('use_sliding_window', False):
    window = None
  layer_types = fields.get('layer_types')
  if window is not None and layer_types is None and arch == 'Qwen2ForCausalLM':
    first = fields.get('max_window_layers', 28)       # Qwen2 windows layers >= max_window_layers
    layer_types = ['full_attention' if i < first else 'sliding_attention'
                   for i in range(fields['num_hidden_layers'])]
  if window is not None and layer_types is not None:
    kinds = set(layer_types)
    if kinds == {'full_attention'}:
      return None
    if kinds != {'sliding_attention'}:
      raise CheckpointError(f'{where}: a sliding window on only some layers (layer_types / '
                            'max_window_layers) is not supported')
  return window


def config_to_hf(config: ModelConfig, architecture: Optional[str] = None) -> dict:
  """The config.json fields of `config` (transformers 4 layout, which 4.x and 5.x both read).

  architecture: one of ARCHITECTURES; by default Qwen2 when the config has q/k/v biases, Mistral
  when it has a sliding window, else Llama. Raises ValueError when the architecture cannot
  express the config (biases outside Qwen2, a window on Llama).
  """
  if architecture is None:
    architecture = ('Qwen2ForCausalLM' if config.qkv_bias else
                    'MistralForCausalLM' if config.sliding_window else 'LlamaForCausalLM')
  if architecture not in ARCHITECTURES:
    raise ValueError(f'unknown architecture {architecture!r}; supported: {ARCHITECTURES}')
  if config.qkv_bias != (architecture == 'Qwen2ForCausalLM'):
    raise ValueError(f'{architecture} cannot hold a config with qkv_bias={config.qkv_bias}')
  if config.sliding_window and architecture == 'LlamaForCausalLM':
    raise ValueError('LlamaForCausalLM has no sliding window; use MistralForCausalLM')
  fields = {
      'architectures': [architecture],
      'model_type': architecture[:-len('ForCausalLM')].lower(),
      'vocab_size': config.vocab_size, 'hidden_size': config.d_model,
      'intermediate_size': config.d_ff, 'num_hidden_layers': config.num_layers,
      'num_attention_heads': config.num_heads, 'num_key_value_heads': config.num_kv_heads,
      'head_dim': config.head_dim, 'hidden_act': 'silu',
      'max_position_embeddings': config.max_seq_len, 'rms_norm_eps': config.norm_eps,
      'rope_theta': config.rope_theta,
      'rope_scaling': dict(config.rope_scaling) if config.rope_scaling else None,
      'tie_word_embeddings': config.tie_embeddings, 'torch_dtype': config.dtype,
  }
  if architecture == 'LlamaForCausalLM':
    fields.update(attention_bias=False, mlp_bias=False)
  elif architecture == 'MistralForCausalLM':
    fields['sliding_window'] = config.sliding_window
  else:
    fields.update(use_sliding_window=config.sliding_window is not None,
                  sliding_window=config.sliding_window, max_window_layers=0)
  return fields
