"""Rotary-embedding frequencies, with the context-extension scalings real checkpoints use.

`ModelConfig.rope_scaling` holds the scaling as a sorted tuple of (key, value) pairs (hashable, so
the config stays a static jit argument), e.g. Llama 3.1's

    (('factor', 8.0), ('high_freq_factor', 4.0), ('low_freq_factor', 1.0),
     ('original_max_position_embeddings', 8192), ('rope_type', 'llama3'))

Supported types:
  * 'linear' (position interpolation, Chen et al. 2023): every frequency divided by `factor`.
  * 'llama3' (Meta's Llama 3.1 recipe): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, those shorter
    than original_max_position_embeddings / high_freq_factor are kept, and the band between is
    interpolated linearly in original_max_position_embeddings / wavelength.
Types whose frequencies depend on the sequence length ('dynamic') or that also rescale the
attention logits ('yarn', 'longrope') are rejected by `normalize_scaling` with the type named.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import jax.numpy as jnp
import numpy as np

# Keys each supported type needs (besides 'rope_type').
SCALING_KEYS = {
    'linear': ('factor',),
    'llama3': ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'),
}


def normalize_scaling(scaling) -> tuple:
  """A rope_scaling value in canonical form: () for none, else sorted (key, value) pairs.

  Args:
    scaling: None, a dict (as in a Hugging Face config.json; 'type' is read as 'rope_type'), or
      an iterable of (key, value) pairs (as a ModelConfig stores it, or as JSON lists of pairs).
  Returns:
    () or a tuple of (str, float | int | str) pairs sorted by key, keeping only 'rope_type' and
    the keys its type uses.
  Raises:
    ValueError: naming an unsupported type, a missing key (also a type missing beside a
      scaling key such as factor), or a value that is not a positive finite number (factor must
      be >= 1; high_freq_factor > low_freq_factor).
  """
  if scaling is None or (not isinstance(scaling, str) and len(scaling) == 0):
    return ()
  try:
    fields = dict(scaling)
  except (TypeError, ValueError) as e:
    raise ValueError(f'rope_scaling must be a dict or (key, value) pairs, got {scaling!r}') from e
  kind = fields.get('rope_type', fields.get('type'))
  scaling_keys = sorted(set(fields) & {k for keys in SCALING_KEYS.values() for k in keys})
  if kind is None and scaling_keys:   # transformers refuses it too: the scaling would be lost
    raise ValueError(f'rope_scaling gives {", ".join(scaling_keys)} but no rope_type (or type), '
                     f'got {scaling!r}')
  if kind in (None, 'default'):
    return ()
  if kind not in SCALING_KEYS:
    raise ValueError(f'rope_scaling type {kind!r} is not supported '
                     f'(supported: default, {", ".join(sorted(SCALING_KEYS))})')
  out = {'rope_type': kind}
  for key in SCALING_KEYS[kind]:
    if key not in fields:
      raise ValueError(f'rope_scaling of type {kind!r} is missing {key!r}')
    value = fields[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not (
        0 < value < float('inf')):
      raise ValueError(f'rope_scaling {key} must be a positive finite number, got {value!r}')
    out[key] = int(value) if isinstance(value, numbers.Integral) else float(value)
  if out['factor'] < 1:
    raise ValueError(f'rope_scaling factor must be >= 1, got {out["factor"]!r}')
  if kind == 'llama3' and not out['high_freq_factor'] > out['low_freq_factor']:
    raise ValueError(f'rope_scaling high_freq_factor ({out["high_freq_factor"]}) must exceed '
                     f'low_freq_factor ({out["low_freq_factor"]})')
  return tuple(sorted(out.items()))


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[tuple] = ()):
  """The H/2 rotary inverse frequencies theta^(-2i/H), scaled as `scaling` says.

  Args:
    head_dim: H (even).
    theta: RoPE base.
    scaling: () or a normalized rope_scaling (see `normalize_scaling`).
  Returns:
    [H/2] float32.
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if not scaling:
    return inv_freq
  s = dict(scaling)
  if s['rope_type'] == 'linear':
    return inv_freq / s['factor']
  # 'llama3': per-wavelength interpolation between the original and the stretched frequency.
  factor, low, high = s['factor'], s['low_freq_factor'], s['high_freq_factor']
  old_len = s['original_max_position_embeddings']
  wavelen = 2 * math.pi / inv_freq
  stretched = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * stretched / factor + smooth * stretched
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(medium, smoothed, stretched)
