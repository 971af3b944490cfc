"""Byte-level BPE tokenizer: a thin wrapper over Hugging Face ``tokenizers``.

Byte-level means every string maps to tokens and back exactly (spaces, tabs, newlines, any
Unicode), which code and JSON need: their whitespace is content. Our own tokenizers fix the
special tokens: ``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2. A Hugging Face model
directory's ``tokenizer.json`` is loaded too (``Tokenizer.load(model_dir)``); its special ids
come from the directory's ``generation_config.json``, ``config.json`` and
``tokenizer_config.json``. ``encode`` never adds special tokens, and never produces them either:
the literal text ``<|eos|>`` inside a document is encoded as ordinary text.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Optional, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxspec.checks import check_int, is_int_in, nearest_existing, token_ids

PAD, BOS, EOS = '<|pad|>', '<|bos|>', '<|eos|>'
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 in this order.
MAX_VOCAB = 2 ** 24               # ids `train` learns at most (well past any model's vocabulary)


def check_save_path(path: str | os.PathLike[str]) -> pathlib.Path:
  """`path` if a tokenizer file can be written there: not a directory, and the first of its
  parents that exists is a directory (checked before training, which would be lost).

  Raises:
    ValueError: naming the path.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    raise ValueError(f'cannot save the tokenizer to {path}: a directory (give a file path, '
                     f'e.g. {path / "tokenizer.json"})')
  parent = nearest_existing(path.parent)
  if not parent.is_dir():
    raise ValueError(f'cannot save the tokenizer to {path}: {parent} is a file')
  return path


