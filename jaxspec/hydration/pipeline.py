"""Hydrating an agent session turn by turn: extract -> validate -> diff -> render.

For each tool call the extractor proposes a record; the store validates the new state
(`STATE_SCHEMA`) and records the JSON Patch from the previous state. A failed extraction (no
valid record after the extractor's retries, or a state that does not validate) leaves the state
as it was and keeps that turn's raw tool result in the big model's context from then on:
counted in `fallback`, never silently dropped. The ground truth is the same pipeline fed the
oracle's records; `fidelity` is whether the validated state equals it after the turn.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jsonschema

from jaxspec.data.tool_calls import ToolCall, ToolEpisode
from jaxspec.hydration.extract import Extraction
from jaxspec.hydration.render import render_hydrated, render_stuffing
from jaxspec.hydration.schema import (INITIAL_STATE, RECORD_SCHEMA, STATE_SCHEMA, truth_record,
                                      with_record)
from jaxspec.hydration.state import StateError, StateStore

_RECORD = jsonschema.Draft202012Validator(RECORD_SCHEMA)


@dataclasses.dataclass
class HydratedTurn:
  """One turn of a hydrated session (turn is 1-based).

  Attributes:
    extraction: what the extractor returned.
    fallback: True when this turn's raw result is passed instead of a state update.
    patch: RFC 6902 patch of this turn ([] on a fallback).
    state: the validated state after the turn.
    fidelity: state equals the ground-truth state after the turn.
    record_correct: the extracted record equals the true one.
    fields_correct, fields_total: scalar fields (name, method, uri, input, output, each error)
      of the extracted record equal to the true record's, position by position.
    stuffing_prompt, hydrated_prompt: the big model's context text under each strategy.
  """

  turn: int
  extraction: Extraction
  fallback: bool
  patch: list
  state: dict
  fidelity: bool
  record_correct: bool
  fields_correct: int
  fields_total: int
  stuffing_prompt: str
  hydrated_prompt: str


def _fields(record: dict) -> list:
  return ([record.get('name'), record.get('http', {}).get('method'),
           record.get('http', {}).get('requestUri'), record.get('input'), record.get('output')]
          + list(record.get('errors', [])))


def hydrate(episode: ToolEpisode, extractor: Callable[[ToolCall], Extraction]):
  """Run the pipeline over every turn of `episode`.

  Args:
    episode: the session's tool calls.
    extractor: call -> Extraction; a record that is None, or not of `RECORD_SCHEMA`'s shape, or
      whose state does not validate, is a fallback for that turn (a record not of the shape
      scores no correct field).
  Returns:
    (list of HydratedTurn, the StateStore holding every recorded patch).
  Raises:
    ValueError: episode not a ToolEpisode, extractor not callable, or an extractor that returns
      something other than an Extraction (named with the turn).
  """
  if not isinstance(episode, ToolEpisode):
    raise ValueError(f'episode must be a ToolEpisode, got {type(episode).__name__}')
  if not callable(extractor):
    raise ValueError(f'extractor must be a function of a ToolCall, got {extractor!r}')
  store = StateStore(STATE_SCHEMA, INITIAL_STATE)
  truth = INITIAL_STATE
  fallbacks: dict[int, ToolCall] = {}
  turns = []
  for i, call in enumerate(episode.turns, start=1):
    extraction = extractor(call)
    if not isinstance(extraction, Extraction):
      raise ValueError(f'turn {i}: the extractor returned {type(extraction).__name__}, not an '
                       f'Extraction')
    true_record = truth_record(call.value)
    truth = with_record(truth, true_record)
    # A record that is not RECORD_SCHEMA's shape (a custom extractor's: no name, a list, http as
    # a string) is a failed extraction like one that leaves the state invalid.
    record = extraction.record
    well_formed = isinstance(record, dict) and _RECORD.is_valid(record)
    patch, fallback = [], not well_formed
    if not fallback:
      try:
        patch = store.update(with_record(store.state, record))
      except StateError:
        fallback = True
    if fallback:
      fallbacks[i] = call
    want = _fields(true_record)
    # No record of the shape has no fields: a field the truth lacks (a call with no input) is
    # not matched by one the extraction never gave (it was: a failed extraction scored 1 of 11).
    correct = sum(a == b for a, b in zip(_fields(record), want)) if well_formed else 0
    turns.append(HydratedTurn(
        turn=i, extraction=extraction, fallback=fallback, patch=patch, state=store.state,
        fidelity=store.state == truth, record_correct=extraction.record == true_record,
        fields_correct=correct, fields_total=len(want),
        stuffing_prompt=render_stuffing(list(episode.turns[:i])),
        hydrated_prompt=render_hydrated(i, store.state, patch, dict(fallbacks))))
  return turns, store
