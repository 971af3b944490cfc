"""Token constraints: a JSON schema or regular expression turned into a per-step set of allowed
tokens, on the host.

The schema/grammar -> token automaton is llguidance's (guidance-ai; the constraint engine behind
llama.cpp's, vLLM's and SGLang's structured outputs). It was chosen over xgrammar and
outlines-core because it is the only one of the three that installs without torch, reads our
`tokenizers` byte-level BPE file directly, compiles a schema lazily (~1 ms; outlines-core builds
an index over the vocabulary, 270-470 ms per record schema here) and rolls back any number of
tokens, which speculative decoding needs; a mask over our 4096 tokens takes ~13 us
(scripts/constraint_libraries.py). Applying the mask to the logits is ours (`probabilities(...,
mask=)`), inside the jitted sampling step.
"""

from __future__ import annotations

import functools
import json
import pathlib

import llguidance
import tokenizers
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
import numpy as np

from jaxspec.checks import is_int_in
from jaxspec.data.tokenizer import hf_special_ids


def _first_line(message: str) -> str:
  """llguidance's reason in one line: its first line, and its 'error:' line when that comes
  later (a regex parse error puts the pattern between them)."""
  lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
  if not lines:
    return message
  cause = next((line for line in lines[1:] if line.startswith('error:')), None)
  return f'{lines[0]} {cause}' if cause else lines[0]


class ConstraintError(ValueError):
  """The constraint cannot continue: a bad schema, a token it forbids, or no allowed token."""


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(path: str, eos_id: int) -> llguidance.LLTokenizer:
  return llguidance.LLTokenizer(pathlib.Path(path).read_text(), eos_token=eos_id)


@functools.lru_cache(maxsize=4)
def _special_ids(path: str) -> frozenset:
  """Ids of the tokenizer's special tokens: tokenizer.json's `added_tokens` marked special, the
  pad / bos / eos ids the files beside it declare (`jaxspec.data.tokenizer.hf_special_ids`, as
  `Tokenizer.load` reads them), and those tokenizer_config.json's `added_tokens_decoder` marks
  special (as transformers reads it)."""
  path = pathlib.Path(path)
  data = json.loads(path.read_text())
  ids = {t.get('id') for t in data.get('added_tokens') or () if isinstance(t, dict) and
         t.get('special')}
  try:
    declared = hf_special_ids(path.parent, tokenizers.Tokenizer.from_file(str(path)))
    ids |= {declared['pad'], declared['bos'], *declared['eos']}
    fields = json.loads((path.parent / 'tokenizer_config.json').read_text())
    decoder = fields.get('added_tokens_decoder') if isinstance(fields, dict) else None
    if isinstance(decoder, dict):
      ids |= {int(i) for i, t in decoder.items()
              if str(i).isdigit() and isinstance(t, dict) and t.get('special')}
  except (OSError, ValueError):   # no tokenizer_config.json, or files Tokenizer.load names
    pass
  return frozenset(i for i in ids if isinstance(i, int))


