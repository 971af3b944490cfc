"""Multi-turn agent conversations built from held-out real files, for prefix caching (and context
hydration) experiments.

Every conversation starts with the same long system prefix: fixed instructions, then "tool
schemas" (windows of real botocore service definitions), then an exemplar (a window of real
stdlib code). Turn t adds a tool result (a window of another real JSON file, between a header and
an "## Assistant" marker) and the model's reply. An agent loop re-sends the whole history every
turn::

    prompt_t = prefix + (tool_1 + reply_1) + ... + (tool_{t-1} + reply_{t-1}) + tool_t

Choices are SHA-256 hashes of (seed, role, file name), so a seed gives the same conversations on
every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib

from jaxspec.checks import check_int, check_seed, token_ids
from jaxspec.data import corpus
from jaxspec.data.tokenizer import Tokenizer

INSTRUCTIONS = (
    '# Agent loop. You operate AWS services through the tools described below. After each tool\n'
    '# result, reply with the next call as a JSON object: {"tool": ..., "arguments": {...}}.\n')
TOOLS_HEADER = '\n## Tools\n'
EXAMPLE_HEADER = '\n## Example of a helper you may call\n'
TOOL_HEADER = '\n## Tool result {turn}\n'
ASSISTANT = '\n## Assistant\n'
SCHEMA_FRACTION = 0.6  # of the prefix after the instructions; the exemplar gets the rest


@dataclasses.dataclass(frozen=True)
class Conversation:
  """One agent conversation's inputs (the replies come from the model as it runs).

  prefix: the system prefix ids, identical across conversations of one workload.
  tool_results: per turn, the ids of the wrapped tool result (header + JSON window + marker).
  sources: per turn, '<file>@<token offset>' of the JSON window.
  """
  prefix: tuple[int, ...]
  tool_results: tuple[tuple[int, ...], ...]
  sources: tuple[str, ...]


def _hash(*parts: object) -> int:
  return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], 'big')


def _window(ids: list[int], length: int, *salt) -> tuple[list[int], int]:
  off = _hash(*salt) % (len(ids) - length + 1)
  return ids[off:off + length], off


def turn_prompt(conversation: Conversation, turn: int, replies) -> list[int]:
  """The full prompt of `turn` (0-based): prefix + earlier tool results and replies + this
  turn's tool result.

  Args:
    replies: the model's reply ids of turns 0 .. turn-1 (at least `turn` of them).
  Raises:
    ValueError: a turn that is not an int inside the conversation, too few replies, or a reply
      that is not a sequence of token ids (a str would be spliced in character by character).
  """
  turn = check_int('turn', turn, 0)
  if turn >= len(conversation.tool_results):
    raise ValueError(f'turn {turn} outside 0 .. {len(conversation.tool_results) - 1}')
  if len(replies) < turn:
    raise ValueError(f'turn {turn} needs {turn} earlier replies, got {len(replies)}')
  ids = list(conversation.prefix)
  for t in range(turn):
    ids += list(conversation.tool_results[t]) + token_ids(replies[t], f'replies[{t}]')
  return ids + list(conversation.tool_results[turn])


def make_conversations(tokenizer: Tokenizer, *, num_conversations: int, num_turns: int,
                       prefix_tokens: int, tool_tokens: int, split: str = 'test',
                       seed: int = 0) -> list[Conversation]:
  """`num_conversations` conversations of `num_turns` turns sharing one system prefix.

  Args:
    prefix_tokens: length of the shared prefix in tokens (exact).
    tool_tokens: tokens of JSON per tool result (the header and marker add ~14 more).
    split: corpus split the files come from ('test' = held out from training).
  Returns:
    Conversations with distinct tool-result files (wrapping round to new windows when the split
    has too few files).
  Raises:
    ValueError: a count not an int >= 1, a seed not a 64-bit int, a prefix too short for the
      instructions, no file long enough, or fewer distinct windows than tool results.
  """
  num_conversations = check_int('num_conversations', num_conversations, 1)
  num_turns = check_int('num_turns', num_turns, 1)
  tool_tokens = check_int('tool_tokens', tool_tokens, 1)
  prefix_tokens = check_int('prefix_tokens', prefix_tokens)
  seed = check_seed(seed)     # a Python int: the hashed repr of np.int64(0) is not that of 0
  head = tokenizer.encode(INSTRUCTIONS + TOOLS_HEADER)
  example_head = tokenizer.encode(EXAMPLE_HEADER)
  room = prefix_tokens - len(head) - len(example_head)
  if room < 16:
    raise ValueError(f'prefix_tokens={prefix_tokens} leaves {room} tokens after the '
                     f'{len(head) + len(example_head)} of instructions; need >= 16')
  json_docs = sorted(corpus.documents('json', split), key=lambda d: _hash(seed, 'json', d.name))
  code_docs = sorted(corpus.documents('code', split), key=lambda d: _hash(seed, 'code', d.name))
  encoded = {}

  def ids_of(doc):
    if doc.name not in encoded:
      encoded[doc.name] = tokenizer.encode(doc.text)
    return encoded[doc.name]

  schema_len = int(room * SCHEMA_FRACTION)
  schemas = next((d for d in json_docs if 'service-2' in d.name and len(ids_of(d)) >= schema_len),
                 None)
  example = next((d for d in code_docs if len(ids_of(d)) >= room - schema_len), None)
  if schemas is None or example is None:
    raise ValueError(f'split {split!r} has no file long enough for a {prefix_tokens}-token prefix')
  schema_ids, _ = _window(ids_of(schemas), schema_len, seed, 'schema', schemas.name)
  example_ids, _ = _window(ids_of(example), room - schema_len, seed, 'example', example.name)
  prefix = tuple(head + schema_ids + example_head + example_ids)

  tools = [d for d in json_docs if d is not schemas and len(ids_of(d)) >= tool_tokens]
  if not tools:
    raise ValueError(f'split {split!r} has no JSON file of {tool_tokens} tokens')
  assistant = tokenizer.encode(ASSISTANT)
  conversations = []
  taken = {}                  # doc name -> offsets used: a wrap-around takes a new window
  for c in range(num_conversations):
    results, sources = [], []
    for t in range(num_turns):
      i = c * num_turns + t
      for j in range(len(tools)):      # round robin; a file whose windows are all taken: the next
        doc = tools[(i + j) % len(tools)]
        span = len(ids_of(doc)) - tool_tokens + 1
        used = taken.setdefault(doc.name, set())
        if len(used) < span:
          break
      else:
        raise ValueError(f'split {split!r} has {sum(len(u) for u in taken.values())} '
                         f'distinct {tool_tokens}-token windows, fewer than the '
                         f'{num_conversations} x {num_turns} tool results')
      _, off = _window(ids_of(doc), tool_tokens, seed, 'tool', doc.name, i // len(tools))
      while off in used:      # a hash collision: the next free offset
        off = (off + 1) % span
      used.add(off)
      window = ids_of(doc)[off:off + tool_tokens]
      results.append(tuple(tokenizer.encode(TOOL_HEADER.format(turn=t + 1)) + window + assistant))
      sources.append(f'{doc.name}@{off}')
    conversations.append(Conversation(prefix, tuple(results), tuple(sources)))
  return conversations
