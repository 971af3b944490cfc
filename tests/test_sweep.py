"""Tests for experiments.sweeps, experiments.sweep and experiments.report (fake experiment)."""

import collections
import csv
import importlib.util
import json
import pathlib
import sys

import ml_collections
import pytest

import fake_experiment
from experiments import report, sweeps
from experiments.common import import_experiment
from experiments.records import read_results
from experiments.sweep import run_sweep

TESTS = pathlib.Path(__file__).parent
ROOT = TESTS.parent
CONFIG = str(TESTS / 'fake_config.py')
ALL_CASES = [f'k={k},temperature={t}' for k in (1, 2, 4) for t in (0.0, 1.0)]


@pytest.fixture(autouse=True)
def fake_registered(monkeypatch):
  monkeypatch.setitem(sys.modules, 'experiments.fake', fake_experiment)


def _sweep(tmp_path, **kw):
  overrides = {'log': str(tmp_path / 'log.txt'), **kw.pop('overrides', {})}
  return run_sweep(CONFIG, tmp_path / 'runs', overrides=overrides, progress=False, **kw)


def _runs(tmp_path) -> collections.Counter:
  return collections.Counter((tmp_path / 'log.txt').read_text().split())


def _case_counts(records) -> collections.Counter:
  return collections.Counter(r['case_id'] for r in records)


def test_product_zip_and_case_id_are_deterministic_and_checked():
  assert sweeps.product(k=[1, 2], t=[0.0, 1.0]) == [
      {'k': 1, 't': 0.0}, {'k': 1, 't': 1.0}, {'k': 2, 't': 0.0}, {'k': 2, 't': 1.0}]
  assert sweeps.zip_(k=[1, 2], t=[0.5, 1.0]) == [{'k': 1, 't': 0.5}, {'k': 2, 't': 1.0}]
  with pytest.raises(ValueError, match='k=2, t=3'):
    sweeps.zip_(k=[1, 2], t=[0, 1, 2])
  with pytest.raises(ValueError, match='workloads'):
    sweeps.product(workloads='json')
  assert sweeps.case_id({'workloads': 'json', 'temperature': 0, 'k': 4}) == (
      'k=4,temperature=0,workloads=json')
  assert sweeps.case_id({'path': 'a/b c'}) == 'path=a_b_c'
  assert sweeps.case_id({}) == 'base'


def test_apply_overrides_copies_coerces_and_names_unknown_fields():
  config = ml_collections.ConfigDict({'k': 4, 'temperature': 0.0, 'name': 'x', 'sub': {'n': 1}})
  config.lock()
  new = sweeps.apply_overrides(config, {'temperature': 1, 'k': '8', 'sub.n': 2, 'name': 'y'})
  assert (new.k, new.temperature, new.sub.n, new.name) == (8, 1.0, 2, 'y')
  assert isinstance(new.temperature, float) and config.k == 4 and config.sub.n == 1
  with pytest.raises(ValueError, match="'sub.m'"):
    sweeps.apply_overrides(config, {'sub.m': 1})
  with pytest.raises(ValueError, match="'name'"):
    sweeps.apply_overrides(config, {'name': 3})
  with pytest.raises(ValueError, match='same id'):
    sweeps.validate_sweep(config, [{'k': 1}, {'k': 1}])
  # Ids differ, configs do not: both ran, every record twice.
  for cases in ([{'temperature': 1}, {'temperature': 1.0}], [{'k': 4}, {}]):
    with pytest.raises(ValueError, match='sweep cases 0 .* and 1 .* give the same config'):
      sweeps.validate_sweep(config, cases)


def test_only_and_shard_parsing():
  assert sweeps.parse_only(['k=4,temperature=0.0', 'k=8', 'workloads=json,code']) == {
      'k': ['4', '8'], 'temperature': ['0.0'], 'workloads': ['json,code']}
  assert sweeps.parse_only(['k=4, temperature=0.0']) == {'k': ['4'], 'temperature': ['0.0']}
  assert sweeps.matches({'k': 4, 'temperature': 0.0}, {'k': ['4'], 'temperature': ['0']})
  for bad in ('k=4,=3', 'k=4, =3', '=3', 'k'):       # 'k=4,=3' matched no case, unexplained
    with pytest.raises(ValueError, match="--only takes field=value, got '"):
      sweeps.parse_only([bad])
  assert not sweeps.matches({'k': 4, 'temperature': 1.0}, {'k': ['4'], 'temperature': ['0']})
  assert sweeps.parse_shard('1/3') == (1, 3)
  for bad in ('3/3', '1', 'a/b'):
    with pytest.raises(ValueError, match='shard'):
      sweeps.parse_shard(bad)