class Tokenizer:
  """BPE tokenizer: ours (pad/bos/eos at ids 0/1/2) or a Hugging Face model's."""

  def __init__(self, tok: tokenizers.Tokenizer, *, special_ids: Optional[dict] = None):
    """Wraps a ``tokenizers.Tokenizer``.

    special_ids: None for our convention (raises ValueError if the specials are not at 0/1/2),
      or {'pad': id | None, 'bos': id | None, 'eos': tuple of ids} for another model's.
    """
    if special_ids is None:
      for want, token in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != want:
          raise ValueError(f'special token {token!r} has id {got}, expected {want}')
      special_ids = {'pad': 0, 'bos': 1, 'eos': (2,)}
    tok.encode_special_tokens = True  # Treat '<|eos|>' written in a document as plain text.
    self._tok = tok
    self._special = special_ids
    self.source: Optional[pathlib.Path] = None   # the file `load` read (None: built in memory)

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learns BPE merges over ``texts`` (any iterable of str, consumed once).

    vocab_size: total size including the 3 specials and the 256 byte tokens, at most MAX_VOCAB;
    the result can be smaller when the texts hold too few distinct merges. Raises ValueError if
    vocab_size is not an int in [259, MAX_VOCAB] (the trainer reserves ~66 bytes per id up front:
    2**31 asked for 141 GB and aborted the process), or if texts is a str or bytes (it would
    train on its single characters).
    """
    vocab_size = check_int('vocab_size', vocab_size, 256 + len(SPECIAL_TOKENS))
    if vocab_size > MAX_VOCAB:
      raise ValueError(f'vocab_size must be <= {MAX_VOCAB} (2**24), got {vocab_size}')
    if isinstance(texts, (str, bytes)):
      raise ValueError(f'train takes an iterable of str texts, got a {type(texts).__name__}')
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
    """Writes the tokenizer as one JSON file at ``path``, creating parent directories.
    Raises ValueError naming ``path`` when it is a directory or cannot be written (a parent
    that is a file, no permission)."""
    path = check_save_path(path)
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      self._tok.save(str(path))
    except Exception as e:      # tokenizers raises a bare Exception without the path
      raise ValueError(f'cannot save the tokenizer to {path}: {e}') from None

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
    """Reads a file written by ``save``, or a Hugging Face model directory's tokenizer.

    path: a tokenizer.json, or a directory holding one (the file read becomes `source`). A file
    whose specials are not ours at 0/1/2 is read as a Hugging Face tokenizer when its directory
    has a config.json, generation_config.json or tokenizer_config.json naming the special
    tokens.

    Raises FileNotFoundError (missing) or ValueError (unreadable / not a tokenizer / wrong special
    ids), each naming ``path``.
    """
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / 'tokenizer.json'
    if not path.is_file():
      raise FileNotFoundError(f'tokenizer file not found: {path}')
    try:
      tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON.
      raise ValueError(f'corrupt tokenizer file {path}: {e}') from e
    ours = all(tok.token_to_id(t) == i for i, t in enumerate(SPECIAL_TOKENS))
    special = None
    if not ours and any((path.parent / f).is_file() for f in _HF_CONFIG_FILES):
      special = hf_special_ids(path.parent, tok)
      if special == {'pad': None, 'bos': None, 'eos': ()}:   # e.g. our own model's config.json
        special = None                                      # names none: not Hugging Face's
    if special is not None:
      loaded = cls(tok, special_ids=special)
    else:
      try:
        loaded = cls(tok)
      except ValueError as e:
        raise ValueError(f'tokenizer {path}: {e} (and no Hugging Face config beside it names '
                         'its special tokens: generation_config.json, config.json or '
                         'tokenizer_config.json)') from e
    loaded.source = path.absolute()
    return loaded

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` (no specials added). ``decode(encode(text)) == text`` for our
    byte-level BPE tokenizers; a Hugging Face tokenizer with a normalizer may change the text
    (Qwen2's NFC: 'e\\u0301' comes back as 'é').

    Raises ValueError when ``text`` is not a str, or holds a lone surrogate (not encodable as
    UTF-8: it has no bytes to tokenize)."""
    if not isinstance(text, str):
      raise ValueError(f'encode takes a str, got {type(text).__name__}')
    try:
      return self._tok.encode(text, add_special_tokens=False).ids
    except TypeError:                    # tokenizers' error for a str it cannot take as UTF-8
      text.encode('utf-8')               # raises UnicodeEncodeError (a ValueError) naming it
      raise

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """``[encode(t) for t in texts]``, run in parallel in Rust (uses all cores).

    Raises ValueError as `encode` does, naming the text's index; and for a str given as `texts`
    (it would be encoded character by character)."""
    if isinstance(texts, (str, bytes)):
      raise ValueError(f'encode_batch takes a sequence of str, got a {type(texts).__name__}')
    texts = list(texts)
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise ValueError(f'encode_batch takes str texts, got {type(text).__name__} at index {i}')
    try:
      encs = self._tok.encode_batch_fast(texts, add_special_tokens=False)
    except TypeError:                    # a lone surrogate somewhere: find and name it
      for i, text in enumerate(texts):
        try:
          text.encode('utf-8')
        except UnicodeEncodeError as e:
          raise ValueError(f'text {i} cannot be encoded as UTF-8: {e}') from None
      raise
    return [e.ids for e in encs]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of ``ids`` (ints in [0, vocab_size)); special ids render as their names, e.g. '<|eos|>'.

    A slice that cuts a multi-byte character yields U+FFFD for the partial bytes.

    Raises ValueError naming the first id that is not an int in [0, vocab_size) (it decoded to
    '' or, for 1.7, to id 1).
    """
    if not isinstance(ids, (list, tuple, range, str, bytes)) and getattr(ids, 'ndim', None) != 1:
      try:
        ids = list(ids)                  # a generator, a set of one id...: read once, in order
      except TypeError:                  # one id (5, np.array(5)) is not a sequence of them
        raise ValueError(f'ids must be a sequence of int token ids, got {ids!r}') from None
    return self._tok.decode(token_ids(ids, 'ids', self.vocab_size), skip_special_tokens=False)

  @property
  def vocab_size(self) -> int:
    """Number of ids, specials included (ids are 0 .. vocab_size-1)."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> Optional[int]:
    return self._special['pad']

  @property
  def bos_id(self) -> Optional[int]:
    return self._special['bos']

  @property
  def eos_id(self) -> Optional[int]:
    """The first end-of-sequence id (None when the model names none)."""
    return self._special['eos'][0] if self._special['eos'] else None

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a sequence (Llama 3.1 instruct has three); use as stop tokens."""
    return tuple(self._special['eos'])

  def vocabulary_difference(self, other: Tokenizer) -> Optional[str]:
    """None when ``other`` maps every token string to the same id as this tokenizer (so a
    draft's token ids mean the target's tokens), else a sentence naming the first difference."""
    mine = self._tok.get_vocab(with_added_tokens=True)
    theirs = other._tok.get_vocab(with_added_tokens=True)
    if mine == theirs:
      return None
    if len(mine) != len(theirs):
      return f'vocabularies of {len(mine)} and {len(theirs)} tokens'
    for token, i in sorted(mine.items(), key=lambda kv: kv[1]):
      if theirs.get(token) != i:
        return f'token {token!r} has id {i} in one and {theirs.get(token)} in the other'
    return 'vocabularies differ'

  def __repr__(self) -> str:
    return f'Tokenizer(vocab_size={self.vocab_size})'


_HF_CONFIG_FILES = ('generation_config.json', 'config.json', 'tokenizer_config.json')


def hf_special_ids(directory: pathlib.Path, tok: tokenizers.Tokenizer) -> dict:
  """Special ids of a Hugging Face model directory: {'pad': id or None, 'bos': id or None,
  'eos': tuple of ids}, from ``*_token_id`` in generation_config.json, then config.json (eos may
  be a list: every id is a stop token), else the ``*_token`` strings of tokenizer_config.json.
  Raises ValueError naming a file that is not valid JSON or a special token the tokenizer does
  not know."""
  found = {'pad': None, 'bos': None, 'eos': ()}
  for name in _HF_CONFIG_FILES:
    file = directory / name
    if not file.is_file():
      continue
    try:
      fields = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f'{file} is not valid JSON: {e}') from e
    if not isinstance(fields, dict):
      raise ValueError(f'{file} must hold a JSON object, got a {type(fields).__name__}')
    for key in found:
      if found[key] not in (None, ()):
        continue
      value = fields.get(f'{key}_token_id')
      if value is None and isinstance(fields.get(f'{key}_token'), (str, dict)):
        token = fields[f'{key}_token']
        token = token.get('content') if isinstance(token, dict) else token
        if not isinstance(token, str):       # {"foo": 1}, {"content": 5}: token_to_id's TypeError
          raise ValueError(f'{file}: {key}_token must be a string or an object with a string '
                           f'"content", got {fields[f"{key}_token"]!r}')
        value = tok.token_to_id(token)
        if value is None:
          raise ValueError(f'{file}: {key}_token {token!r} is not in the tokenizer')
      if value is not None:
        ids = value if key == 'eos' and isinstance(value, list) else [value]
        size = tok.get_vocab_size(with_added_tokens=True)
        if not ids or not all(is_int_in(i, 0, size - 1) for i in ids):
          raise ValueError(f'{file}: {key}_token_id must be a token id in [0, {size}) (or, for '
                           f'eos, a list of them), got {value!r}')
        found[key] = tuple(int(i) for i in ids) if key == 'eos' else int(ids[0])
  return found
