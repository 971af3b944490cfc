"""The helpers experiments share (experiments/common.py, experiments/records.py), and no private
cross-module imports."""

import ast
import importlib
import json
import pathlib
import warnings

import jax
import ml_collections
import numpy as np
import pytest

from experiments import common
from experiments.common import check_fields, empty_cache, import_experiment, parse_workloads
from experiments.records import Results, new_run_dir, read_results, read_run
from jaxspec.data import WORKLOADS
from jaxspec.decoding import NonFiniteLogitsError
from jaxspec.models import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_no_experiment_imports_another_modules_private_names():
  bad = []
  for path in sorted((ROOT / 'experiments').glob('*.py')):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('experiments'):
        bad += [f'{path.name}: from {node.module} import {a.name}'
                for a in node.names if a.name.startswith('_')]
  assert not bad, bad


def test_parse_workloads_keeps_order_and_drops_blanks():
  config = ml_collections.ConfigDict({'workloads': f' {WORKLOADS[1]}, ,{WORKLOADS[0]},'})
  assert parse_workloads(config) == [WORKLOADS[1], WORKLOADS[0]]


@pytest.mark.parametrize('text, match', [(' , ', 'names no workload'),
                                         ('json,nosuch', "unknown workload.*'nosuch'"),
                                         ('json,code, json', r"\['json'\] more than once")])
def test_parse_workloads_rejects_bad_names(text, match):
  with pytest.raises(ValueError, match=match):
    parse_workloads(ml_collections.ConfigDict({'workloads': text}))


def test_empty_cache_gives_each_row_its_own_pages_and_counts_bytes():
  model = ModelConfig.from_name('test-tiny')
  cache, per_seq_bytes = empty_cache(model, batch=3, slots=17, page_size=8)   # 17 -> 3 pages
  table = np.asarray(cache.page_table)
  assert table.shape == (3, 3) and table.dtype == np.int32
  assert len(set(table.ravel().tolist())) == 9 and 0 not in table   # distinct, never the null page
  assert cache.k_pages.shape[2] == 3 * 3 + 1                        # pool P = B * pages + 1
  np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 0, 0])
  itemsize = cache.k_pages.dtype.itemsize
  per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * itemsize   # K and V
  assert per_seq_bytes == 3 * 8 * per_token


@pytest.mark.parametrize('batch, slots, page_size, match', [(2, 16, 0, 'page_size'),
                                                            (2, 0, 8, 'num_pages'),
                                                            (0, 16, 8, 'num_pages')])
def test_empty_cache_rejects_empty_or_bad_sizes(batch, slots, page_size, match):
  with pytest.raises(ValueError, match=match):
    empty_cache(ModelConfig.from_name('test-tiny'), batch, slots, page_size)


def test_a_busy_machine_is_warned_about_before_a_run(monkeypatch, capsys):
  from experiments import common
  monkeypatch.setattr(common.os, 'cpu_count', lambda: 2)
  monkeypatch.setattr(common.os, 'getloadavg', lambda: (2.7, 1.0, 0.5))
  assert common.warn_if_busy() == 2.7
  assert 'load average 2.7 on 2 CPUs' in capsys.readouterr().err
  monkeypatch.setattr(common.os, 'getloadavg', lambda: (0.4, 1.0, 0.5))
  assert common.warn_if_busy() == 0.4
  assert capsys.readouterr().err == ''


def test_a_run_records_the_versions_its_prompts_depend_on(tmp_path):
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import platform  # pylint: disable=import-outside-toplevel
  Results(tmp_path / 'run', ml_collections.ConfigDict({'k': 2}), verbose=False)
  env = json.loads((tmp_path / 'run' / 'environment.json').read_text())
  assert env['python'] == platform.python_version()
  assert env['packages']['botocore'] == importlib.metadata.version('botocore')
  assert env['packages']['jax'] == importlib.metadata.version('jax')
  assert env['devices'] and env['cpu_count'] >= 1


def test_the_last_config_flag_is_the_one_read_in_either_form():
  """absl keeps the last --config: the FATAL lines' path and the unknown-field check read it too
  (the first read the first one, the second no `--config PATH`)."""
  argv = ['run', '--config=configs/speculative.py', '--config', 'configs/batching.py:smoke']
  assert common._config_spec(argv) == 'configs/batching.py:smoke'
  assert common._config_value(argv).batch_size == 2          # the smoke variant's
  assert common._config_spec(argv[:3]) == 'configs/speculative.py'
  assert common._config_spec(['run', '--config']) == common.DEFAULT_CONFIG


