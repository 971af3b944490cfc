"""Argument checks shared across jaxspec: one rule and one wording for an integer or a real
argument."""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import pathlib
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np


def check_int(name: str, value, minimum: Optional[int] = None) -> int:
  """`value` as a Python int, if it is an integer (Python, numpy or a 0-d integer array: anything
  with `__index__`) of at least `minimum`.

  bool and np.bool_ are refused (True would silently mean 1), and so are floats, even whole
  ones (3.0 is a sign the caller computed something other than a count), and strings.

  Args:
    name: the argument's name, for the error.
    value: the argument.
    minimum: the smallest value allowed (None: any).
  Returns:
    int(value).
  Raises:
    ValueError: '{name} must be an int >= {minimum}, got {value!r}' (without '>= ...' when
      minimum is None).
  """
  try:
    if isinstance(value, (bool, np.bool_)):
      raise TypeError
    number = operator.index(value)
  except TypeError:
    number = None
  if number is None or (minimum is not None and number < minimum):
    bound = '' if minimum is None else f' >= {minimum}'
    raise ValueError(f'{name} must be an int{bound}, got {value!r}')
  return number


def counted(n: int, noun: str) -> str:
  """'1 token', '2 tokens': a count for an error message (`noun` singular, plural with 's')."""
  return f'{n} {noun}' if n == 1 else f'{n} {noun}s'


def is_int_in(value, low: int, high: int) -> bool:
  """Whether `value` passes `check_int` and lies in [low, high]."""
  if type(value) is int:       # the common case, without check_int's conversions (a bool is not)
    return low <= value <= high
  try:
    return low <= check_int('value', value) <= high
  except ValueError:
    return False


def check_real(name: str, value, low: float, high: float, high_open: bool = False,
               low_open: bool = False) -> float:
  """`value` as a float, if it is a finite real number (Python or numpy; not a bool) in
  [low, high]; `low_open` / `high_open` leave that end out ((low, high], [low, high), ...).

  Raises:
    ValueError: '{name} must be a finite number in [low, high], got {value!r}' (with the
      interval's brackets as checked).
  """
  ok = (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and
        math.isfinite(value) and (low < value if low_open else low <= value) and
        (value < high if high_open else value <= high))
  if not ok:
    bound = f'{"(" if low_open else "["}{low}, {high}{")" if high_open else "]"}'
    raise ValueError(f'{name} must be a finite number in {bound}, got {value!r}')
  return float(value)


def token_ids(tokens, label: str = 'tokens', vocab_size: Optional[int] = None) -> list:
  """`tokens` as a list of Python ints, if it is a flat sequence of integer token ids in
  [0, vocab_size) (in [0, 2**63) without a vocabulary: a page key packs each id in 8 bytes).

  Args:
    tokens: a list, tuple or range of ints (Python or numpy), or a 1-D integer array (numpy or
      jax). Text (str, bytes), sets, dicts and iterators are refused: their order or their
      meaning as ids is not the caller's.
    label: how the error names the sequence ('prompt 0', 'context', ...).
    vocab_size: V, the model's vocabulary size (None: no model involved).
  Returns:
    list of int.
  Raises:
    ValueError: naming `label` and the first bad id: not a flat sequence of integers, a bool
      (np.asarray([1, True]) is an int array: True would silently be token 1), an id outside
      [0, V).
  """
  if isinstance(tokens, (list, tuple, range)):
    if all(type(t) is int for t in tokens):      # the common case, at the cost of a list copy
      ids = list(tokens)
    else:
      ids = [_token_id(t, label, i) for i, t in enumerate(tokens)]
  elif getattr(tokens, 'ndim', None) == 1 and hasattr(tokens, 'dtype'):   # numpy / jax array
    if np.dtype(tokens.dtype) == object:
      ids = [_token_id(t, label, i) for i, t in enumerate(np.asarray(tokens).tolist())]
    elif tokens.size and not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f'{label} must be a flat sequence of int token ids, got an array of '
                       f'dtype {tokens.dtype}')
    else:
      ids = np.asarray(tokens).tolist()
  else:
    text = isinstance(tokens, (str, bytes, bytearray))
    hint = ' (text? encode it first: Tokenizer.encode)' if text else ''
    shape = f' of shape {tokens.shape}' if hasattr(tokens, 'shape') else ''
    raise ValueError(f'{label} must be a list, tuple or 1-D array of int token ids, got '
                     f'{type(tokens).__name__}{shape}{hint}')
  high = 2 ** 63 if vocab_size is None else vocab_size
  if ids and (min(ids) < 0 or max(ids) >= high):
    bad = next(t for t in ids if not 0 <= t < high)
    where = f'the vocabulary [0, {vocab_size})' if vocab_size is not None else '[0, 2**63)'
    raise ValueError(f'{label} has token id {bad} outside {where}')
  return ids


