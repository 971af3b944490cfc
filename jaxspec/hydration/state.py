"""The agent's state store: a JSON document validated against a schema after every update, with
each update recorded as a JSON Patch (RFC 6902, via the `jsonpatch` library)."""

from __future__ import annotations

import copy
import math

import jsonpatch
import jsonschema


class StateError(ValueError):
  """A state that does not validate against the store's schema."""


class StateStore:
  """Current state + the patches that led to it from the first state.

  Attributes:
    schema: JSON schema every state satisfies.
    initial: the first state; state: the current one; patches: one RFC 6902 patch (a list of
      operations) per `update`, in order.
  """

  def __init__(self, schema: dict, initial: dict):
    """Raises StateError if `schema` is not a valid JSON schema (draft 2020-12), or `initial`
    does not validate against it."""
    try:
      jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:    # was jsonschema's UnknownType, later
      raise StateError(f'schema is not a valid JSON schema: {e.message}') from None
    self.schema = schema
    self._validator = jsonschema.Draft202012Validator(schema)
    self._check(initial)
    self.initial = copy.deepcopy(initial)
    self.state = copy.deepcopy(initial)
    self.patches: list[list[dict]] = []

  def _check(self, state):
    found = _not_json(state, [])
    if found is not None:    # jsonschema checks neither keys nor NaN: None would replay as 'None'
      path, why = found
      raise StateError(f'state does not validate at {path}: {why}')
    error = jsonschema.exceptions.best_match(self._validator.iter_errors(state))
    if error is not None:
      raise StateError(f'state does not validate at {list(error.absolute_path)}: '
                       f'{error.message}')

  def update(self, new_state: dict) -> list[dict]:
    """Validate `new_state`, record the patch from the current state to it, make it current.

    Returns:
      The RFC 6902 patch (list of operations; empty when nothing changed).
    Raises:
      StateError: `new_state` does not validate, or has a dict key that is not a string (the
        store is left unchanged).
    """
    self._check(new_state)
    # The patch's values are references into the state it was made from: the recorded patch
    # gets its own copy, or editing that state in place (the caller's working dict, or the
    # store's `state`, which hydrate hands out) would rewrite recorded history.
    patch = jsonpatch.make_patch(self.state, new_state).patch
    try:
      exact = _same(jsonpatch.apply_patch(self.state, patch), new_state)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
      exact = False
    if not exact:
      # jsonpatch compares list items with Python's ==, where 0 == False and 1 == True: a
      # change between them inside a list gives no operation; and it writes a replace of an
      # object key named '-' that it then refuses to apply ('-' ends an array). Replace the
      # whole state then.
      patch = [{'op': 'replace', 'path': '', 'value': new_state}]
    self.patches.append(copy.deepcopy(patch))
    self.state = copy.deepcopy(new_state)
    return patch

  def replay(self) -> dict:
    """The state obtained by applying every recorded patch to the first state, in order."""
    state = copy.deepcopy(self.initial)
    for patch in self.patches:
      state = jsonpatch.apply_patch(state, patch)
    return state


def _same(a, b) -> bool:
  """JSON equality that tells true / false from 1 / 0 (Python's == does not; 1 and 1.0 stay
  equal, as jsonpatch leaves them)."""
  if isinstance(a, bool) or isinstance(b, bool):
    return type(a) is type(b) and a == b
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  return a == b


def _not_json(value, path: list):
  """(path, why) of the first part of `value` that JSON cannot hold: a dict key that is not a
  str, a NaN or infinite float, or a value of another type (bytes, a set, an object: json.dumps
  failed on it only when the state was rendered); None when it is all JSON."""
  if isinstance(value, dict):
    for key, item in value.items():
      if not isinstance(key, str):
        return path, f"key {key!r} is not a string (a JSON object's keys are strings)"
      found = _not_json(item, path + [key])
      if found is not None:
        return found
  elif isinstance(value, (list, tuple)):
    for i, item in enumerate(value):
      found = _not_json(item, path + [i])
      if found is not None:
        return found
  elif isinstance(value, float) and not math.isfinite(value):
    return path, f'{value!r} is not a JSON number'
  elif value is not None and not isinstance(value, (str, int, float)):
    return path, f'{value!r:.60} ({type(value).__name__}) is not a JSON value'
  return None
