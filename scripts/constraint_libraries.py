"""How the chosen constraint engine (llguidance) compares with outlines-core on our tokenizer and
a real extraction schema: schema compile time and per-token mask time.

    pip install outlines-core   # not a dependency of jaxspec; only for this comparison
    python scripts/constraint_libraries.py

(xgrammar is not compared: its wheel requires torch, transformers and triton.)
"""

import argparse
import json
import time

import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
if __name__ == '__main__':   # --help before the optional import; no flags
  argparse.ArgumentParser(description=__doc__.split('\n\n')[0]).parse_args()

import numpy as np
try:
  import outlines_core
  from outlines_core.json_schema import build_regex_from_schema
except ImportError:
  sys.exit('FATAL: this comparison needs outlines-core, not a dependency of jaxspec: '
           'pip install outlines-core')
import tokenizers

from jaxspec.data import Tokenizer
from jaxspec.data.tool_calls import tool_episodes
from jaxspec.decoding.constraint import TokenConstraint
from jaxspec.hydration import record_schema, truth_record
from jaxspec.models import shipped


def byte_vocabulary(path):
  """outlines-core wants each token's bytes: undo byte-level BPE's byte -> unicode mapping."""
  printable = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
               + list(range(ord('®'), ord('ÿ') + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  vocab = {}
  for text, i in tokenizers.Tokenizer.from_file(str(path)).get_vocab().items():
    if i >= 3:  # specials
      vocab.setdefault(bytes(chars[c] for c in text), []).append(i)
  return outlines_core.Vocabulary(2, vocab)


def main():
  path = shipped('tokenizer.json')
  tok = Tokenizer.load(path)
  calls = tool_episodes(tok, 1, 5)[0].turns
  vocabulary = byte_vocabulary(path)
  for call in calls:
    schema = record_schema(call.value)
    ids = tok.encode(json.dumps(truth_record(call.value), separators=(',', ':')))
    start = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
    oc_build = time.perf_counter() - start
    guide, steps = outlines_core.Guide(index), []
    for t in ids:
      start = time.perf_counter()
      mask = np.zeros(4096, bool)
      mask[guide.get_tokens()] = True
      steps.append(time.perf_counter() - start)
      guide.advance(t)
    oc_step = np.median(steps)
    start = time.perf_counter()
    constraint = TokenConstraint.json_schema(schema, path, vocab_size=4096)
    ll_build, steps = time.perf_counter() - start, []
    for t in ids:
      start = time.perf_counter()
      assert constraint.allowed()[t]
      steps.append(time.perf_counter() - start)
      constraint.advance(t)
    print(f'{call.argument:40s} tokens={len(ids):3d}  '
          f'compile: llguidance {ll_build * 1e3:6.1f} ms, '
          f'outlines-core {oc_build * 1e3:6.1f} ms;  mask (median): llguidance '
          f'{np.median(steps) * 1e6:5.1f} us, outlines-core {oc_step * 1e6:5.1f} us')


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
