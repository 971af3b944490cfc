"""The big model's prompt under each context strategy, after one stable prefix.

* stuffing: the prefix, then every tool result so far, verbatim (agent loops re-send the whole
  history every turn);
* hydration: the prefix, then the current state (compact JSON, "operations" first so successive
  states share a long prefix), the raw results of turns whose extraction failed (never dropped),
  and the change of this turn as an RFC 6902 JSON Patch.

Both end with the same marker after which the big model would write its next step. The model's
own replies are not part of the replay (the same for every strategy).
"""

from __future__ import annotations

import json

from jaxspec.data.tool_calls import ToolCall
from jaxspec.hydration.schema import STATE_SCHEMA

PREFIX = (
    '# Agent loop. You explore an AWS service with the tool describe_operation(name), which\n'
    '# returns the operation as botocore JSON. Reply with the next call as a JSON object:\n'
    '# {"tool": "describe_operation", "arguments": {"name": ...}}.\n'
    '# The state of what is known so far follows this JSON schema:\n'
    + json.dumps(STATE_SCHEMA, separators=(',', ':')) + '\n')
TOOL_HEADER = '\n## Tool result {turn}: {tool}("{argument}")\n'
STATE_HEADER = '\n## State\n'
CHANGES_HEADER = '\n## Changes in turn {turn} (JSON Patch)\n'
NEXT = '\n## Next call\n'


def _compact(value) -> str:
  return json.dumps(value, separators=(',', ':'))


def tool_block(turn: int, call: ToolCall) -> str:
  """The header and verbatim result of tool call `turn` (1-based)."""
  return TOOL_HEADER.format(turn=turn, tool=call.tool, argument=call.argument) + call.result


def render_stuffing(calls: list[ToolCall]) -> str:
  """Prefix + every tool result so far (turns 1..len(calls))."""
  return PREFIX + ''.join(tool_block(i + 1, c) for i, c in enumerate(calls)) + NEXT


def render_hydrated(turn: int, state: dict, patch: list, fallbacks: dict[int, ToolCall]) -> str:
  """Prefix + state + the raw results of failed extractions (turn -> call) + this turn's patch."""
  raw = ''.join(tool_block(t, fallbacks[t]) for t in sorted(fallbacks))
  return (PREFIX + STATE_HEADER + _compact(state) + '\n' + raw
          + CHANGES_HEADER.format(turn=turn) + _compact(patch) + NEXT)
