"""Argument checks shared across jaxspec: one rule and one wording for an integer or a real
argument."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

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


def is_int_in(value, low: int, high: int) -> bool:
  """Whether `value` passes `check_int` and lies in [low, high]."""
  try:
    return low <= check_int('value', value) <= high
  except ValueError:
    return False


def check_real(name: str, value, low: float, high: float, high_open: bool = False) -> float:
  """`value` as a float, if it is a finite real number (Python or numpy; not a bool) in
  [low, high], or [low, high) when `high_open`.

  Raises:
    ValueError: '{name} must be a finite number in [low, high], got {value!r}'.
  """
  ok = (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and
        math.isfinite(value) and low <= value and (value < high if high_open else value <= high))
  if not ok:
    bound = f'[{low}, {high})' if high_open else f'[{low}, {high}]'
    raise ValueError(f'{name} must be a finite number in {bound}, got {value!r}')
  return float(value)


def token_ids(tokens, label: str = 'tokens', vocab_size: Optional[int] = None) -> list:
  """`tokens` as a list of Python ints, if it is a flat sequence of integer token ids in
  [0, vocab_size) (in [0, 2**63) without a vocabulary: a page key packs each id in 8 bytes).

  Args:
    tokens: a list or tuple of ints (Python or numpy), or a 1-D integer array.
    label: how the error names the sequence ('prompt 0', 'context', ...).
    vocab_size: V, the model's vocabulary size (None: no model involved).
  Returns:
    list of int.
  Raises:
    ValueError: naming `label` and the first bad id: not a flat sequence of integers (text,
      floats, a nested list), a bool (np.asarray([1, True]) is an int array: True would
      silently be token 1), an id outside [0, V).
  """
  if isinstance(tokens, str) or getattr(tokens, 'ndim', 1) != 1 or not hasattr(tokens,
                                                                                '__iter__'):
    hint = ' (text? encode it first: Tokenizer.encode)' if isinstance(tokens, str) else ''
    raise ValueError(f'{label} must be a flat sequence of int token ids, got '
                     f'{str(tokens)[:60]!r}{hint}')
  if hasattr(tokens, 'dtype'):           # an array: one dtype for every element
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f'{label} must be a flat sequence of int token ids, got dtype '
                       f'{tokens.dtype}')
    ids = np.asarray(tokens).tolist()
  else:
    ids = []
    for t in tokens:
      try:
        if isinstance(t, (bool, np.bool_)):
          raise ValueError(f'{label} holds the bool {t!r}, not a token id')
        ids.append(operator.index(t))
      except TypeError:
        raise ValueError(f'{label} must be a flat sequence of int token ids, got {t!r} at '
                         f'position {len(ids)}') from None
  high = 2 ** 63 if vocab_size is None else vocab_size
  bad = next((t for t in ids if not 0 <= t < high), None)
  if bad is not None:
    where = f'the vocabulary [0, {vocab_size})' if vocab_size is not None else '[0, 2**63)'
    raise ValueError(f'{label} has token id {bad} outside {where}')
  return ids
