"""The XLA flags the tests compile under, and CI's smoke runs after them (one place for both).

    python tests/xla_flags.py        # prints $XLA_FLAGS with them added (.ci/run exports it)

A test runs each program a few times on tiny shapes, so compiling is most of its time. Two
settings make XLA:CPU compile faster without changing what the tests compare (greedy equality,
bit-for-bit verify against decode, kernels against their references: both sides compile under
the same flags within a run):

- `--xla_backend_optimization_level=0`: LLVM's optimisations off (tests/test_engine_rows.py,
  test_engine_drafters.py and test_paged_cache.py: 291 s at the default level, 215 s at 0, two
  workers).
- `--xla_cpu_use_fusion_emitters=false`: fusions through XLA:CPU's older loop emitters, not
  its MLIR fusion emitters (jax 0.10.2, 2 cores, from an empty cache: the suite took 632 s
  under both, `python -m pytest`, against 1005 s at -O0 alone,
  `XLA_FLAGS=--xla_backend_optimization_level=0 python -m pytest`). Added only where the
  installed jaxlib defines the flag (XLA stops at an unknown one). A gain at -O0 only: at XLA's
  default level the README's goodput engine (*Drafters and adaptive K*: 8 slots, K = 0..8) took
  163 s in `warm_up()` (`time.perf_counter()` around it) against 146 s without the flag, and its
  decode rounds (`engine.step_costs`) were 10-20 % slower (2026-12-07), so the experiments keep
  XLA's defaults.

Flags that already name a level are left as they are: a run at a chosen level (e.g. checking
exactness at XLA's default, level 3) compiles as it would outside the tests; a fusion-emitter
setting already named is kept.
"""

import importlib.util
import mmap
import os
import pathlib

LEVEL = '--xla_backend_optimization_level=0'
FUSION = '--xla_cpu_use_fusion_emitters=false'


def xla_defines(name: str) -> bool:
  """Whether the installed jaxlib's libraries hold the flag name `name` (XLA registers each
  flag by its name, so a jaxlib without it would stop at it). False without jaxlib."""
  spec = importlib.util.find_spec('jaxlib')
  if spec is None or not spec.submodule_search_locations:
    return False
  needle = name.encode()
  for folder in spec.submodule_search_locations:
    for lib in sorted(pathlib.Path(folder).glob('*.so*')):
      with open(lib, 'rb') as f:
        if os.fstat(f.fileno()).st_size == 0:
          continue
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
          if data.find(needle) >= 0:
            return True
  return False


def _name(flag: str) -> str:
  """The name of one XLA_FLAGS entry ('--xla_foo=1' -> 'xla_foo')."""
  return flag.lstrip('-').split('=', 1)[0]


LEVEL_NAME, FUSION_NAME = NAMES = (_name(LEVEL), _name(FUSION))


def with_test_flags(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) with the tests' compile settings added, unless it names a
  level already (then unchanged); a fusion-emitter setting it names is kept, not overridden."""
  named = {_name(f) for f in flags.split()}
  if LEVEL_NAME in named:
    return flags
  extra = [LEVEL] + ([FUSION] if FUSION_NAME not in named and xla_defines(FUSION_NAME) else [])
  return ' '.join([flags.strip()] + extra).strip()


def compile_settings(flags: str) -> list:
  """Of an XLA_FLAGS value, the flags that set how programs compile (the ones above, the last of
  each name, which XLA takes): what a test's subprocesses keep, without a device count or a dump
  folder, so that they compile as the test process does and share its compilation cache."""
  kept = {_name(flag): flag for flag in flags.split() if _name(flag) in NAMES}
  return [kept[name] for name in NAMES if name in kept]


if __name__ == '__main__':
  print(with_test_flags(os.environ.get('XLA_FLAGS', '')))