def test_the_single_dash_config_flags_absl_takes_are_read_too():
  """absl takes `-config=...` and `-config.FIELD=...` as it takes the double-dash forms: the
  unknown-field check named no known fields for them (it read only `--config`)."""
  argv = ['run', '-config=configs/batching.py:smoke', '-config.nope=1', '-config.batch_siz=2']
  assert common._config_spec(argv) == 'configs/batching.py:smoke'
  found = {field: close for field, close, _ in common.unknown_fields(argv)}
  assert found == {'nope': None, 'batch_siz': 'batch_size'}


def test_a_run_directory_through_dotdot_makes_no_folder_to_pass_through(tmp_path):
  (tmp_path / 'kept').mkdir()
  run_dir = new_run_dir(tmp_path / 'new' / '..' / 'kept', 'exp', run_id='r')
  assert run_dir == tmp_path.resolve() / 'kept' / 'exp' / 'r' and run_dir.is_dir()
  assert not (tmp_path / 'new').exists()
  plain = new_run_dir(tmp_path / 'kept', 'exp', run_id='r')     # no '..': the path as given
  assert plain == tmp_path / 'kept' / 'exp' / 'r-2'


def test_run_directories_made_at_once_by_other_runs_are_neither_shared_nor_fatal(tmp_path,
                                                                                monkeypatch):
  """Two runs started in the same second: the second takes RUN_ID-2 (its check and mkdir were
  apart, and the mkdir failed). Another run's cleanup removing the empty EXPERIMENT directory
  between its mkdir and RUN_ID's: made again (it failed with FileNotFoundError)."""
  (tmp_path / 'exp' / 'r').mkdir(parents=True)
  (tmp_path / 'exp' / 'r-2').mkdir()
  assert new_run_dir(tmp_path, 'exp', run_id='r') == tmp_path / 'exp' / 'r-3'
  mkdir, calls = pathlib.Path.mkdir, []                  # the tries of RUN_ID 'r'

  def cleaned_up_in_between(self, *args, **kwargs):
    if self.name == 'r':
      calls.append(self)
    if calls == [self]:             # EXPERIMENT made, then removed by the other run's cleanup
      mkdir(self.parent, parents=True)
      self.parent.rmdir()
      return mkdir(self)
    return mkdir(self, *args, **kwargs)
  monkeypatch.setattr(pathlib.Path, 'mkdir', cleaned_up_in_between)
  run_dir = new_run_dir(tmp_path / 'other', 'exp', run_id='r')
  assert run_dir == tmp_path / 'other' / 'exp' / 'r' and run_dir.is_dir() and len(calls) > 1


def test_a_dangling_link_in_place_of_the_experiment_dir_is_an_error_not_a_loop(tmp_path):
  # mkdir(parents=True) raises FileExistsError for the link, which is not a taken RUN_ID.
  (tmp_path / 'exp').symlink_to(tmp_path / 'gone')
  with pytest.raises(FileExistsError):
    new_run_dir(tmp_path, 'exp', run_id='r')


def test_an_unknown_experiment_is_named_but_a_missing_dependency_is_not_hidden(monkeypatch):
  with pytest.raises(ValueError, match="config.experiment='nope' names no module"):
    import_experiment('nope')
  def missing_dependency(name):
    raise ModuleNotFoundError("No module named 'llguidance'", name='llguidance')
  monkeypatch.setattr(common.importlib, 'import_module', missing_dependency)
  with pytest.raises(ModuleNotFoundError, match='llguidance'):
    import_experiment('hydration')


def test_check_fields_names_the_first_field_below_its_minimum():
  config = ml_collections.ConfigDict({'a': 1, 'b': 0, 'c': -1})
  check_fields(config, ('a',))
  with pytest.raises(ValueError, match='config.b must be >= 1, got 0'):
    check_fields(config, ('a', 'b', 'c'))
  with pytest.raises(ValueError, match='config.c must be >= 0, got -1'):
    check_fields(config, ('b', 'c'), minimum=0)


