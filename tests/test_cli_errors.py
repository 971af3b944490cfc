"""Bad input to the command-line programs (experiments.run / .sweep and scripts/) ends in one
line naming it (`FATAL: ...` or the script's own error), never a traceback or lost work.

The programs run through the `cli` fixture (tests/cli_server.py: forked from one process that
imported jax and jaxspec, as a fresh `python ...` runs them), but for the runs that need their
own environment or working directory outside the repository, which start a subprocess."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT_DIR = pathlib.Path(__file__).resolve().parents[1]


def test_unknown_config_field_fails_loudly(tmp_path, cli):
  proc = cli(['-m', 'experiments.run', '--config=configs/speculative.py:smoke', '--config.kk=3',
              f'--workdir={tmp_path}'])
  assert proc.returncode != 0
  assert 'kk' in proc.stderr
  assert not any(tmp_path.iterdir())                  # nothing ran, nothing written


@pytest.mark.parametrize('args, line', [
    (['--config=configs/batching.py:smoke', '--config.batchsize=4'],
     'FATAL: unknown config field \'batchsize\' (Did you mean "batch_size"'),
    (['--config=configs/batching.py:smoke', '--config.settings=k2=k:2'],
     "FATAL: settings 'k2=k:2' have no K = 0 baseline"),
    (['--config=configs/batching.py:smoke', '--config.min_requests=-1'],
     'FATAL: config.min_requests must be >= 0, got -1'),
    (['--config=configs/batching.py:smoke', '--config.seed=9223372036854775807',
      '--config.repeats=2'],                               # was: after pass 0's records
     'FATAL: config.seed=9223372036854775807 with config.repeats=2: pass 1\'s prompt seed '
     '9223372036854775808 is not a 64-bit int'),
    (['-config=configs/batching.py:smoke', '-config.nope=1'],   # absl's single-dash form
     "FATAL: unknown config field 'nope' in ['-config.nope=1']; known there: batch_size, "),
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
    (['--config=configs/eviction.py:worker', '--config.worker_budget=0'],
     'FATAL: config.worker_budget=0: budget must be an int >= 1, got 0'),
    (['--config=configs/batching.py:smoke', '--config.top_p=1.5'],   # was: after loading models
     'FATAL: config.top_p=1.5: top_p must be in (0, 1], got 1.5'),
    (['--config=configs/train.py:smoke', '--config.out=/tmp/jaxspec-m',   # save failed at the end
      '--config.checkpoint_dir=/tmp/jaxspec-m/ck'],
     "FATAL: config.checkpoint_dir='/tmp/jaxspec-m/ck' is config.out='/tmp/jaxspec-m' or inside"),
    (['--config=configs/eviction.py:worker', '--config.worker_budget=5000'],  # more KV than full
     'FATAL: config.worker_budget=5000 keeps every token of the run (256 prompt + worker_tokens='),
    (['--config=configs/eviction.py:smoke', '--config.workloads=retrieval',
      '--config.seq_len=100'],
     'FATAL: config.seq_len must be >= 176 with the retrieval workload'),  # named prompt_len
    (['--config=configs/eviction.py:smoke', '--config.num_sequences=3'],
     'FATAL: config.num_sequences (3) must be a multiple of config.batch_size (2)'),
    (['--config=configs/train.py:smoke', '--config.learning_rate=1e9'],   # was a traceback
     'FATAL: training diverged: final train loss'),
    (['--config=configs/train.py:smoke', '--config.learning_rate=nan'],
     'FATAL: learning_rate must be a finite number'),             # saved an all-NaN model
    (['--config=configs/speculative.py:smoke', '--config.experiment=nope'],
     "FATAL: config.experiment='nope' names no module experiments/nope.py"),
    (['--config=configs/batchng.py'],
     "FATAL: cannot load the config file ([Errno 2] No such file or directory: "
     "'configs/batchng.py')"),
    (['--config=configs/batchng.py', '--config.k=3'],       # an override: was a traceback
     "FATAL: cannot load the config file ([Errno 2] No such file or directory: "
     "'configs/batchng.py')"),
    (['--config=configs/speculative.py:smoke', '--config.tokenizer=nothere.json'],
     'FATAL: tokenizer file not found: nothere.json'),
    (['--config=configs/prefix_cache.py:smoke', '--config.turns=0'],   # no close match: list
     "FATAL: unknown config field 'turns' in ['--config.turns=0']; known there: draft, dtype,"),
    (['--config=configs/eviction_batching.py:smoke', '--config.policies=full'],
     "FATAL: config.policies names 'full': the full cache is the 'plain' setting"),
    (['--config=configs/prefix_cache.py:smoke', '--config.settings=off,on,on'],  # doubled 'on'
     "FATAL: config.settings='off,on,on' names ['on'] more than once"),
    (['--config=configs/hydration.py:smoke', '--config.extractor_k=2'],  # ran the target as 'draft'
     "FATAL: config.extractor_k=2 needs config.extractor=target"),
    (['--config=configs/eviction_batching.py:smoke', '--config.budgets=64,x'],
     "FATAL: config.budgets='64,x': 'x' is not a valid int"),
    (['--config=configs/batching.py:smoke', '--config.pool_pages=3'],  # was: after warm-ups
     "FATAL: setting 'k0': a request of the run: prompt of 48 tokens + max_tokens=8 + 1 needs 4 "
     "pages, the pool has 2 (--config.pool_pages=3; 0 sizes it)"),
    (['--config=configs/prefix_cache.py:smoke', '--config.k=40'],   # was: small_pool_pages
     'FATAL: speculation length K must be an int in [0, 16] (0 = off), got 40'),
    (['--config=configs/train.py:smoke', '--config.checkpoint_dir=/proc/version'],  # was: after
     "FATAL: config.checkpoint_dir='/proc/version': '/proc/version' is a file"),  # training
    (['--config=configs/train.py:smoke', '--config.out=/proc/version/model'],
     "FATAL: config.out='/proc/version/model': '/proc/version' is a file"),
    (['--config=configs/speculative.py:smoke', '--config.max_k=0'],   # was: 'K ... in [1, 0]'
     'FATAL: max_k must be an int >= 1, got 0'),
    (['--config=configs/batching.py:smoke', '--config.prompt_len=2000'],  # was: max_seq_len=
     "FATAL: config.prompt_len=2000 + config.max_tokens=8 + K + 1 = 2011 tokens (K = 2,"),
    (['--config=configs/eviction_batching.py:smoke', '--config.prompt_len=2000'],
     "FATAL: config.prompt_len=2000 + config.max_tokens=8 + 1 + lookup_k=2 = 2011 tokens exceeds"),
    (['--config=configs/hydration.py:smoke', '--config.alpha_temperatures=0,1e-5'],  # was: late
     "FATAL: config.alpha_temperatures='0,1e-5': temperature 1e-05 would overflow"),
    # Each was refused only after the models loaded and a run directory was made.
    (['--config=configs/hydration.py:smoke', '--config.max_result_tokens=0'],
     'FATAL: config.max_result_tokens must be >= 1, got 0'),
    (['--config=configs/hydration.py:smoke', '--config.alpha_temperatures=,'],   # was: skipped
     "FATAL: config.alpha_temperatures=',' names no temperature"),
    (['--config=configs/eviction.py:smoke', '--config.page_size=0'],
     'FATAL: config.page_size must be >= 1, got 0'),
    (['--config=configs/eviction_batching.py:smoke', '--config.prefill_group=3'],
     'FATAL: config.prefill_group=3 must divide config.chunk_size=16'),
])
def test_bad_config_is_one_fatal_line(tmp_path, args, line, cli):
  proc = cli(['-m', 'experiments.run', *args, f'--workdir={tmp_path}'])
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not any(tmp_path.rglob('results.jsonl'))


@pytest.mark.parametrize('source, line', [
    ('def get_config(arg=None:\n',                        # each was a raw traceback
     'cannot load the config file {path} (SyntaxError: invalid syntax at line 1)'),
    ('def get_config(arg=None):\n  return 1 / 0\n',
     'cannot load the config file {path} (ZeroDivisionError: division by zero)'),
    ('x = 1\n',                                           # was: 'unknown config field'
     'cannot load the config file {path} (the file defines no get_config())'),
    ('def get_config(arg=None):\n  return None\n',
     '{path}: get_config() returned NoneType, not an ml_collections.ConfigDict'),
    ('import ml_collections\ndef get_config(arg=None):\n  return ml_collections.ConfigDict()\n',
     "{path}: the config has no 'experiment' field"),
])
@pytest.mark.parametrize('module', ['experiments.run', 'experiments.sweep'])
def test_a_config_file_that_does_not_load_is_one_fatal_line(tmp_path, source, line, module,
                                                           cli):
  path = tmp_path / 'config.py'
  path.write_text(source)
  proc = cli(['-m', module, f'--config={path}', f'--workdir={tmp_path}/runs'])
  assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith('FATAL: ' + line.format(path=path)), \
      proc.stderr
  assert not (tmp_path / 'runs').exists()


@pytest.mark.parametrize('returned, override', [('None', '--config.batch_size=3'),
                                                 ('None', '--config.a.b=3'),
                                                 ("{'a': 1}", '--config.batch_size=3')])
def test_a_config_that_is_not_a_config_dict_is_named_with_an_override_too(tmp_path, returned,
                                                                          override, cli):
  """An override of a field leaves the config flag unparsed when it fails; the line still
  names the file and what get_config returned (was: 'unknown config field ... NoneType', or
  for a dict 'unknown config field' alone)."""
  path = tmp_path / 'config.py'
  path.write_text(f'def get_config(arg=None):\n  return {returned}\n')
  proc = cli(['-m', 'experiments.run', f'--config={path}', override,
              f'--workdir={tmp_path}/runs'])
  assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
  kind = 'NoneType' if returned == 'None' else 'dict'
  assert proc.stderr.strip().splitlines()[-1] == (
      f'FATAL: {path}: get_config() returned {kind}, not an ml_collections.ConfigDict')


@pytest.mark.parametrize('name, line', [
    ('common', "config.experiment='common': experiments/common.py is not an experiment"),
    ('report', "config.experiment='report': experiments/report.py runs experiments"),  # left an
    ('run', "config.experiment='run': experiments/run.py runs experiments"),   # empty run dir
    ('a.b', "config.experiment='a.b' must name a module of experiments/"),
])
def test_config_experiment_must_name_an_experiment(tmp_path, name, line, cli):
  proc = cli(['-m', 'experiments.run', '--config=configs/speculative.py:smoke',
              f'--config.experiment={name}', f'--workdir={tmp_path}'])
  assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith('FATAL: ' + line), proc.stderr
  assert not any(tmp_path.iterdir())


def test_a_run_that_fails_before_measuring_leaves_no_empty_directories(tmp_path, cli):
  """A run refused after its run directory was made (here: the extraction budget past the
  model's context, known once the model loads) removes the run directory and the
  WORKDIR/EXPERIMENT directories it made (was: an empty WORKDIR/hydration/ stayed); another
  run's directory beside it stays."""
  args = ['-m', 'experiments.run', '--config=configs/hydration.py:smoke',
          '--config.max_extract_tokens=5000']
  proc = cli(args + [f'--workdir={tmp_path}/runs'], timeout=300)
  assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      'FATAL: config.max_extract_tokens=5000 leaves no room'), proc.stderr
  assert 'nothing was measured' in proc.stderr
  assert not any(tmp_path.iterdir())
  other = tmp_path / 'runs' / 'hydration' / 'earlier'
  other.mkdir(parents=True)
  proc = cli(args + [f'--workdir={tmp_path}/runs'], timeout=300)
  assert proc.returncode != 0
  assert [p.name for p in (tmp_path / 'runs' / 'hydration').iterdir()] == ['earlier']
  kept = tmp_path / 'kept' / 'sub'     # empty before the run, reached through '..'
  kept.mkdir(parents=True)
  proc = cli(args + [f'--workdir={tmp_path}/new/../kept/sub'], timeout=300)
  assert proc.returncode != 0
  assert kept.is_dir() and not any(kept.iterdir())   # was: removed with its parent 'kept'
  assert not (tmp_path / 'new').exists()             # was: made to pass through, left behind


