"""Model hyper-parameters: a frozen dataclass with named presets (gpt-fast's
`ModelArgs.from_name`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import ml_dtypes  # pylint: disable=unused-import  (registers bfloat16 with numpy)
import numpy as np

from jaxspec.checks import check_int, check_real, is_int_in
from jaxspec.models import rope


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of a Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

  Attributes:
    vocab_size: V, number of token ids.
    d_model: D, residual stream width.
    num_layers: number of decoder blocks.
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads (N % K == 0; K < N is grouped-query attention).
    head_dim: H, width of one head (even: RoPE rotates pairs).
    d_ff: hidden width of the SwiGLU MLP.
    max_seq_len: context length in tokens (prompt + generated + speculation slack).
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: use the embedding matrix as the output projection.
    qkv_bias: biases on the q/k/v projections (Qwen2 family).
    rope_scaling: () or sorted (key, value) pairs, e.g. Llama 3.1's
      (('factor', 8.0), ..., ('rope_type', 'llama3')); a dict is accepted and normalized (see
      `jaxspec.models.rope`; types: 'linear', 'llama3').
    sliding_window: None, or each token attends only to itself and the sliding_window - 1
      tokens before it (Mistral).
    dtype: compute dtype of activations, e.g. 'float32' or 'bfloat16'.
    exact_verify: numerics policy, not a weight property: (K+1)-token verification rounds
      exactly like K+1 single-token decode steps, at some cost in speed (see
      `jaxspec.models.llama.matmul_rows`), for K + 1 <= EXACT_ROWS (32; `generate` refuses a
      larger K in this mode). Tests of greedy equality turn it on; timings do not.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  max_seq_len: int = 1024
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  rope_scaling: tuple = ()
  sliding_window: Optional[int] = None
  dtype: str = 'float32'
  exact_verify: bool = False

  def __post_init__(self):
    for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads',
                 'num_kv_heads', 'head_dim', 'd_ff', 'max_seq_len'):
      object.__setattr__(self, name, check_int(f'ModelConfig.{name}', getattr(self, name), 1))
    if self.head_dim % 2:                    # RoPE rotates pairs: half-split of each head
      raise ValueError(f'ModelConfig.head_dim must be even (RoPE rotates pairs of dimensions), '
                       f'got {self.head_dim}')
    for name in ('rope_theta', 'norm_eps'):       # np.float32 too, stored as a float
      value = getattr(self, name)
      try:
        number = check_real(name, value, 0.0, math.inf, high_open=True)
      except ValueError:
        number = 0.0
      if number <= 0.0:
        raise ValueError(f'ModelConfig.{name} must be a positive finite number, got {value!r}')
      object.__setattr__(self, name, number)
    for name in ('tie_embeddings', 'qkv_bias', 'exact_verify'):
      if not isinstance(getattr(self, name), bool):    # "no" and 1 would read as True
        raise ValueError(f'ModelConfig.{name} must be true or false, got {getattr(self, name)!r}')
    object.__setattr__(self, 'rope_scaling', rope.normalize_scaling(self.rope_scaling))
    if self.sliding_window is not None:
      if not is_int_in(self.sliding_window, 1, math.inf):
        raise ValueError(f'ModelConfig.sliding_window must be None or a positive int, '
                         f'got {self.sliding_window!r}')
      object.__setattr__(self, 'sliding_window', int(self.sliding_window))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}')
    try:          # a name, np.dtype or jnp scalar type, stored as its name: hashes alike
      name = None if isinstance(self.dtype, bool) else np.dtype(self.dtype).name
    except TypeError:
      name = None
    if name not in ('float32', 'bfloat16', 'float16'):
      raise ValueError(f'ModelConfig.dtype must be float32, bfloat16 or float16, '
                       f'got {self.dtype!r}')
    object.__setattr__(self, 'dtype', name)

  @property
  def group_size(self) -> int:
    """G = N / K query heads per key/value head."""
    return self.num_heads // self.num_kv_heads

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings and output head included)."""
    d, h = self.d_model, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * d * self.d_ff
    per_layer = attn + mlp + 2 * d
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.num_layers * per_layer + d + head

  def kv_bytes_per_token(self, bytes_per_value: Optional[int] = None) -> int:
    """Bytes of K and V cached per token over all layers, at `bytes_per_value` bytes a value
    (default: the itemsize of `dtype`, the cache's dtype)."""
    if bytes_per_value is None:
      bytes_per_value = np.dtype(self.dtype).itemsize
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

  @classmethod
  def from_name(cls, name: str, **overrides) -> 'ModelConfig':
    """A named preset, optionally with fields overridden. Raises ValueError for an unknown name."""
    if name not in PRESETS:
      raise ValueError(f'unknown model preset {name!r}; known: {sorted(PRESETS)}')
    return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {
    # The shipped target: ~12.6M parameters, 50 MB in float32 (3x a 16 MiB last-level cache).
    'target-12m': ModelConfig(vocab_size=4096, d_model=384, num_layers=6, num_heads=6,
                              num_kv_heads=2, head_dim=64, d_ff=1024, max_seq_len=1024),
    # The shipped draft: ~1.4M parameters, about a tenth of the target's per-token bytes.
    'draft-1m': ModelConfig(vocab_size=4096, d_model=128, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=64, d_ff=384, max_seq_len=1024),
    # Tiny shapes for unit tests.
    'test-tiny': ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=256),
}


def check_model_config(config, name: str) -> None:
  """Refuse a `config` that is not a `ModelConfig` before a step reads its fields.

  Args:
    config: what was passed as a model (`load_model` returns `(ModelConfig, params)`).
    name: the argument's name for the message ('target', 'draft', ...).
  Raises:
    TypeError: naming `name` and the type given (a `Transformer` module, say, which otherwise
      failed inside flax with an AttributeError about `vocab_size`).
  """
  if not isinstance(config, ModelConfig):
    raise TypeError(f'{name} must be a jaxspec ModelConfig (load_model returns (config, params); '
                    f'Transformer(config) is the module built from it), got '
                    f'{type(config).__name__}')
