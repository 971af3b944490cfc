"""The README's Python snippets run as written (so none rots): each ```python block is executed,
from the repository root, after a preamble that holds what the README's *Using the pieces*
section defines (the shipped pair, the tokenizer; a block defines anything else itself), with
its sizes cut where noted (`SHRINK`) to keep the suite fast; blocks that need more devices
than this process has are only compiled."""

import pathlib
import re

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'

PREAMBLE = """
from jaxspec.data import Tokenizer
from jaxspec.decoding import generate
from jaxspec.models import load_model, shipped
target, target_params = load_model(shipped('target'))
draft, draft_params = load_model(shipped('draft'))
tok = Tokenizer.load(shipped('tokenizer.json'))
"""

# (text in the block, smaller stand-in): sizes that only make the snippet slower here.
SHRINK = [('max_tokens=128', 'max_tokens=8'), ('max_new_tokens=200', 'max_new_tokens=8'),
          ('max_tokens=64', 'max_tokens=12'), ('max_new_tokens=64', 'max_new_tokens=12'),
          ('num_slots=8', 'num_slots=2'), ('k=8, k_policy', 'k=2, k_policy'),
          ('engine.warm_up()', 'engine.warm_up(cost_repeats=1, decode_rounds=1)'), ('num_slots=16', 'num_slots=2'),
          ('read()[:2000]', 'read()[:600]')]


def _blocks() -> list:
  text = README.read_text()
  return [(text[:m.start()].count('\n') + 1, m.group(1))
          for m in re.finditer(r'```python\n(.*?)```', text, re.S)]


def test_the_readme_has_python_snippets():
  assert len(_blocks()) >= 5


@pytest.mark.parametrize('line, code', [pytest.param(*b, id=f'line{b[0]}') for b in _blocks()])
def test_readme_python_snippet_runs(line, code):
  compile(code, f'README.md:{line}', 'exec')   # every block at least parses
  mesh = re.search(r'make_mesh\(data=(\d+), model=(\d+)\)', code)
  if mesh and int(mesh[1]) * int(mesh[2]) > jax.device_count():
    pytest.skip(f'needs {int(mesh[1]) * int(mesh[2])} devices (tests/test_parallel.py runs the '
                f'sharded path in an 8-device worker)')
  for old, new in SHRINK:
    code = code.replace(old, new)
  namespace: dict = {}
  exec(compile(PREAMBLE, 'preamble', 'exec'), namespace)   # pylint: disable=exec-used
  exec(compile(code, f'README.md:{line}', 'exec'), namespace)   # pylint: disable=exec-used