@pytest.mark.parametrize('module', ['experiments.run', 'experiments.sweep'])
def test_a_workdir_that_cannot_be_made_is_one_fatal_line(tmp_path, module, cli):
  (tmp_path / 'file').write_text('')
  for workdir in (tmp_path / 'file' / 'sub', '/proc/jaxspec-nope'):   # not a directory; ENOENT
    only = ['--only=k=2', '--only=temperature=0.0'] if module.endswith('sweep') else []
    proc = cli(['-m', module, '--config=configs/speculative.py:smoke', *only,
                f'--workdir={workdir}'])
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith('FATAL: cannot'), proc.stderr
    assert 'Traceback' not in proc.stderr


def test_the_default_run_outside_the_repository_root_says_where_to_run_it(tmp_path):
  root = pathlib.Path(__file__).resolve().parent.parent
  env = dict(os.environ, PYTHONPATH=str(root))      # importable, as after `pip install -e .`
  for args in (['experiments.run'], ['experiments.run', '--config.k=2'],   # an override: it was
               ['experiments.sweep', '--config.k=2']):                     # a 52-line traceback
    proc = subprocess.run([sys.executable, '-m', *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f'config paths are relative to the repository root, and {tmp_path} is not it'), proc.stderr


def test_process_0_checks_its_workdir_before_it_joins_a_multi_process_run(tmp_path):
  # It joined first and failed after; the other processes then failed half a minute later with
  # an error about the checkpoint (a collective that process 0 never entered).
  blocked = tmp_path / 'file'
  blocked.write_text('')
  env = dict(os.environ, JAX_NUM_PROCESSES='2', JAX_PROCESS_ID='0',
             JAX_COORDINATOR_ADDRESS='localhost:9')
  proc = subprocess.run([sys.executable, '-m', 'experiments.run',
                         '--config=configs/speculative.py:smoke', f'--workdir={blocked}/runs'],
                        cwd=ROOT_DIR, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1 and 'joining' not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f'FATAL: cannot make a run directory under --workdir={blocked}/runs: {blocked} is not a '
      f'directory')


@pytest.mark.parametrize('args, line', [
    (['replay_k_policy.py', '--live', 'no/such.jsonl'],   # was a traceback after the warm-ups
     "--live no/such.jsonl: [Errno 2] No such file or directory"),
    (['replay_k_policy.py', '--static', ',,'],             # was: no static K, silently
     '--static (at least one K) and --costs must be numbers'),
    (['replay_k_policy.py', '--sets', '0'],                 # before the models load
     '--sets 0 is out of range'),
    (['build_tokenizer.py', '--out', '/proc/version/tok.json'],   # was: after training
     "FATAL: --out: cannot save the tokenizer to /proc/version/tok.json: /proc/version is a file"),
    (['policy_host_time.py', '--set', 'nope.policy.spec_margin=1'],   # was: after the warm-ups
     "--set 'nope.policy.spec_margin=1': want SETTING.PATH=VALUE with SETTING in"),
    (['policy_host_time.py', '--workload', 'code,code'],    # would count each run twice
     "policy_host_time.py: error: --workload 'code,code': a workload twice"),
    (['policy_host_time.py', '--workload', 'code,cod'],     # before the models load
     "policy_host_time.py: error: --workload 'code,cod': unknown ['cod']; known: ['code', "
     "'json', 'retrieval']"),
    (['engine_throughput.py', '--k', '17'],                # was: after loading the models
     'FATAL: --k: speculation length K must be in [1, 16], got 17'),
    (['memory_mappings.py', '--slots', '2,2'],             # the same shape twice counts nothing
     "FATAL: --slots takes distinct comma-separated ints >= 1, got '2,2'"),
    (['cost_table_noise.py', '--tables', '0'],             # before the models load
     'FATAL: --tables must be an int >= 1, got 0'),
    (['trace_k_policy.py', '--workloads', 'json,jsn'],     # before the models load
     "trace_k_policy.py: error: --workloads 'json,jsn': unknown ['jsn']; known: ['code', "
     "'json', 'retrieval']"),
    (['trace_k_policy.py', '--set', 'k1.policy.spec_margin=1'],
     "trace_k_policy.py: error: --set 'k1.policy.spec_margin=1': want SETTING.PATH=VALUE with "
     "SETTING in ['k0', 'k2', 'goodput']"),
    (['trace_k_policy.py', '--settings', 'k0=k:0;big=k:40'],   # was: a traceback, models loaded
     "trace_k_policy.py: error: --settings: setting 'big' ({'k': 40}): speculation length K "
     "must be an int in [1, 16], got k=40"),
])
def test_script_arguments_are_refused_before_any_work(args, line, cli):
  proc = cli([f'scripts/{args[0]}', *args[1:]])
  assert proc.returncode != 0 and line in proc.stderr.strip().splitlines()[-1], proc.stderr
  assert 'Traceback' not in proc.stderr


@pytest.mark.parametrize('script', sorted(p.name for p in (ROOT_DIR / 'scripts').glob('*.py')))
def test_every_script_answers_help_without_running(script, cli):
  # check_kernels_gpu.py and constraint_libraries.py ran (or stopped on a missing GPU / package)
  # instead of printing their usage; make_hf_fixtures.py needed torch to say what it is.
  proc = cli([f'scripts/{script}', '--help'])
  assert proc.returncode == 0 and proc.stdout.startswith('usage:'), proc.stdout + proc.stderr
