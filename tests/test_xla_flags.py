"""The tests' compile flags (tests/xla_flags.py): added unless a level is named, only flags the
installed XLA accepts, and what a test's subprocesses keep of them."""

import os
import subprocess
import sys

import xla_flags
from xla_flags import FUSION, LEVEL, compile_settings, with_test_flags, xla_defines


def test_flags_without_a_level_get_the_test_settings_after_their_own():
  fusion = [FUSION] if xla_defines('xla_cpu_use_fusion_emitters') else []
  assert with_test_flags('').split() == [LEVEL] + fusion
  assert with_test_flags(' --xla_dump_to=/tmp/d ').split() == \
      ['--xla_dump_to=/tmp/d', LEVEL] + fusion


def test_flags_that_name_a_level_are_kept_as_they_are():
  for flags in ('--xla_backend_optimization_level=3',
                '--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=2'):
    assert with_test_flags(flags) == flags


def test_a_fusion_setting_named_without_a_level_is_kept():
  for flags in ('--xla_cpu_use_fusion_emitters=true', FUSION):
    assert with_test_flags(flags).split() == [flags, LEVEL]


def test_a_flag_whose_value_contains_a_setting_name_is_not_that_setting():
  dump = '--xla_dump_to=/tmp/xla_backend_optimization_level_dumps'
  assert with_test_flags(dump).split()[:2] == [dump, LEVEL]
  assert compile_settings(f'{dump} --xla_cpu_use_fusion_emitters_x=1') == []


def test_the_fusion_flag_is_added_only_where_jaxlib_defines_it(monkeypatch):
  monkeypatch.setattr(xla_flags, 'xla_defines', lambda name: False)
  assert with_test_flags('') == LEVEL
  monkeypatch.setattr(xla_flags, 'xla_defines', lambda name: True)
  assert with_test_flags('') == f'{LEVEL} {FUSION}'


def test_xla_defines_finds_a_real_flag_and_not_a_made_up_one():
  assert xla_defines('xla_backend_optimization_level')
  assert xla_defines('xla_force_host_platform_device_count')
  assert not xla_defines('xla_jaxspec_no_such_flag_' + 'x' * 8)


def test_subprocesses_keep_the_last_compile_settings_and_nothing_else():
  flags = (f'--xla_backend_optimization_level=1 --xla_force_host_platform_device_count=8 {LEVEL} '
           f'--xla_dump_to=/tmp/d {FUSION}')
  assert compile_settings(flags) == [LEVEL, FUSION]
  assert compile_settings('--xla_force_host_platform_device_count=8') == []


def test_xla_accepts_the_flags_it_is_given():
  """A backend starts and runs a program under them (XLA stops at a flag it does not know)."""
  env = {**os.environ, 'XLA_FLAGS': with_test_flags(''), 'JAX_PLATFORMS': 'cpu'}
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  code = 'import jax, jax.numpy as jnp; print(int(jax.jit(lambda x: x * 3)(jnp.int32(7))))'
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0 and proc.stdout.strip() == '21', proc.stderr[-2000:]


def test_the_script_prints_the_environment_flags_with_the_settings():
  env = {**os.environ, 'XLA_FLAGS': '--xla_dump_to=/tmp/d'}
  proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), 'xla_flags.py')],
                        env=env, capture_output=True, text=True, timeout=60, check=True)
  assert proc.stdout.strip() == with_test_flags('--xla_dump_to=/tmp/d')
