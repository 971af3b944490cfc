"""Bad input gets a clear error naming the value, never a silent wrong result."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.checks import check_int, is_int_in
from jaxspec.decoding import generate
from jaxspec.models import ModelConfig


def test_prompt_longer_than_context(tiny):
  config, params = tiny
  prompt = [5] * (config.max_seq_len - 10)
  with pytest.raises(ValueError, match=rf'prompt 0 of {len(prompt)} tokens .* exceeds the context '
                                       rf'of {config.max_seq_len}'):
    generate(config, params, [prompt], max_new_tokens=20)


def test_speculation_slack_counts_against_the_context(tiny):
  config, params = tiny
  prompt = [5] * (config.max_seq_len - 24)
  generate(config, params, [prompt], max_new_tokens=20)           # fits without a draft
  with pytest.raises(ValueError, match='exceeds the context'):
    generate(config, params, [prompt], max_new_tokens=20, draft=config, draft_params=params, k=8)


@pytest.mark.parametrize('k', [0, -1, 17, 2.5, True, '2'])
def test_k_out_of_range(tiny, k):
  config, params = tiny
  with pytest.raises(ValueError, match=rf'K must be an int in \[1, 16\], got {k!r}'):
    generate(config, params, [[1, 2, 3]], max_new_tokens=4, draft=config, draft_params=params, k=k)


def test_integer_checks_take_numpy_integers_and_refuse_the_rest():
  for value in (3, np.int64(3), np.uint8(3), np.array(3), jnp.int32(3)):
    assert check_int('n', value, 1) == 3 and type(check_int('n', value, 1)) is int
  for value in (True, np.bool_(True), jnp.array(True), 3.0, '3', None, np.array([3])):
    with pytest.raises(ValueError, match=rf'n must be an int >= 1, got {re.escape(repr(value))}'):
      check_int('n', value, 1)
  with pytest.raises(ValueError, match='n must be an int >= 1, got 0'):
    check_int('n', 0, 1)
  assert check_int('n', -5) == -5 and is_int_in(np.int16(4), 1, 4) and not is_int_in(5, 1, 4)


def test_draft_vocabulary_must_match(tiny):
  config, params = tiny
  other = dataclasses.replace(config, vocab_size=65)
  with pytest.raises(ValueError, match=r'draft vocabulary \(65\) differs from the target '
                                       r'vocabulary \(64\)'):
    generate(config, params, [[1, 2]], max_new_tokens=4, draft=other, draft_params=params, k=2)


@pytest.mark.parametrize('kwargs, match', [
    (dict(max_new_tokens=0), 'max_new_tokens must be an int >= 1, got 0'),
    (dict(max_new_tokens=4, stop_tokens=[64]), 'stop token id 64 outside'),
    (dict(max_new_tokens=4, stop_tokens=[2.7]), 'stop token ids must be ints, got 2.7'),
    (dict(max_new_tokens=4, stop_tokens=['5']), "stop token ids must be ints, got '5'"),
    (dict(max_new_tokens=4, stop_tokens=[3, True]), 'stop token ids must be ints, got True'),
])
def test_bad_generation_arguments(tiny, kwargs, match):
  config, params = tiny
  with pytest.raises(ValueError, match=match):
    generate(config, params, [[1, 2]], **kwargs)


def test_bad_prompts(tiny):
  config, params = tiny
  with pytest.raises(ValueError, match='prompt 1 is empty'):
    generate(config, params, [[1], []], max_new_tokens=2)
  with pytest.raises(ValueError, match='token id 99 outside the vocabulary'):
    generate(config, params, [[1, 99]], max_new_tokens=2)
  with pytest.raises(ValueError, match='prompt 0 holds the bool True, not a token id'):
    generate(config, params, [[1, True]], max_new_tokens=2)


def test_bad_model_config():
  with pytest.raises(ValueError, match='num_heads=6 is not a multiple of num_kv_heads=4'):
    ModelConfig.from_name('test-tiny', num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match="unknown model preset 'nope'"):
    ModelConfig.from_name('nope')


def test_unknown_config_field_fails_loudly(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.run', '--config=configs/speculative.py:smoke',
       '--config.kk=3', f'--workdir={tmp_path}'], capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert 'kk' in proc.stderr
  assert not any(tmp_path.iterdir())                  # nothing ran, nothing written


@pytest.mark.parametrize('kwargs, match', [
    (dict(prompt_bucket=0), 'prompt_bucket must be an int >= 1, got 0'),
    (dict(page_size=-8), 'page_size must be an int >= 1, got -8'),
    (dict(max_new_tokens=3.5), r'max_new_tokens must be an int >= 1, got 3\.5'),
    (dict(k=4), 'k=4 / draft_params given without a draft model'),
])
def test_more_bad_generation_arguments(tiny, kwargs, match):
  config, params = tiny
  kwargs = {'max_new_tokens': 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    generate(config, params, [[1, 2]], **kwargs)
  with pytest.raises(ValueError, match='needs draft_params'):
    generate(config, params, [[1, 2]], max_new_tokens=4, draft=config, k=2)
  with pytest.raises(ValueError, match='flat sequence of int token ids'):
    generate(config, params, [[1.5, 2.0]], max_new_tokens=4)


@pytest.mark.parametrize('temperature', [1e-40, float('inf'), float('nan')])
def test_temperatures_that_overflow_are_refused(temperature):
  from jaxspec.decoding import SamplingParams
  with pytest.raises(ValueError, match='temperature'):
    SamplingParams(temperature)


@pytest.mark.parametrize('field, value', [('rope_theta', 0.0), ('norm_eps', -1.0),
                                          ('rope_theta', float('nan'))])
def test_model_config_rejects_non_positive_floats(field, value):
  with pytest.raises(ValueError, match=field):
    ModelConfig.from_name('test-tiny', **{field: value})


@pytest.mark.parametrize('args, line', [
    (['--config=configs/batching.py:smoke', '--config.batchsize=4'],
     'FATAL: unknown config field \'batchsize\' (Did you mean "batch_size"'),
    (['--config=configs/batching.py:smoke', '--config.settings=k2=k:2'],
     "FATAL: settings 'k2=k:2' have no K = 0 baseline"),
    (['--config=configs/batching.py:smoke', '--config.min_requests=-1'],
     'FATAL: config.min_requests must be >= 0, got -1'),
    (['--config=configs/batching.py:smok'],
     "FATAL flags: flag --config=configs/batching.py:smok: Error whilst parsing config file: "
     "ValueError: unknown variant 'smok'"),
    (['--config=configs/batching.py:smoke', '--config.batchsize=4', '--config.min_request=1'],
     'FATAL: unknown config field \'batchsize\' (Did you mean "batch_size" instead of '
     '"batchsize"?); also unknown: \'min_request\' (did you mean \'min_requests\'?)'),
    (['--config=configs/eviction_batching.py:smoke', '--config.workloads='],
     "FATAL: config.workloads names no workload: ''"),
    (['--config=configs/eviction.py:worker', '--config.worker_chunk=0'],
     'FATAL: config.worker_chunk must be >= 1, got 0'),          # looped for ever, writing 0s
    (['--config=configs/eviction.py:smoke', '--config.workloads=retrieval',
      '--config.seq_len=100'],
     'FATAL: config.seq_len must be >= 176 with the retrieval workload'),  # named prompt_len
    (['--config=configs/eviction.py:smoke', '--config.num_sequences=3'],
     'FATAL: config.num_sequences (3) must be a multiple of config.batch_size (2)'),
    (['--config=configs/train.py:smoke', '--config.learning_rate=nan'],
     'FATAL: learning_rate must be a finite number'),             # saved an all-NaN model
    (['--config=configs/speculative.py:smoke', '--config.experiment=nope'],
     "FATAL: config.experiment='nope' names no module experiments/nope.py"),
    (['--config=configs/batchng.py'],
     "FATAL: cannot load the config file ([Errno 2] No such file or directory: "
     "'configs/batchng.py')"),
])
def test_bad_config_is_one_fatal_line(tmp_path, args, line):
  proc = subprocess.run([sys.executable, '-m', 'experiments.run', *args, f'--workdir={tmp_path}'],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not any(tmp_path.rglob('results.jsonl'))


def test_the_default_run_outside_the_repository_root_says_where_to_run_it(tmp_path):
  root = pathlib.Path(__file__).resolve().parent.parent
  env = dict(os.environ, PYTHONPATH=str(root))      # importable, as after `pip install -e .`
  proc = subprocess.run([sys.executable, '-m', 'experiments.run'], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].endswith(
      f'config paths are relative to the repository root, and {tmp_path} is not it'), proc.stderr


def test_stop_ids_from_a_generator_or_a_jax_array_are_kept(tiny):
  # A one-shot iterable was read twice (checked, then tabled) and left an empty stop table.
  import jax.numpy as jnp
  from jaxspec.decoding.generate import check_request
  config, _ = tiny
  for stop in ((t for t in [5, 3]), jnp.asarray([5, 3]), np.array([3, 5], np.int64)):
    assert check_request(config, [[1, 2]], max_new_tokens=2, stop_tokens=stop)[2].tolist() == [3, 5]