def test_a_filter_matching_no_case_lists_the_swept_values():
  cases = [dict(k=k, temperature=t) for k in (1, 2) for t in (0.0, 1.0)]
  assert sweeps.select_cases(cases, ['k=2', 'temperature=0']) == [2]
  with pytest.raises(ValueError,
                     match=r"no case matches --only=\['k=3'\].*\(swept values: k: 1, 2\)"):
    sweeps.select_cases(cases, ['k=3'])


def test_resume_runs_only_the_rest_and_each_case_appears_once(tmp_path, monkeypatch):
  partial = 'k=2,temperature=0.0'  # third case: interrupted after its first record
  monkeypatch.setenv('FAKE_INTERRUPT_ON', partial)
  with pytest.raises(KeyboardInterrupt):
    _sweep(tmp_path)
  monkeypatch.delenv('FAKE_INTERRUPT_ON')
  sweep_dir = tmp_path / 'runs' / 'fake' / 'sweep'
  assert _case_counts(read_results(sweep_dir / 'results.jsonl'))[partial] == 1
  with open(sweep_dir / 'results.jsonl', 'a') as f:  # a kill in the middle of a write
    f.write('{"case_id": "k=2,temp')

  outcome = _sweep(tmp_path)
  assert outcome.skipped == ALL_CASES[:2] and outcome.ran == ALL_CASES[2:]
  assert outcome.exit_code == 0
  assert _runs(tmp_path) == {**{c: 1 for c in ALL_CASES}, partial: 2}
  lines = (sweep_dir / 'results.jsonl').read_text().splitlines()
  records = [json.loads(line) for line in lines]  # no torn line left
  assert _case_counts(records) == {c: 2 for c in ALL_CASES}
  assert len(read_results(sweep_dir / 'cases' / partial / 'results.jsonl')) == 2
  assert all((sweep_dir / 'cases' / c / 'done').exists() for c in ALL_CASES)

  again = _sweep(tmp_path)
  assert again.ran == [] and again.skipped == ALL_CASES and len(again.records) == 12


def test_unknown_field_fails_before_any_case_runs(tmp_path):
  config = tmp_path / 'bad_config.py'
  config.write_text((TESTS / 'fake_config.py').read_text()
                    + '\n\ndef get_sweep():\n  return [{"k": 1}, {"kk": 2}]\n')
  with pytest.raises(ValueError, match="'kk'"):
    run_sweep(str(config), tmp_path / 'runs', overrides={'log': str(tmp_path / 'log.txt')})
  assert not (tmp_path / 'log.txt').exists() and not (tmp_path / 'runs').exists()
  with pytest.raises(ValueError, match="'num_promts'"):
    _sweep(tmp_path, overrides={'num_promts': 2})


def test_a_bad_value_fails_once_before_any_case_runs(tmp_path):
  # A base override every case inherits failed each case in turn (six failures, one per case).
  log = tmp_path / 'log.txt'
  with pytest.raises(ValueError, match=r'sweep case 0 \(k=1,temperature=0.0\): '
                                       r'config.num_prompts must be >= 1, got 0'):
    run_sweep(CONFIG, tmp_path / 'runs', overrides={'num_prompts': 0, 'log': str(log)})
  assert not log.exists() and not (tmp_path / 'runs').exists()


def test_every_shipped_config_and_its_sweep_pass_their_experiments_validate():
  for path in sorted((ROOT / 'configs').glob('[!_]*.py')):
    spec = importlib.util.spec_from_file_location('_config_' + path.stem, path)
    file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(file)
    for variant in (None, 'smoke'):
      base = file.get_config(variant) if variant else file.get_config()
      module = import_experiment(base.experiment)
      assert callable(module.validate), path            # each experiment checks before it loads
      module.validate(base)
      if hasattr(file, 'get_sweep'):
        for config in sweeps.validate_sweep(base, file.get_sweep()):
          module.validate(config)


