"""Shared fixtures: a tiny target and drafts that agree with it to different degrees."""

import gc
import os
import shutil
import tempfile
import warnings

import jax
import jax.numpy as jnp
import pytest

from xla_flags import with_test_flags

# XLA:CPU compiles the tests' programs with LLVM's optimisations off and through its older
# fusion emitters (tests/xla_flags.py: compiling is most of a test's time; the full suite took
# 10:31 against 16:44 at -O0 alone, two workers, 2026-12-07). What the tests compare runs under
# one set of flags within a run (.ci/run exports the same for its smoke runs). The workers and
# subprocesses inherit them through XLA_FLAGS (read when a backend starts, after this import);
# flags that already name a level are kept as they are.
os.environ['XLA_FLAGS'] = with_test_flags(os.environ.get('XLA_FLAGS', ''))

# One XLA compilation cache for the whole test run, shared by the xdist workers and the
# subprocesses some tests start (CLI runs, the 8-device worker): most of an engine test's time is
# compiling steps (model shapes, K, row buckets) that other tests compile too
# (tests/test_engine_rows.py alone: 127 s without the cache, 93 s with it from empty, 35 s with
# it full). The run's first conftest import (the controller) makes the folder and names it in
# JAX_COMPILATION_CACHE_DIR, which the workers and subprocesses inherit and read when they import
# jax; JAXSPEC_TEST_XLA_CACHE=DIR keeps one folder across runs instead (entries are keyed by the
# program, the compile options and the jax version: a changed step compiles anew). A
# JAX_COMPILATION_CACHE_DIR already set (e.g. by .ci/run, for the smoke runs after the tests)
# is left to rule. Two processes compiling one program at once may both write its entry (JAX's
# unbounded cache takes no lock): a reader of a half-written entry warns and compiles anew.
_made_cache = None
if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
  _kept = os.environ.get('JAXSPEC_TEST_XLA_CACHE')
  if not _kept:
    _made_cache = tempfile.mkdtemp(prefix='jaxspec-xla-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = os.path.abspath(_kept or _made_cache)
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
  jax.config.update('jax_persistent_cache_min_compile_time_secs',
                    float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))

import cli_server
from jaxspec import executables
from jaxspec.models import ModelConfig
from jaxspec.training import init_params


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  """Removes the run's compilation cache folder (the one this process made, if any)."""
  if _made_cache is not None:
    shutil.rmtree(_made_cache, ignore_errors=True)


@pytest.fixture(scope='session')
def cli():
  """`run(args, cwd=ROOT, timeout=120)`: `python ARGS` from a process that imported jax and
  jaxspec once (tests/cli_server.py), a `subprocess.CompletedProcess` with text stdout/stderr;
  for runs in the test process's environment as of this fixture's setup, before any test body
  (a test that sets variables for its run starts its own subprocess)."""
  server = cli_server.CliServer()
  yield server.run
  server.close()


@pytest.fixture
def memory_mappings():
  """`jaxspec.executables.memory_mappings`; skips the test off Linux (no /proc)."""
  if executables.memory_mappings() is None:
    pytest.skip('needs /proc/PID/maps and /proc/sys/vm/max_map_count (Linux)')
  return executables.memory_mappings


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_executables():
  """Drop JAX's compiled executables after each test file.

  Every XLA CPU executable holds memory mappings (~6 for a one-op function, hundreds for an
  engine step) and JAX's jit caches keep them for the process's life, so a test worker running
  most of the suite passes the kernel's vm.max_map_count (65,530 by default) and XLA's next
  compile dies with SIGSEGV or SIGABRT (seen at ~73 % of a one-process run). The sweep runner
  clears them between cases too, and an Engine built past half the limit clears them first
  (`jaxspec.executables.release_near_limit`). Warns if one file alone held more than
  `executables.NEAR_LIMIT` of the limit (half); fails the file, naming the count, if the
  mappings stay above that after clearing.
  """
  yield
  counts = executables.memory_mappings()
  if counts and counts[0] > counts[1] * executables.NEAR_LIMIT:
    warnings.warn(f'{counts[0]} memory mappings at the end of this file (limit {counts[1]}, '
                  f'{executables.MAX_MAP_COUNT}): one file near the limit can crash XLA mid-file')
  gc.collect()
  jax.clear_caches()
  counts = executables.memory_mappings()
  if counts and counts[0] > counts[1] * executables.NEAR_LIMIT:
    pytest.fail(f'{counts[0]} memory mappings held after clearing JAX caches (limit {counts[1]}, '
                f'{executables.MAX_MAP_COUNT}): something keeps compiled executables alive '
                'across test files')


@pytest.fixture(scope='session')
def tiny():
  """(config, params) of a tiny random target (V = 64). Projections are scaled up 3x so its
  greedy output wanders over the vocabulary instead of repeating one token. Exact-verify numerics,
  so that verification rounds bit for bit like decode (see ModelConfig.exact_verify)."""
  config = ModelConfig.from_name('test-tiny', exact_verify=True)
  params = jax.tree_util.tree_map_with_path(
      lambda path, w: w * 3.0 if 'kernel' in jax.tree_util.keystr(path) else w,
      init_params(config, 0))
  return config, params


def perturbed(params, scale: float, seed: int):
  """params + scale * N(0, |w|) noise: a draft that agrees with the target only partly."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [w + scale * jnp.std(w) * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(tree, noisy)


@pytest.fixture(scope='session')
def tiny_draft(tiny):
  """(config, params): the tiny target with noise added, so α is strictly between 0 and 1."""
  config, params = tiny
  return config, perturbed(params, 0.02, 1)