def _token_id(value, label: str, position: int) -> int:
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{label} holds the bool {value!r}, not a token id')
  try:
    return operator.index(value)
  except TypeError:
    raise ValueError(f'{label} must be a flat sequence of int token ids, got {value!r} at '
                     f'position {position}') from None


def check_seed(value) -> int:
  """`value` as a Python int, if it is an int (as `check_int`) that fits a 64-bit PRNG seed.

  Raises:
    ValueError: 'seed must be a 64-bit int, got {value!r}'.
  """
  if not is_int_in(value, -2 ** 63, 2 ** 63 - 1):
    raise ValueError(f'seed must be a 64-bit int, got {value!r}')
  return int(value)


def seed_key(seed) -> jax.Array:
  """The PRNG key of a 64-bit `seed` (checked by `check_seed`): `jax.random.PRNGKey(seed)` for
  seeds in [0, 2**32), where it is unchanged; above, and for negative seeds, the high 32 bits
  are folded in. With 64-bit mode off `PRNGKey` keeps only the low 32 bits, so seeds 1 and
  2**32 + 1 (or -1 and 2**32 - 1) gave one stream.

  Returns:
    A raw key (uint32[2] under the default threefry implementation).
  Raises:
    ValueError: as `check_seed`.
  """
  seed = check_seed(seed) & (2 ** 64 - 1)          # two's complement: -1 -> 2**64 - 1
  key = jax.random.PRNGKey(seed & 0xFFFFFFFF)
  return key if seed < 2 ** 32 else jax.random.fold_in(key, seed >> 32)


def check_array(name: str, x, kind: str) -> None:
  """ValueError unless `x` is an array (has a dtype and a shape) whose dtype is of `kind`:
  'float' (any floating dtype) or 'integer' (not bool). A list reached jitted code as a pytree of
  scalars, and an int query array gave int attention outputs."""
  if not hasattr(x, 'dtype') or not hasattr(x, 'shape'):
    raise ValueError(f'{name} must be an array, got {type(x).__name__}')
  if not jnp.issubdtype(x.dtype, jnp.floating if kind == 'float' else jnp.integer):
    raise ValueError(f'{name} must be {"a float" if kind == "float" else "an integer"} array, '
                     f'got dtype {x.dtype}')


def concrete(x) -> Optional[np.ndarray]:
  """`x` as a numpy array, or None when its values cannot be read here: traced (inside a
  caller's jit) or spread over processes (not fully addressable). Reading a device array waits
  for it and copies it to the host, so checks that call this belong once per call, not per step.
  """
  if isinstance(x, jax.core.Tracer) or not getattr(x, 'is_fully_addressable', True):
    return None
  return np.asarray(x)


def nearest_existing(path) -> pathlib.Path:
  """The first of `path` (made absolute) and its parents that exists: where writing to `path`
  would start creating directories. Callers check it is a directory before long work whose
  result would then be lost."""
  path = pathlib.Path(path).absolute()
  return next(p for p in (path, *path.parents) if p.exists())


def build_with_options(kind: str, name, classes: Mapping[str, type], options: Mapping):
  """`classes[name](**options)`, the options checked against the constructor's keyword
  arguments first: one wording for a component named by a string with options (a K policy,
  a drafter; the batching study's `k_policy.OPTION` and `drafter.OPTION` settings).

  Args:
    kind: what is built, as the error names it ('k_policy', 'drafter').
    name: the component's name, a key of `classes`.
  Raises:
    ValueError: naming the value: an unknown name (the known ones listed), an option the
      constructor does not take (the known ones listed), or a value it refuses (its message).
  """
  if not (isinstance(name, str) and name in classes):
    raise ValueError(f'unknown {kind} {name!r}: expected one of {sorted(classes)}')
  known = sorted(n for n, p in inspect.signature(classes[name].__init__).parameters.items()
                 if n != 'self' and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(f'{kind} {name!r} has no option {", ".join(map(repr, unknown))} '
                     f'(known: {", ".join(known) or "none"})')
  try:
    return classes[name](**options)
  except (TypeError, ValueError) as error:
    raise ValueError(f'{kind} {name!r} with {dict(options)}: {error}') from error
