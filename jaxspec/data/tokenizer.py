"""Byte-level BPE tokenizer: a thin wrapper over Hugging Face ``tokenizers``.

Byte-level means every string maps to tokens and back exactly (spaces, tabs, newlines, any
Unicode), which code and JSON need: their whitespace is content. Special tokens are fixed:
``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2. ``encode`` never adds them, and never produces
them either: the literal text ``<|eos|>`` inside a document is encoded as ordinary bytes.
"""

from __future__ import annotations

import os
import pathlib
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = '<|pad|>', '<|bos|>', '<|eos|>'
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 in this order.


class Tokenizer:
  """Byte-level BPE tokenizer with pad/bos/eos at ids 0/1/2."""

  def __init__(self, tok: tokenizers.Tokenizer):
    """Wraps a trained ``tokenizers.Tokenizer``; raises ValueError if its specials are not 0/1/2."""
    for want, token in enumerate(SPECIAL_TOKENS):
      got = tok.token_to_id(token)
      if got != want:
        raise ValueError(f'special token {token!r} has id {got}, expected {want}')
    tok.encode_special_tokens = True  # Treat '<|eos|>' written in a document as plain text.
    self._tok = tok

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learns BPE merges over ``texts`` (any iterable of str, consumed once).

    vocab_size: total size including the 3 specials and the 256 byte tokens; the result can be
    smaller when the texts hold too few distinct merges. Raises ValueError if vocab_size < 259.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
      raise ValueError(f'vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}')
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return cls(tok)

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes the tokenizer as one JSON file at ``path``, creating parent directories."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(path))

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
    """Reads a file written by ``save``.

    Raises FileNotFoundError (missing) or ValueError (unreadable / not a tokenizer / wrong special
    ids), each naming ``path``.
    """
    path = pathlib.Path(path)
    if not path.is_file():
      raise FileNotFoundError(f'tokenizer file not found: {path}')
    try:
      return cls(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON.
      raise ValueError(f'corrupt tokenizer file {path}: {e}') from e

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` (no specials added); ``decode(encode(text)) == text`` always."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """``[encode(t) for t in texts]``, run in parallel in Rust (uses all cores)."""
    encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
    return [e.ids for e in encs]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of ``ids`` (ints in [0, vocab_size)); special ids render as their names, e.g. '<|eos|>'.

    A slice that cuts a multi-byte character yields U+FFFD for the partial bytes.
    """
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  @property
  def vocab_size(self) -> int:
    """Number of ids, specials included (ids are 0 .. vocab_size-1)."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  def __repr__(self) -> str:
    return f'Tokenizer(vocab_size={self.vocab_size})'