def test_failing_case_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
  bad = 'k=2,temperature=1.0'
  monkeypatch.setenv('FAKE_FAIL_ON', bad)
  outcome = _sweep(tmp_path)
  monkeypatch.delenv('FAKE_FAIL_ON')
  assert outcome.failed == [bad] and outcome.exit_code == 1
  assert outcome.ran == ALL_CASES
  assert _case_counts(outcome.records) == {c: 2 for c in ALL_CASES if c != bad}
  case_dir = outcome.sweep_dir / 'cases' / bad
  assert 'fake failure' in (case_dir / 'error.txt').read_text()
  assert 'Traceback' in (case_dir / 'error.txt').read_text()
  assert not (case_dir / 'done').exists()
  failures = read_results(outcome.sweep_dir / 'failures.jsonl')
  assert [f['case_id'] for f in failures] == [bad] and 'fake failure' in failures[0]['error']
  assert (outcome.sweep_dir / 'summary.md').exists()

  retry = _sweep(tmp_path)
  assert retry.ran == [bad] and retry.exit_code == 0
  assert read_results(outcome.sweep_dir / 'failures.jsonl') == []
  assert _case_counts(retry.records) == {c: 2 for c in ALL_CASES}


@pytest.mark.parametrize('only, shard, expected', [
    (['k=4'], None, ['k=4,temperature=0.0', 'k=4,temperature=1.0']),
    (['k=4,temperature=0.0'], None, ['k=4,temperature=0.0']),
    (['k=1', 'k=4', 'temperature=1'], None, ['k=1,temperature=1.0', 'k=4,temperature=1.0']),
    ([], '1/4', ['k=1,temperature=1.0', 'k=4,temperature=1.0']),
])
def test_only_and_shard_run_the_subset(tmp_path, only, shard, expected):
  outcome = _sweep(tmp_path, only=only, shard=shard)
  assert outcome.selected == expected and outcome.ran == expected
  assert set(_runs(tmp_path)) == set(expected)


def test_only_rejects_fields_that_are_not_swept_and_empty_selections(tmp_path):
  with pytest.raises(ValueError, match='workloads'):
    _sweep(tmp_path, only=['workloads=json'])
  with pytest.raises(ValueError, match='no case'):
    _sweep(tmp_path, only=['k=3'])


def _spec_records():
  return [{'case_id': f'k={k},temperature={t}', 'k': k, 'temperature': t, 'workload': w,
           'acceptance_rate': 0.9 / k, 'speedup': 1 + 0.5 / k, 'ttft_s': None}
          for k in (1, 2, 4) for t in (0.0, 1.0) for w in ('json', 'code')]


def test_report_writes_one_row_per_record_and_nonempty_plots(tmp_path):
  records = _spec_records()
  report.summarize(records, tmp_path / 's.md', tmp_path / 's.csv')
  rows = list(csv.reader(open(tmp_path / 's.csv')))
  assert rows[0][:3] == ['case_id', 'k', 'temperature'] and len(rows) == len(records) + 1
  md_rows = [l for l in (tmp_path / 's.md').read_text().splitlines() if l.startswith('|')]
  assert len(md_rows) == len(records) + 2  # header and separator
  pngs = report.plot(records, tmp_path / 'plots', 'speculative')
  assert {p.name for p in pngs} == {'acceptance_vs_k.png', 'speedup_vs_k.png'}
  assert all(p.stat().st_size > 1000 for p in pngs)
  assert report.plot(records, tmp_path / 'other', 'no_plots_registered') == []
  # Records of several kinds (hydration: turn, summary, alpha): a table each, its own columns.
  mixed = [dict(kind='turn', turn=t, ttft_s=0.1 * t) for t in (1, 2)] + [
      dict(kind='summary', strategy='stuffing', ttft_s_total=0.3)]
  report.summarize(mixed, tmp_path / 'm.md', tmp_path / 'm.csv')
  text = (tmp_path / 'm.md').read_text()
  assert '## kind = turn (2 records)' in text and '## kind = summary (1 record)' in text
  assert '| kind | turn | ttft_s |' in text and '| kind | strategy | ttft_s_total |' in text
  assert len(list(csv.reader(open(tmp_path / 'm.csv')))) == 4     # the CSV: one table, all


