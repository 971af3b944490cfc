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
