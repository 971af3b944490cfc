"""Token streams and random training windows for language-model training.

A stream is every document of a split tokenized and joined with ``eos``::

    doc_0 <|eos|> doc_1 <|eos|> ... doc_n <|eos|>

and a batch is ``batch`` windows of ``seq_len + 1`` tokens at uniform random offsets (inputs are
``w[:, :-1]``, targets ``w[:, 1:]``). Nothing is cached to disk; tokenizing the whole train split
(~48 MB, ~12M tokens at vocab 4096) takes 10-15 s on 2 cores.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from jaxspec.checks import check_int, check_seed
from jaxspec.data import corpus
from jaxspec.data.tokenizer import Tokenizer

_ENCODE_CHUNK = 64  # Documents per encode_batch call (bounds peak memory of the id lists).


def _as_kinds(kinds: str | Sequence[str]) -> tuple[str, ...]:
  kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
  if not kinds:
    raise ValueError('kinds must name at least one corpus kind, got none')
  return kinds


def _stream(docs: Sequence[corpus.Document], tokenizer: Tokenizer) -> np.ndarray:
  if tokenizer.eos_id is None:
    raise ValueError(f'the tokenizer {tokenizer.source} names no end-of-sequence id, which the '
                     f'token stream puts after each document (a Hugging Face tokenizer: give '
                     f'eos_token_id in generation_config.json or config.json beside it)')
  eos = np.array([tokenizer.eos_id], np.int32)
  parts = []
  for i in range(0, len(docs), _ENCODE_CHUNK):
    for ids in tokenizer.encode_batch([d.text for d in docs[i:i + _ENCODE_CHUNK]]):
      parts += [np.asarray(ids, np.int32), eos]
  return np.concatenate(parts) if parts else np.zeros([0], np.int32)


def _max_docs(max_docs):
  """None, or an int >= 1 (-1 kept all but the last document, 0 none): ValueError otherwise."""
  return None if max_docs is None else check_int('max_docs', max_docs, 1)


def token_stream(kinds: str | Sequence[str], split: str, tokenizer: Tokenizer,
                 max_docs: int | None = None) -> np.ndarray:
  """All documents of ``kinds`` in ``split``, tokenized, each followed by ``eos``.

  kinds: 'code', 'json' or a sequence of them; documents come kind by kind, each kind in name
  order. max_docs: keep only the first ``max_docs`` documents of each kind (None = all).
  Returns [N] int32. Raises ValueError for an unknown kind or split, an empty ``kinds``,
  max_docs not None or an int >= 1, or a tokenizer without an eos id.
  """
  max_docs = _max_docs(max_docs)
  docs = []
  for kind in _as_kinds(kinds):
    docs += corpus.documents(kind, split)[:max_docs]
  return _stream(docs, tokenizer)


def train_mixture(tokenizer: Tokenizer, split: str = 'train', max_docs: int | None = None,
                  seed: int = 0) -> np.ndarray:
  """json and code documents of ``split`` interleaved document by document, each + ``eos``.

  The order is a shuffle hashed from (seed, kind, name), so any long slice holds both kinds in
  about their corpus proportion (by documents: ~2 json files per code file; by bytes ~5:1).
  max_docs: keep the first ``max_docs`` documents of each kind (name order) before shuffling.
  Returns [N] int32. Raises ValueError for an unknown split, max_docs not None or an int >= 1,
  or a seed that is not a 64-bit int.
  """
  max_docs = _max_docs(max_docs)
  seed = check_seed(seed)
  docs = [d for k in corpus.KINDS for d in corpus.documents(k, split)[:max_docs]]
  def key(d):
    return hashlib.sha256(f'{seed}:{d.kind}:{d.name}'.encode()).digest()
  return _stream(sorted(docs, key=key), tokenizer)


def random_windows(tokens: np.ndarray, batch: int, seq_len: int,
                   rng: np.random.Generator) -> np.ndarray:
  """``batch`` windows of ``seq_len + 1`` consecutive tokens at uniform random starts.

  tokens: [N] integer ids, N >= seq_len + 1. Returns [batch, seq_len + 1] int32; windows may
  cross document boundaries (the ``eos`` between documents is a normal training target).
  Raises ValueError if batch or seq_len is not an int >= 1, rng not a numpy Generator, the
  stream is too short or its ids are not integers (a float array would be truncated to ids
  silently).
  """
  tokens = np.asarray(tokens)
  if tokens.dtype == np.bool_ or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f'tokens must be an integer array of ids, got dtype {tokens.dtype}')
  batch, seq_len = check_int('batch', batch, 1), check_int('seq_len', seq_len, 1)
  if not isinstance(rng, np.random.Generator):
    raise ValueError(f'rng must be a numpy Generator (np.random.default_rng(seed)), got {rng!r}')
  if tokens.ndim != 1 or tokens.shape[0] < seq_len + 1:
    raise ValueError(f'tokens must be 1-D with >= {seq_len + 1} ids, got shape {tokens.shape}')
  starts = rng.integers(0, tokens.shape[0] - seq_len, size=batch)
  return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