def test_report_cli_remakes_summary_and_plots(tmp_path, cli):
  results = tmp_path / 'results.jsonl'
  results.write_text(''.join(json.dumps(r) + '\n' for r in _spec_records()))
  made = cli(['-m', 'experiments.report', str(results), '--out', str(tmp_path / 'out'),
              '--experiment=speculative'], cwd=ROOT)
  assert made.returncode == 0, made.stderr
  assert (tmp_path / 'out' / 'summary.csv').exists()
  assert (tmp_path / 'out' / 'plots' / 'speedup_vs_k.png').stat().st_size > 0
  edited = _spec_records()
  edited[3]['k'] = '2'                 # a hand-edited record: the plot cannot order '2' and 1
  results.write_text(''.join(json.dumps(r) + '\n' for r in edited))
  bad = cli(['-m', 'experiments.report', str(results), '--out', str(tmp_path / 'bad'),
             '--experiment=speculative'], cwd=ROOT)
  assert bad.returncode == 1 and 'Traceback' not in bad.stderr, bad.stderr
  assert "FATAL: the 'speculative' plots / summary cannot read these records" in bad.stderr
  assert (tmp_path / 'bad' / 'summary.csv').exists()


def _cli(cli, tmp_path, *flags):
  code = ('import sys; sys.path.insert(0, "tests"); import fake_experiment; '
          'sys.modules["experiments.fake"] = fake_experiment; from absl import app; '
          'from experiments import sweep; sweep.define_flags(); app.run(sweep.main)')
  return cli(['-c', code, f'--workdir={tmp_path}', *flags], cwd=ROOT)


def test_cli_applies_base_overrides_to_every_case_and_exits_nonzero_on_failure(tmp_path, cli):
  ok = _cli(cli, tmp_path, '--config=tests/fake_config.py:smoke', '--config.num_prompts=3',
            '--only=k=1', '--only=temperature=0.0')
  assert ok.returncode == 0, ok.stderr
  records = read_results(tmp_path / 'fake' / 'sweep-smoke' / 'results.jsonl')   # the variant's
  assert [r['num_prompts'] for r in records] == [3, 3]
  failed = _cli(cli, tmp_path, '--config=tests/fake_config.py', '--sweep_name=s2', '--shard=0/3',
                '--config.fail_on=k=1,temperature=0.0')
  assert failed.returncode == 1, failed.stderr
  bad = _cli(cli, tmp_path, '--config=tests/fake_config.py', '--only=kk=1')
  assert bad.returncode == 1 and "'kk'" in bad.stderr


def test_resuming_with_another_base_config_is_refused(tmp_path):
  _sweep(tmp_path, only=['k=1'])
  with pytest.raises(ValueError, match=r'another base config .*num_prompts: 8 -> 3'):
    _sweep(tmp_path, overrides={'num_prompts': 3})
  assert _sweep(tmp_path, only=['k=2']).exit_code == 0       # same base: resumes


