"""Small-model extraction: a tool result in, a record validated against its schema out.

The model reads the raw tool result and writes the record under `TokenConstraint` (the record
schema of that result, see `schema.record_schema`), so the text always parses and validates
unless it runs out of tokens. Attempt 0 is greedy; each retry samples at `retry_temperature` with
a new seed. An output that is cut off, does not parse or does not validate (checked with
`jsonschema`, also for unconstrained outputs) counts as a failed attempt; after the last retry
the extraction fails and the caller falls back to the raw tool result.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional, Sequence

import jsonschema
import numpy as np

from jaxspec.checks import check_int, check_seed
from jaxspec.data.tool_calls import ToolCall
from jaxspec.data.tokenizer import Tokenizer
from jaxspec.decoding.constrained import constrained_generate
from jaxspec.decoding.constraint import TokenConstraint
from jaxspec.decoding.sampling import SamplingParams
from jaxspec.hydration.schema import record_schema, truth_record


@dataclasses.dataclass
class Extraction:
  """Outcome of extracting one tool result.

  Attributes:
    record: the validated record, or None when every attempt failed.
    attempts: attempts made (1 + retries used).
    seconds: wall time of all attempts.
    new_tokens: tokens generated over all attempts.
    text: the last attempt's output text.
  """

  record: Optional[dict]
  attempts: int
  seconds: float
  new_tokens: int = 0
  text: str = ''


class OracleExtractor:
  """Reads the record straight from the parsed result: isolates the pipeline's context savings
  from a model's extraction quality."""

  def __call__(self, turn: ToolCall) -> Extraction:
    start = time.perf_counter()
    record = truth_record(turn.value)
    return Extraction(record, 1, time.perf_counter() - start)


class ModelExtractor:
  """Extraction by a (small) model under the record schema, with retries.

  Args:
    config, params: the extracting model; with draft/draft_params/k it decodes speculatively
      (same constraint on both models).
    tokenizer, tokenizer_path: the model's tokenizer and its `tokenizers` JSON file.
    max_new_tokens: per attempt.
    retries: extra attempts after the first (>= 0).
    constrained: False decodes without the schema (an ablation: the output must still parse and
      validate, taking the first JSON value of the text).
    demos: tool calls shown before the result, each followed by its true record (few-shot).
    seed: a 64-bit int; attempt a of call c samples with seed + 1000 c + a (mod 2**63).
  Raises:
    ValueError: retries not an int >= 0, max_new_tokens not an int >= 1, a seed that is not a
      64-bit int, constrained not a bool, a retry_temperature SamplingParams refuses.
  """

  def __init__(self, config, params, tokenizer: Tokenizer, tokenizer_path, *,
               max_new_tokens: int = 192, retries: int = 2, retry_temperature: float = 1.0,
               constrained: bool = True, demos: Sequence[ToolCall] = (), draft=None,
               draft_params=None, k=None, seed: int = 0):
    retries = check_int('retries', retries, 0)
    max_new_tokens = check_int('max_new_tokens', max_new_tokens, 1)
    seed = check_seed(seed)
    if not isinstance(constrained, (bool, np.bool_)):
      raise ValueError(f'constrained must be True or False, got {constrained!r}')
    self.config, self.params = config, params
    self.tokenizer, self.tokenizer_path = tokenizer, tokenizer_path
    self.max_new_tokens, self.retries = max_new_tokens, retries
    self.retry_sampling = SamplingParams(retry_temperature)
    self.constrained = constrained
    demos = list(demos)
    bad = next((d for d in demos if not isinstance(d, ToolCall)), None)
    if bad is not None:
      raise ValueError(f'demos must be ToolCalls, got {type(bad).__name__} {bad!r:.80}')
    self.demo_text = ''.join(d.result + '\n' + json.dumps(truth_record(d.value),
                                                          separators=(',', ':')) + '\n\n'
                             for d in demos)
    self.spec = dict(draft=draft, draft_params=draft_params, k=k)
    self.seed = seed
    self.calls = 0

  def prompt(self, turn: ToolCall) -> list[int]:
    """The model's input: the demonstrations, the raw tool result, a newline; the record
    follows."""
    return self.tokenizer.encode(self.demo_text + turn.result + '\n')

  def __call__(self, turn: ToolCall) -> Extraction:
    schema = record_schema(turn.value)
    prompt = self.prompt(turn)
    start, new_tokens, text = time.perf_counter(), 0, ''
    self.calls += 1
    for attempt in range(1 + self.retries):
      constraint = None
      if self.constrained:
        constraint = TokenConstraint.json_schema(schema, self.tokenizer_path,
                                                 vocab_size=self.config.vocab_size,
                                                 eos_id=self.tokenizer.eos_id)
      out = constrained_generate(
          self.config, self.params, prompt, constraint, max_new_tokens=self.max_new_tokens,
          stop_token=self.tokenizer.eos_id,
          sampling=SamplingParams() if attempt == 0 else self.retry_sampling,
          seed=(self.seed + 1000 * self.calls + attempt) % 2 ** 63, **self.spec)
      new_tokens += len(out.tokens)
      body = out.tokens[:-1] if out.finished else out.tokens
      # Unconstrained, a model whose embedding is padded past the tokenizer may emit an id it
      # has no text for: it reads as nothing (and the record as malformed), not as an error.
      text = self.tokenizer.decode([t for t in body if t < self.tokenizer.vocab_size])
      record = _parse(text, schema, complete=out.finished or not self.constrained)
      if record is not None:
        return Extraction(record, attempt + 1, time.perf_counter() - start, new_tokens, text)
    return Extraction(None, 1 + self.retries, time.perf_counter() - start, new_tokens, text)


def _parse(text: str, schema: dict, complete: bool) -> Optional[dict]:
  """The JSON value at the start of `text` if it validates against `schema`, else None."""
  if not complete:
    return None
  try:
    value, _ = json.JSONDecoder().raw_decode(text.lstrip())
  except json.JSONDecodeError:
    return None
  return value if jsonschema.Draft202012Validator(schema).is_valid(value) else None
