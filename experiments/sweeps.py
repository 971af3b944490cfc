"""Sweep definitions: lists of cases, their ids, and applying a case to a config.

A case is a dict of overrides `{dotted.field.path: value}`; a sweep is a list of cases. A config
file builds its sweep beside `get_config` (lists concatenate with `+`):

    def get_sweep():
      return product(k=[1, 2, 4, 8], temperature=[0.0, 1.0]) + zip_(k=[16], top_k=[50])

Dotted paths go through `**`: `product(**{'model.layers': [2, 4]})`.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import importlib.util
import itertools
import os
import pathlib
import re
from typing import Iterable, Optional

import ml_collections


def _value_lists(field_values: dict, fn: str) -> dict:
  """The field -> list-of-values arguments of `fn`, checked (ValueError names the field)."""
  if not field_values:
    raise ValueError(f'{fn}() needs at least one field=[values] argument')
  lists = {}
  for field, values in field_values.items():
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
      raise ValueError(f'{fn}(): {field} must be a list of values, got {values!r}')
    lists[field] = list(values)
    if not lists[field]:
      raise ValueError(f'{fn}(): {field} has no values')
  return lists


def product(**field_values) -> list[dict]:
  """Every combination of the given values (cartesian product), one case per combination.

  Args:
    **field_values: dotted field path -> list of values.
  Returns:
    Cases in a deterministic order: the first field varies slowest, the last fastest.
  Raises:
    ValueError: no fields, a field with no values, or a value that is not a list.
  """
  lists = _value_lists(field_values, 'product')
  return [dict(zip(lists, combo)) for combo in itertools.product(*lists.values())]


def zip_(**field_values) -> list[dict]:
  """Cases that pair the i-th value of every field (like zip, but lengths must match).

  Args:
    **field_values: dotted field path -> list of values, all of the same length.
  Raises:
    ValueError: the lengths differ (the message lists each field's length), or as `product`.
  """
  lists = _value_lists(field_values, 'zip_')
  lengths = {field: len(values) for field, values in lists.items()}
  if len(set(lengths.values())) > 1:
    raise ValueError('zip_() needs equal lengths, got '
                     + ', '.join(f'{f}={n}' for f, n in lengths.items()))
  return [dict(zip(lists, combo)) for combo in zip(*lists.values())]


def format_value(value) -> str:
  """How a case value is written in case ids and matched by `--only` (floats keep a '.')."""
  if isinstance(value, (list, tuple)):
    return '+'.join(format_value(v) for v in value)
  return repr(value) if isinstance(value, float) else str(value)


def case_id(overrides: dict) -> str:
  """A stable, readable, filesystem-safe id: `k=4,temperature=0.0,workloads=json`.

  Keys are sorted; characters other than letters, digits and `._=,+-` become `_`; ids longer
  than 200 characters are cut and end in a hash of the full id. `{}` is 'base'.
  """
  if not overrides:
    return 'base'
  text = ','.join(f'{k}={format_value(overrides[k])}' for k in sorted(overrides))
  safe = re.sub(r'[^A-Za-z0-9._=,+-]', '_', text)
  if len(safe) > 200:
    safe = safe[:180] + '~' + hashlib.sha1(text.encode()).hexdigest()[:12]
  return safe


def _coerce(path: str, value, field_type):
  """`value` converted to `field_type` the way config_flags parses a flag (ValueError if not)."""
  is_bool_for_number = isinstance(value, bool) and field_type is not bool
  if value is None or field_type in (type(None), object) or (
      isinstance(value, field_type) and not is_bool_for_number):
    return value
  try:
    if isinstance(value, str) and field_type is bool and \
        value.lower() in ('true', 'false', '1', '0'):
      return value.lower() in ('true', '1')
    if isinstance(value, str) and field_type in (int, float):
      return field_type(value)
    if field_type is float and isinstance(value, int) and not isinstance(value, bool):
      return float(value)
    if field_type in (tuple, list) and isinstance(value, (tuple, list)):
      return field_type(value)
  except ValueError:
    pass
  raise ValueError(f'config field {path!r} is {field_type.__name__}; cannot set it to {value!r}')


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: dict) -> ml_collections.ConfigDict:
  """A copy of `config` with `overrides` ({dotted.path: value}) applied; `config` is unchanged.

  Values are converted like config_flags would: an int for a float field, 'true' for a bool,
  '4' for an int; anything else must have the field's type (None fields take any value).
  Raises:
    ValueError: an unknown field (named, with close matches) or a value of the wrong type.
  """
  config = copy.deepcopy(config)
  for path, value in overrides.items():
    *parents, name = path.split('.')
    node = config
    for depth, part in enumerate(parents + [name]):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        close = difflib.get_close_matches(part, known, n=3)
        hint = f' (did you mean {", ".join(close)}?)' if close else ''
        raise ValueError(f'unknown config field {path!r}{hint}')
      if depth < len(parents):
        node = node[part]
    value = _coerce(path, value, node.get_type(name))
    try:
      node[name] = value
    except (TypeError, ValueError) as e:
      raise ValueError(f'cannot set config field {path!r} to {value!r}: {e}') from e
  return config


def validate_sweep(config: ml_collections.ConfigDict, cases) -> list[ml_collections.ConfigDict]:
  """Checks every case against `config` before anything runs; returns the case configs.

  Raises:
    ValueError: the sweep is not a non-empty list of dicts, a case names an unknown field or has
      a value of the wrong type (the message names the case and the field), or two cases share
      an id or, once their values are converted to the fields' types, a config.
  """
  if not isinstance(cases, (list, tuple)) or not cases:
    raise ValueError(f'a sweep must be a non-empty list of override dicts, got {cases!r}')
  seen, same_config, configs = {}, {}, []
  for i, case in enumerate(cases):
    if not isinstance(case, dict) or not all(isinstance(k, str) for k in case):
      raise ValueError(f'sweep case {i} must be a dict of field -> value, got {case!r}')
    cid = case_id(case)
    if cid in seen:
      raise ValueError(f'sweep cases {seen[cid]} and {i} have the same id {cid!r}')
    seen[cid] = i
    try:
      configs.append(apply_overrides(config, case))
    except ValueError as e:
      raise ValueError(f'sweep case {i} ({cid}): {e}') from e
    text = configs[-1].to_json(sort_keys=True)     # after coercion: 1 and 1.0 are one case
    if text in same_config:
      j = same_config[text]
      raise ValueError(f'sweep cases {j} ({case_id(cases[j])}) and {i} ({cid}) give the same '
                       f'config: each would be measured twice')
    same_config[text] = i
  return configs


def parse_only(items: Iterable[str]) -> dict[str, list[str]]:
  """`--only` values -> {field: [accepted values]}; 'k=4,temperature=0.0' holds two filters.

  A comma starts a new filter only when `field=` (or a bare `=`, an error) follows it, spaces
  allowed, so `workloads=json,code` is one filter and `k=4, temperature=0.0` two.
  Raises:
    ValueError: a filter without `=`.
  """
  only: dict[str, list[str]] = {}
  for item in items or ():
    for part in re.split(r',(?=\s*[A-Za-z_][\w.]*=|\s*=)', item):  # ',=3': a filter, no field
      field, sep, value = part.partition('=')
      if not sep or not field.strip():
        raise ValueError(f'--only takes field=value, got {part!r}')
      only.setdefault(field.strip(), []).append(value.strip())
  return only


def _same(value, text: str) -> bool:
  if format_value(value) == text or str(value).lower() == text.lower():
    return True
  try:
    return not isinstance(value, (bool, str)) and float(value) == float(text)
  except (TypeError, ValueError):
    return False


def matches(overrides: dict, only: dict[str, list[str]]) -> bool:
  """Whether a case passes every filter: values of one field are OR-ed, fields are AND-ed."""
  return all(field in overrides and any(_same(overrides[field], v) for v in values)
             for field, values in only.items())


def parse_shard(text: Optional[str]) -> Optional[tuple[int, int]]:
  """'i/n' -> (i, n), 0 <= i < n; None or '' -> None. Raises ValueError otherwise."""
  if not text:
    return None
  m = re.fullmatch(r'\s*(\d+)\s*/\s*(\d+)\s*', text)
  if not m or not 0 <= int(m[1]) < int(m[2]):
    raise ValueError(f'--shard takes i/n with 0 <= i < n, got {text!r}')
  return int(m[1]), int(m[2])


def select_cases(cases: list[dict], only: Iterable[str] = (), shard: Optional[str] = None
                 ) -> list[int]:
  """Indices of the cases that pass the `--only` filters and fall in `--shard` ('i/n').

  Raises:
    ValueError: a filter names a field the sweep does not vary, a bad filter or shard, or
      nothing is selected.
  """
  filters, shard_in = parse_only(only), parse_shard(shard)
  swept = {field for case in cases for field in case}
  for field in filters:
    if field not in swept:
      raise ValueError(f'--only field {field!r} is not swept (swept: {", ".join(sorted(swept))})')
  picked = [i for i, case in enumerate(cases) if matches(case, filters)
            and (shard_in is None or i % shard_in[1] == shard_in[0])]
  if not picked:
    values = '; '.join(
        f'{field}: ' + ', '.join(dict.fromkeys(format_value(c[field]) for c in cases
                                               if field in c))
        for field in sorted(filters))
    swept_values = f' (swept values: {values})' if values else ''
    raise ValueError(f'no case matches --only={list(only or ())} --shard={shard}{swept_values}')
  return picked


def load_sweep(spec: str) -> tuple[ml_collections.ConfigDict, list]:
  """Loads a config file given as `path[:variant]`: (get_config(variant), get_sweep()).

  Raises:
    ValueError: the file does not exist or defines no get_sweep().
  """
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise ValueError(f'config file {path!r} not found')
  module_spec = importlib.util.spec_from_file_location('_sweep_' + pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise ValueError(f'{path} defines no get_sweep()')
  return (module.get_config(arg) if arg else module.get_config()), module.get_sweep()
