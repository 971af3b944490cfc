"""Replayed agent tool calls whose results are real JSON records (context hydration).

(`jaxspec.data.agent` builds conversations for prefix caching from windows of files; these are
whole records with a known structure, so a ground-truth state can be read off them.)


An episode replays an agent exploring one AWS service: at turn i it calls
``describe_operation(<name>)`` and the tool returns that operation's record exactly as botocore's
``service-2.json`` stores it (its own text, indentation and key order, documentation included),
e.g.::

    {
      "name":"BatchGetNamedQuery",
      "http":{
        "method":"POST",
        "requestUri":"/"
      },
      "input":{"shape":"BatchGetNamedQueryInput"},
      ...
      "documentation":"<p>Returns the details of ...</p>"
    }

Services come from the held-out split (by service directory, like the 'json' workload), so no
tool result was in the shipped models' training text. Operations are taken in file order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

from jaxspec.checks import check_int, check_seed
from jaxspec.data import corpus
from jaxspec.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One tool call: ``tool(argument)`` returned ``result`` (text) = ``value`` (parsed)."""
  tool: str
  argument: str
  result: str
  value: dict


@dataclasses.dataclass(frozen=True)
class ToolEpisode:
  """An agent loop over one service: ``name`` is the service-2 file, ``turns`` in order."""
  name: str
  turns: tuple[ToolCall, ...]


def operation_texts(text: str) -> dict[str, str]:
  """Each operation's record as it appears in a service-2 file, dedented to start at column 0.

  Falls back to ``json.dumps`` in botocore's style (indent 2, no space after ':') for a record
  whose text cannot be cut out verbatim. Raises ValueError if ``text`` has no operations.
  """
  value = json.loads(text)
  ops = value.get('operations') if isinstance(value, dict) else None
  if not isinstance(ops, dict) or not ops:
    raise ValueError('not a botocore service description: no "operations"')
  out = {}
  for name, op in ops.items():
    m = re.search(r'\n    ' + re.escape(json.dumps(name)) + r':(\{.*?\n    \})', text, re.S)
    piece = m and re.sub(r'\n    ', '\n', m.group(1))
    try:
      ok = piece is not None and json.loads(piece) == op
    except json.JSONDecodeError:
      ok = False
    out[name] = piece if ok else json.dumps(op, indent=2, separators=(',', ':'))
  return out


def tool_episodes(tokenizer: Tokenizer, num_episodes: int, num_turns: int, *,
                   max_result_tokens: int = 512, split: str = 'test',
                   seed: int = 0) -> list[ToolEpisode]:
  """``num_episodes`` episodes of ``num_turns`` turns from distinct services of ``split``.

  Services are ordered by SHA-256 of (seed, file name); a service qualifies when it has at least
  ``num_turns`` operations whose record is at most ``max_result_tokens`` tokens (longer records
  are skipped, not cut). Deterministic in its arguments.

  Raises:
    ValueError: num_episodes, num_turns or max_result_tokens not an int >= 1, a seed not a
      64-bit int, or too few qualifying services in the split.
  """
  num_episodes = check_int('num_episodes', num_episodes, 1)
  num_turns = check_int('num_turns', num_turns, 1)
  max_result_tokens = check_int('max_result_tokens', max_result_tokens, 1)
  seed = check_seed(seed)     # a Python int: the hashed repr of np.int64(0) is not that of 0
  docs = [d for d in corpus.documents('json', split) if '/service-2.json' in d.name]
  docs.sort(key=lambda d: hashlib.sha256(repr((seed, d.name)).encode()).digest())
  episodes = []
  for doc in docs:
    texts = operation_texts(doc.text)
    turns = []
    for name, text in texts.items():
      if len(tokenizer.encode(text)) <= max_result_tokens:
        turns.append(ToolCall('describe_operation', name, text, json.loads(text)))
      if len(turns) == num_turns:
        episodes.append(ToolEpisode(doc.name, tuple(turns)))
        break
    if len(episodes) == num_episodes:
      return episodes
  raise ValueError(f'split {split!r} has only {len(episodes)} services with {num_turns} '
                   f'operations of <= {max_result_tokens} tokens; {num_episodes} requested')