class TokenConstraint:
  """The tokens allowed after the tokens consumed so far, for one sequence.

  Build with `json_schema` or `regex`. The end of the text is the EOS token: it is allowed
  exactly when the text so far is complete, and once consumed only EOS is allowed.

  Attributes:
    vocab_size: V of the masks (the model's vocabulary; may exceed the tokenizer's).
    eos_id: the stop token.
    consumed: tokens consumed and not rolled back (0: fresh).
  """

  def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_id: int,
               tokenizer_vocab: int):
    if matcher.is_error():
      raise ConstraintError(f'invalid constraint: {_first_line(matcher.get_error())}')
    self._m = matcher
    self._tokenizer_vocab = tokenizer_vocab   # ids past it (model padding) are never allowed
    self.vocab_size = vocab_size
    self.eos_id = eos_id
    self._bits = allocate_token_bitmask(1, tokenizer_vocab)
    self._eos_consumed = 0      # EOS tokens consumed after the end (speculative padding)
    self.consumed = 0           # tokens consumed (advance) less those rolled back

  @classmethod
  def json_schema(cls, schema: dict, tokenizer_path, *, vocab_size: int, eos_id: int = 2,
                  compact: bool = True) -> 'TokenConstraint':
    """JSON text valid under `schema` (a JSON-schema dict).

    Args:
      tokenizer_path: the `tokenizers` JSON file the model was trained with.
      vocab_size: the model's V.
      compact: no whitespace between tokens of the JSON (else any JSON whitespace).
    Raises:
      ConstraintError: the schema is not JSON (a set in it, nested too deep), not valid JSON
        schema, or uses a keyword llguidance lacks; eos_id outside [0, vocab_size) or not one
        of the tokenizer's special tokens (`added_tokens` marked special, or special in a
        tokenizer_config.json beside it).
    """
    try:
      text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:   # a set, NaN keys, nesting too deep
      raise ConstraintError(f'the schema is not JSON: {type(e).__name__}: '
                            f'{str(e)[:200]}') from None
    try:
      grammar = llguidance.LLMatcher.grammar_from_json_schema(
          text, overrides={'whitespace_flexible': not compact})
    except ValueError as e:
      raise ConstraintError(f'invalid JSON schema {str(schema)[:200]}: {e}') from e
    return cls._build(grammar, tokenizer_path, vocab_size, eos_id)

  @classmethod
  def regex(cls, pattern: str, tokenizer_path, *, vocab_size: int,
            eos_id: int = 2) -> 'TokenConstraint':
    """Text matching the regular expression `pattern` (whole text). Raises ConstraintError
    (also for the eos_id cases of `json_schema`)."""
    return cls._build(llguidance.LLMatcher.grammar_from_regex(pattern), tokenizer_path,
                      vocab_size, eos_id)

  @classmethod
  def _build(cls, grammar, tokenizer_path, vocab_size, eos_id):
    if not is_int_in(vocab_size, 1, 2 ** 31 - 1) or not is_int_in(eos_id, 0, vocab_size - 1):
      raise ConstraintError(f'vocab_size must be an int >= 1 and eos_id an int in [0, '
                            f'vocab_size), got vocab_size={vocab_size!r}, eos_id={eos_id!r}')
    special = _special_ids(str(tokenizer_path))
    if eos_id not in special:    # an ordinary token would be text and the end at once
      raise ConstraintError(f'eos_id={eos_id} is not a special token of {tokenizer_path} '
                            f'(its special ids: {sorted(special)[:16]})')
    tok = _ll_tokenizer(str(tokenizer_path), int(eos_id))
    if tok.vocab_size > vocab_size:
      raise ConstraintError(f'tokenizer vocabulary ({tok.vocab_size}) exceeds the model '
                            f'vocabulary ({vocab_size})')
    return cls(llguidance.LLMatcher(tok, grammar, log_level=0), vocab_size, eos_id,
               tok.vocab_size)

  @property
  def done(self) -> bool:
    """True once EOS was consumed (or the grammar admits nothing but EOS and ended)."""
    return self._m.is_stopped() and not self._m.is_error()

  def allowed(self) -> np.ndarray:
    """[V] bool, the tokens allowed next.

    Raises:
      ConstraintError: the matcher is in an error state, or allows no token at all (the schema
        cannot be continued from here).
    """
    if self._m.is_error():
      raise ConstraintError(f'constraint failed: {_first_line(self._m.get_error())}')
    if self.done:
      mask = np.zeros(self.vocab_size, bool)
      mask[self.eos_id] = True
      return mask
    fill_next_token_bitmask(self._m, self._bits, 0)
    if self._m.is_error():      # a dead end: llguidance then allows only EOS, which is not valid
      raise ConstraintError('the constraint allows no token here: the schema cannot be '
                            f'continued with this vocabulary ({_first_line(self._m.get_error())})')
    mask = np.zeros(self.vocab_size, bool)
    mask[:self._tokenizer_vocab] = np.unpackbits(self._bits[0].view(np.uint8),
                                                 bitorder='little')[:self._tokenizer_vocab]
    if not mask.any():
      raise ConstraintError('the constraint allows no token here: the schema cannot be '
                            'continued with this vocabulary')
    return mask

  def advance(self, token: int) -> None:
    """Consume `token`. Raises ConstraintError if the constraint forbids it, or if it is not
    an int in [0, vocab_size)."""
    if not is_int_in(token, 0, self.vocab_size - 1):
      raise ConstraintError(f'token must be an int in [0, {self.vocab_size}), got {token!r}')
    token = int(token)
    self.consumed += 1
    if self.done:
      if token != self.eos_id:
        raise ConstraintError(f'token {token} after the end of the constrained text')
      self._eos_consumed += 1
      return
    if not self._m.consume_token(token):
      raise ConstraintError(f'token {token} is not allowed: {_first_line(self._m.get_error())}')

  def rollback(self, num_tokens: int) -> None:
    """Forget the last `num_tokens` consumed tokens (rejected speculative tokens). Raises
    ConstraintError when num_tokens is not an int in [0, tokens consumed]."""
    if not is_int_in(num_tokens, 0, self.consumed):
      raise ConstraintError(f'cannot roll back {num_tokens!r} tokens: {self.consumed} consumed')
    num_tokens = int(num_tokens)
    self.consumed -= num_tokens
    extra = min(num_tokens, self._eos_consumed)
    self._eos_consumed -= extra
    if num_tokens - extra and not self._m.rollback(num_tokens - extra):
      raise ConstraintError(f'cannot roll back {num_tokens} tokens: '
                            f'{_first_line(self._m.get_error())}')

