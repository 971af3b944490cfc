"""Trains the byte-level BPE tokenizer on the train split of json + code and reports its stats.

    python scripts/build_tokenizer.py --out assets/tokenizer.json --vocab_size 4096

Prints the vocabulary size, the training time, and mean UTF-8 bytes per token on each kind's val
split (higher = better compression).
"""

import argparse
import time

import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxspec.data import Tokenizer, documents
from jaxspec.data.corpus import KINDS
from jaxspec.data.tokenizer import check_save_path


def _mb(docs) -> float:
  return sum(len(d.text.encode('utf-8')) for d in docs) / 1e6


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='assets/tokenizer.json', help='where to write the JSON')
  parser.add_argument('--vocab_size', type=int, default=4096)
  args = parser.parse_args()
  try:
    check_save_path(args.out)
  except ValueError as err:
    sys.exit(f'FATAL: --out: {err}')

  for kind in KINDS:
    for split in ('train', 'val', 'test'):
      docs = documents(kind, split)
      print(f'{kind:4s} {split:5s}: {len(docs):4d} docs {_mb(docs):6.2f} MB')
  train_docs = [d for kind in KINDS for d in documents(kind, 'train')]
  start = time.perf_counter()
  tok = Tokenizer.train((d.text for d in train_docs), args.vocab_size)
  seconds = time.perf_counter() - start
  try:
    tok.save(args.out)
  except ValueError as err:
    sys.exit(f'FATAL: --out: {err}')
  print(f'trained on {len(train_docs)} docs ({_mb(train_docs):.1f} MB) in {seconds:.1f} s; '
        f'vocab_size={tok.vocab_size}; saved {args.out}')
  for kind in KINDS:
    texts = [d.text for d in documents(kind, 'val')]
    num_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    num_bytes = sum(len(t.encode('utf-8')) for t in texts)
    print(f'{kind} val: {num_bytes / num_tokens:.2f} bytes/token ({num_tokens} tokens)')


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