@pytest.mark.parametrize('name', ['speculative', 'benchmark', 'hydration', 'eviction',
                                  'eviction_batching', 'prefix_cache', 'batching'])
def test_every_model_loading_config_has_a_dtype_that_load_at_dtype_applies(name):
  # benchmark, hydration, eviction and eviction_batching had no dtype field: a Hugging Face
  # model loaded only in float32 there (--config.dtype=bfloat16 was an unknown field).
  import importlib                                   # pylint: disable=import-outside-toplevel
  config = importlib.import_module(f'configs.{name}').get_config()
  assert config.dtype == 'float32'
  config.dtype = 'bfloat16'
  model, params = common.load_at_dtype(common.shipped('draft'), config)
  assert model.dtype == 'bfloat16'
  assert {str(x.dtype) for x in jax.tree.leaves(params)} == {'bfloat16'}


def _smoke(name, **overrides):
  config = importlib.import_module(f'configs.{name}').get_config('smoke')
  config.update(overrides)
  return config


@pytest.mark.parametrize('name, overrides, needle', [
    # Each was refused only after the models loaded and compiled (or not at all).
    ('benchmark', dict(ks='1,0'), r'config.ks: speculation length K must be in \[1, 16\], got 0'),
    ('benchmark', dict(max_new_tokens=1), 'config.max_new_tokens must be >= 2, got 1'),
    ('speculative', dict(batch_size=4, num_prompts=1),      # the record claimed batch_size=4
     'config.batch_size=4 exceeds config.num_prompts=1'),
    ('benchmark', dict(workload='nope'), "config.workload='nope' names no workload"),
    ('benchmark', dict(prompt_len=0), "config.prompt_len must be an int >= 1 for 'json', got 0"),
    # It measured and wrote json and code, then failed on retrieval with a partial results file.
    ('speculative', dict(prompt_len=40),
     "config.prompt_len must be an int >= 48 for 'retrieval', got 40"),
    ('prefix_cache', dict(small_pool_pages=2),
     r"small_pool_pages=2 is too small for settings \['on_host', 'on_small'\]: need >= "),
])
def test_experiment_fields_are_refused_before_any_model_loads(name, overrides, needle,
                                                              monkeypatch):
  module = import_experiment(name)
  monkeypatch.setattr(module, 'load_pair', lambda config: pytest.fail('loaded a model'))
  with pytest.raises(ValueError, match=needle):
    module.run(_smoke(name, **overrides), None)


def test_batching_refuses_a_short_retrieval_prompt_and_a_page_size_per_setting(monkeypatch):
  from experiments import batching  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(batching, 'load_pair', lambda config: pytest.fail('loaded a model'))
  with pytest.raises(ValueError, match="prompt_len must be an int >= 48 for 'retrieval', got 10"):
    batching.load_study(_smoke('batching', workloads='retrieval', prompt_len=10))
  eviction_batching = import_experiment('eviction_batching')
  monkeypatch.setattr(eviction_batching, 'load_at_dtype', lambda *a: pytest.fail('loaded'))
  with pytest.raises(ValueError, match="prompt_len must be an int >= 48 for 'retrieval', got 32"):
    eviction_batching.run(_smoke('eviction_batching', workloads='retrieval', prompt_len=32), None)
  with pytest.raises(ValueError, match="'page_size' is set by the experiment for every setting"):
    batching.parse_settings('k0=k:0;k2=k:2,page_size:5')   # a bigger pool for one setting


def test_eviction_quality_refuses_sequences_past_the_context():
  # It ran the full-cache baseline past the target's 1024 positions, with normal-looking records.
  with pytest.raises(ValueError, match=r'config.seq_len=2000 exceeds the context of the target '
                                       r'\(1024 tokens\)'):
    import_experiment('eviction').run(_smoke('eviction', seq_len=2000), None)
  # One token has no next token: the run scored nothing and wrote perplexity=None, 'done'.
  with pytest.raises(ValueError, match='config.seq_len must be >= 2, got 1'):
    import_experiment('eviction').validate(_smoke('eviction', seq_len=1, workloads='json'))


