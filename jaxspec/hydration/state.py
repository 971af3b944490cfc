"""The agent's state store: a JSON document validated against a schema after every update, with
each update recorded as a JSON Patch (RFC 6902, via the `jsonpatch` library)."""

from __future__ import annotations

import copy

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
    """Raises StateError if `initial` does not validate against `schema`."""
    self.schema = schema
    self._validator = jsonschema.Draft202012Validator(schema)
    self._check(initial)
    self.initial = copy.deepcopy(initial)
    self.state = copy.deepcopy(initial)
    self.patches: list[list[dict]] = []

  def _check(self, state):
    error = jsonschema.exceptions.best_match(self._validator.iter_errors(state))
    if error is not None:
      raise StateError(f'state does not validate at {list(error.absolute_path)}: '
                       f'{error.message}')

  def update(self, new_state: dict) -> list[dict]:
    """Validate `new_state`, record the patch from the current state to it, make it current.

    Returns:
      The RFC 6902 patch (list of operations; empty when nothing changed).
    Raises:
      StateError: `new_state` does not validate (the store is left unchanged).
    """
    self._check(new_state)
    patch = jsonpatch.make_patch(self.state, new_state).patch
    self.patches.append(patch)
    self.state = copy.deepcopy(new_state)
    return patch

  def replay(self) -> dict:
    """The state obtained by applying every recorded patch to the first state, in order."""
    state = copy.deepcopy(self.initial)
    for patch in self.patches:
      state = jsonpatch.apply_patch(state, patch)
    return state
