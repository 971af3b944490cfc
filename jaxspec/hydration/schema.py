"""What the agent's state keeps of each tool result, as JSON schemas.

A tool result (one botocore operation record) is reduced to its *record*: the fields an agent
needs to call the operation, in the source's own key order and nesting, documentation dropped::

    {"name":"BatchGetNamedQuery","http":{"method":"POST","requestUri":"/"},
     "input":{"shape":"BatchGetNamedQueryInput"},"output":{"shape":"BatchGetNamedQueryOutput"},
     "errors":[{"shape":"InternalServerException"},{"shape":"InvalidRequestException"}]}

The extraction task is made as feasible as we can for a small model: `record_schema` forces every
key the result has (and the number of errors), and every string value must be one of the
strings of *this* tool result (an enum), so the model only chooses which of the result's strings
goes where; it cannot invent one or skip a field.

The state is ``{"operations": {name: record without its name}, "last_operation": name | null}``,
rendered with "operations" first so that successive states share a long common prefix.
"""

from __future__ import annotations

import copy
from typing import Optional

# The methods botocore's operations use (the schemas constrain the extractor's output to them).
HTTP_METHODS = ('GET', 'POST', 'PUT', 'DELETE', 'PATCH', 'HEAD')
SKIPPED_KEYS = frozenset({'documentation', 'documentationUrl', 'deprecatedMessage'})
MAX_CANDIDATE_CHARS = 200


def truth_record(result: dict) -> dict:
  """The record of an operation, read directly from its parsed tool result (the oracle).

  Raises ValueError if the result is not an object with a string "name" and an "http" object
  with string method and requestUri, or if the method is not one of HTTP_METHODS (named: the
  state's schema allows only those). An input, output or error whose shape is not a string is
  left out (the record schema's shapes are names).
  """
  http = result.get('http') if isinstance(result, dict) else None
  if not isinstance(http, dict) or not isinstance(result.get('name'), str) or not all(
      isinstance(http.get(k), str) for k in ('method', 'requestUri')):
    keys = sorted(result) if isinstance(result, dict) else type(result).__name__
    raise ValueError(f'not an operation record (needs name, http.method, http.requestUri): '
                     f'{keys}')
  if http['method'] not in HTTP_METHODS:
    raise ValueError(f'not an operation record: http.method {http["method"]!r} is not one of '
                     f'{HTTP_METHODS}')
  record = {'name': result['name'],
            'http': {'method': http['method'], 'requestUri': http['requestUri']}}
  # Shapes are names (strings) in the record schema; anything else is not a shape reference.
  for key in ('input', 'output'):
    if isinstance(result.get(key), dict) and isinstance(result[key].get('shape'), str):
      record[key] = {'shape': result[key]['shape']}
  if isinstance(result.get('errors'), list):
    record['errors'] = [{'shape': e['shape']} for e in result['errors']
                        if isinstance(e, dict) and isinstance(e.get('shape'), str)]
  return record


def candidates(result, max_chars: Optional[int] = MAX_CANDIDATE_CHARS) -> list[str]:
  """Sorted distinct strings of a tool result (keys excluded, documentation skipped), of at
  most `max_chars` characters (None: any length)."""
  out = set()

  def walk(x):
    if isinstance(x, dict):
      for k, v in x.items():
        if k not in SKIPPED_KEYS:
          walk(v)
    elif isinstance(x, list):
      for v in x:
        walk(v)
    elif isinstance(x, str) and (max_chars is None or len(x) <= max_chars):
      out.add(x)
  walk(result)
  return sorted(out)


def _record_schema(string: dict, methods: dict) -> dict:
  shape = {'type': 'object', 'properties': {'shape': string}, 'required': ['shape'],
           'additionalProperties': False}
  errors = {'type': 'array', 'items': shape}
  return {
      'type': 'object',
      'properties': {
          'name': string,
          'http': {'type': 'object', 'properties': {'method': methods, 'requestUri': string},
                   'required': ['method', 'requestUri'], 'additionalProperties': False},
          'input': shape, 'output': shape, 'errors': errors},
      'required': ['name', 'http'],
      'additionalProperties': False}


def record_schema(result: dict) -> dict:
  """The schema an extraction of `result` must satisfy.

  Structure is read off the result, values are left to the extractor: the record has exactly
  the keys of the true record (`truth_record`: input / output / errors only when the result has
  them with string shapes) and as many errors; every
  string must be one of `candidates(result)` or of the true record's strings (a requestUri
  longer than MAX_CANDIDATE_CHARS stays allowed), the method one of HTTP_METHODS, so the true
  record always satisfies the schema.

  Raises:
    ValueError: the result is not an operation record (see `truth_record`).
  """
  shape = truth_record(result)
  strings = set(candidates(result)) | set(candidates(shape, max_chars=None))
  schema = _record_schema({'enum': sorted(strings)}, {'enum': list(HTTP_METHODS)})
  props = schema['properties']
  for key in ('input', 'output', 'errors'):
    if key in shape:
      schema['required'].append(key)
    else:
      del props[key]
  if 'errors' in shape:
    props['errors']['minItems'] = props['errors']['maxItems'] = len(shape['errors'])
  return schema


RECORD_SCHEMA = _record_schema({'type': 'string'}, {'enum': list(HTTP_METHODS)})
_ENTRY = copy.deepcopy(RECORD_SCHEMA)
del _ENTRY['properties']['name']
_ENTRY['required'].remove('name')
STATE_SCHEMA = {
    'type': 'object',
    'properties': {'operations': {'type': 'object', 'additionalProperties': _ENTRY},
                   'last_operation': {'type': ['string', 'null']}},
    'required': ['operations', 'last_operation'],
    'additionalProperties': False}
INITIAL_STATE = {'operations': {}, 'last_operation': None}


def with_record(state: dict, record: dict) -> dict:
  """A new state: `state` plus `record` (replacing an operation of the same name).

  Raises:
    ValueError: record not a dict with a string 'name', or state without an 'operations' dict.
  """
  if not isinstance(record, dict) or not isinstance(record.get('name'), str):
    raise ValueError(f"a record must be a dict with a string 'name', got {record!r:.120}")
  if not isinstance(state, dict) or not isinstance(state.get('operations'), dict):
    raise ValueError(f"a state must be a dict with an 'operations' dict, got {state!r:.120}")
  new = copy.deepcopy(state)
  entry = {k: v for k, v in record.items() if k != 'name'}
  new['operations'][record['name']] = entry
  new['last_operation'] = record['name']
  return new