def test_summary_leaves_out_unfinished_cases(tmp_path, monkeypatch, cli):
  monkeypatch.setenv('FAKE_INTERRUPT_ON', 'k=1,temperature=0.0')
  with pytest.raises(KeyboardInterrupt):
    _sweep(tmp_path)
  monkeypatch.delenv('FAKE_INTERRUPT_ON')
  outcome = _sweep(tmp_path, only=['k=2'])
  assert {r['case_id'] for r in outcome.records} == {'k=2,temperature=0.0', 'k=2,temperature=1.0'}
  assert 'k=1,temperature=0.0' not in (outcome.sweep_dir / 'summary.md').read_text()
  # The report CLI on the sweep directory leaves the unfinished case out too.
  proc = cli(['-m', 'experiments.report', str(outcome.sweep_dir), '--out', str(tmp_path / 'cli')],
             cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert '1 records of unfinished cases or cases no longer in sweep.json left out' in proc.stdout
  assert 'k=1,temperature=0.0' not in (tmp_path / 'cli' / 'summary.md').read_text()
  # ... and, as the sweep does, the cases a sweep.json no longer lists (the grid shrank).
  sweep_json = outcome.sweep_dir / 'sweep.json'
  cases = [c for c in json.loads(sweep_json.read_text()) if c['case_id'] != 'k=2,temperature=1.0']
  sweep_json.write_text(json.dumps(cases))
  again = cli(['-m', 'experiments.report', str(outcome.sweep_dir), '--out', str(tmp_path / 'cli2')],
              cwd=ROOT)
  assert again.returncode == 0, again.stderr
  summary = (tmp_path / 'cli2' / 'summary.md').read_text()
  assert 'k=2,temperature=0.0' in summary and 'k=2,temperature=1.0' not in summary
  for name in ('speculativ', 'common'):      # a typo; a module of experiments/ but no experiment
    typo = cli(['-m', 'experiments.report', str(outcome.sweep_dir), '--out',
                str(tmp_path / 'cli3'), f'--experiment={name}'], cwd=ROOT)
    assert typo.returncode == 1 and f"FATAL: --experiment='{name}' names no experiment" in (
        typo.stderr)
  train = cli(['-m', 'experiments.report', str(outcome.sweep_dir), '--out',
               str(tmp_path / 'cli4'), '--experiment=train'], cwd=ROOT)   # one without plots
  assert train.returncode == 0 and (tmp_path / 'cli4' / 'summary.md').exists(), train.stderr


def test_a_truncated_results_file_is_restored_from_the_case_files(tmp_path):
  _sweep(tmp_path)
  sweep_dir = tmp_path / 'runs' / 'fake' / 'sweep'
  path = sweep_dir / 'results.jsonl'
  full = read_results(path)
  lines = path.read_text().splitlines(keepends=True)
  odd = '[' * 100000 + '\n' + '9' * 5000 + '\n'     # RecursionError; the int digit limit
  path.write_text(''.join(lines[:5]) + '[1, 2]\n"foreign"\n' + odd)    # lost lines, foreign ones
  # Damaged lines before the last are named (a lost result); a torn last line, from a kill, is not.
  with pytest.warns(UserWarning, match=r'results.jsonl: lines 6, 7, 8 not a JSON record, skipped'):
    assert len(read_results(path)) == 5
  (sweep_dir / 'cases' / ALL_CASES[-1] / 'results.jsonl').write_text('')   # lost there too
  again = _sweep(tmp_path)
  assert again.ran == ALL_CASES[-1:] and _runs(tmp_path)[ALL_CASES[-1]] == 2
  records = read_results(path)
  assert _case_counts(records) == _case_counts(full) == {c: 2 for c in ALL_CASES}
  assert sorted(map(json.dumps, records[:-2])) == sorted(map(json.dumps, full[:-2]))


def test_overriding_a_swept_field_or_a_path_as_sweep_name_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r'--config.k names a field the sweep sets in every case.*'
                                       r'--only=k=VALUE'):
    _sweep(tmp_path, overrides={'k': 8})
  for name in ('', '.', '..', 'a/b', '../escaped'):
    with pytest.raises(ValueError, match='--sweep_name=.* must name one directory'):
      _sweep(tmp_path, sweep_name=name)
  assert not (tmp_path / 'log.txt').exists()


def test_a_variant_sweeps_into_its_own_directory(tmp_path):
  """`FILE:smoke` is another base config: by default it gets `sweep-smoke`, so the README's
  smoke sweep beside a full one resumes neither and collides with neither."""
  full = _sweep(tmp_path, only=['k=1', 'temperature=0'])
  smoke = run_sweep(CONFIG + ':smoke', tmp_path / 'runs', progress=False,
                    overrides={'log': str(tmp_path / 'log.txt')}, only=['k=1', 'temperature=0'])
  assert full.sweep_dir.name == 'sweep' and smoke.sweep_dir.name == 'sweep-smoke'
  assert smoke.ran == full.ran and smoke.exit_code == 0 == full.exit_code