@pytest.mark.parametrize('tokens', [10, 1000])
def test_eviction_worker_refuses_a_run_that_is_not_whole_chunks(monkeypatch, tokens):
  # It generated a whole 512-token chunk for a 10-token run, and 1024 tokens for 1000.
  module = import_experiment('eviction')
  monkeypatch.setattr(module, 'load_at_dtype', lambda *a: pytest.fail('loaded a model'))
  with pytest.raises(ValueError, match=f'config.worker_tokens={tokens} must be a multiple of '
                                       f'config.worker_chunk=512'):
    module.run(_smoke('eviction', mode='worker', worker_tokens=tokens, worker_chunk=512), None)


def test_the_speculative_experiment_refuses_to_measure_a_draft_whose_logits_turn_nan(
    monkeypatch, tmp_path):
  # Finite weights whose logits overflow (NaN weights are refused at load): it wrote alpha = 0
  # records and 'done', as if the draft were merely poor.
  module = import_experiment('speculative')
  load_pair = module.load_pair

  def nan_draft(config):
    target, tparams, draft, dparams, tokenizer = load_pair(config)
    norm = dparams['params']['final_norm']
    return (target, tparams, draft, {'params': {**dparams['params'], 'final_norm': jax.tree.map(
        lambda x: x * np.inf, norm)}}, tokenizer)

  monkeypatch.setattr(module, 'load_pair', nan_draft)
  config = _smoke('speculative', workloads='json')
  with pytest.warns(UserWarning), pytest.raises(
      NonFiniteLogitsError, match=r"the draft \(shipped\)'s logits were not finite"):
    module.run(config, Results(tmp_path / 'run', config, verbose=False))


def test_read_results_names_damaged_lines_but_not_a_torn_last_one(tmp_path):
  path = tmp_path / 'results.jsonl'
  path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')       # blank line; torn by a kill
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert read_results(path) == [{'a': 1}, {'a': 2}]
  path.write_text('{"a": 1}\n{"a": 2, "b"\n{"a": 3}\n')        # a record lost in the middle
  with pytest.warns(UserWarning, match=r'results.jsonl: line 2 not a JSON record, skipped'):
    assert read_results(path) == [{'a': 1}, {'a': 3}]


def test_read_results_reads_gzip_compressed_records_and_names_a_file_that_is_not(tmp_path):
  import gzip
  path = tmp_path / 'results.jsonl.gz'
  with gzip.open(path, 'wt') as f:
    f.write('{"a": 1}\n{"a": 2}\n')
  assert read_results(path) == [{'a': 1}, {'a': 2}]
  plain = tmp_path / 'other.jsonl.gz'
  plain.write_text('{"a": 1}\n')                             # named .gz, not compressed
  with pytest.raises(ValueError, match=r'other.jsonl.gz is not a results file \(not gzip'):
    read_results(plain)


def test_read_run_takes_a_file_or_its_directory_and_a_sweeps_finished_listed_cases(tmp_path):
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'results.jsonl').write_text('{"a": 1}\n')
  assert read_run(run) == (run / 'results.jsonl', [{'a': 1}], 0)
  assert read_run(run / 'results.jsonl')[1] == [{'a': 1}]
  with pytest.raises(ValueError, match=r"no results file '.*missing/results.jsonl'"):
    read_run(tmp_path / 'missing' / 'results.jsonl')
  sweep = tmp_path / 'sweep'
  for cid, done in (('b', True), ('a', True), ('c', False), ('gone', True)):
    (sweep / 'cases' / cid).mkdir(parents=True)
    if done:
      (sweep / 'cases' / cid / 'done').write_text('')
  (sweep / 'sweep.json').write_text(json.dumps([{'case_id': c} for c in 'abc']))
  (sweep / 'results.jsonl').write_text(''.join(
      json.dumps({'case_id': c}) + '\n' for c in ('b', 'c', 'a', 'gone')))
  path, records, left_out = read_run(sweep)
  assert [r['case_id'] for r in records] == ['a', 'b'] and left_out == 2   # unfinished, unlisted


def test_the_eviction_worker_mode_does_not_check_the_quality_modes_budget():
  # budget_frac=0 was refused in worker mode, which keeps worker_budget tokens instead.
  config = importlib.import_module('configs.eviction').get_config('worker')
  config.update(dict(budget_frac=0.0))
  import_experiment('eviction').validate(config)
  config.update(dict(mode='quality'))
  with pytest.raises(ValueError, match='budget_frac'):
    import_experiment('eviction').validate(config)
