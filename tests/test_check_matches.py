"""scripts/check_matches.py: CI's gate on the equality checks recorded in results files."""

import importlib.util
import json
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parent.parent / 'scripts' / 'check_matches.py'
_SPEC = importlib.util.spec_from_file_location('check_matches', _PATH)
check_matches = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check_matches)


def _write(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  return str(path)


def test_every_true_check_passes_and_nulls_are_not_counted(tmp_path, capsys):
  a = _write(tmp_path / 'a.jsonl', [
      {'workload': 'json', 'matches_autoregressive': True, 'speedup': 1.2},
      {'workload': 'json', 'setting': 'k0', 'matches_baseline': None},
      {'workload': 'json', 'setting': 'k2', 'matches_baseline': True}])
  b = _write(tmp_path / 'b.jsonl', [{'replay_matches': True, 'matches_off': True}])
  assert check_matches.main([a, b]) == 0
  assert 'equality checks: 4 held, 0 failed' in capsys.readouterr().out


def test_gzip_compressed_results_are_read(tmp_path, capsys):
  import gzip
  path = tmp_path / 'r.jsonl.gz'
  with gzip.open(path, 'wt') as f:
    f.write(json.dumps({'matches_baseline': True}) + '\n')
  assert check_matches.main([str(path)]) == 0
  assert 'equality checks: 1 held, 0 failed' in capsys.readouterr().out


def test_a_false_check_fails_naming_the_record_and_field(tmp_path, capsys):
  a = _write(tmp_path / 'a.jsonl', [
      {'workload': 'json', 'setting': 'k0', 'matches_baseline': None},
      {'workload': 'code', 'setting': 'k2', 'k': 2, 'matches_baseline': False},
      {'workload': 'code', 'setting': 'k4', 'matches_baseline': True}])
  assert check_matches.main([a]) == 1
  out = capsys.readouterr().out
  assert f'FAILED {a} line 2 (workload=code, setting=k2, k=2): matches_baseline = False' in out
  assert 'equality checks: 1 held, 1 failed' in out


def test_a_non_boolean_value_is_a_failure_not_a_pass(tmp_path):
  a = _write(tmp_path / 'a.jsonl', [{'matches_autoregressive': 'true'}])
  assert check_matches.main([a]) == 1


def test_files_without_any_check_fail(tmp_path, capsys):
  a = _write(tmp_path / 'a.jsonl', [{'workload': 'json', 'matches_baseline': None},
                                    {'speedup': 1.0}])
  assert check_matches.main([a]) == 1
  assert 'no equality check' in capsys.readouterr().out


def test_each_file_must_hold_a_check_of_its_own(tmp_path, capsys):
  """The speculative and batching results are checked together in CI: a file whose checks are
  all null (or absent) fails even beside one whose checks held."""
  ok = _write(tmp_path / 'ok.jsonl', [{'matches_autoregressive': True}])
  nulls = _write(tmp_path / 'nulls.jsonl', [{'setting': 'k0', 'matches_baseline': None}])
  empty = _write(tmp_path / 'empty.jsonl', [])
  assert check_matches.main([ok, nulls, empty]) == 1
  out = capsys.readouterr().out
  assert f'FAILED {nulls}: no equality check' in out and f'FAILED {empty}: no equality check' in out
  assert f'FAILED {ok}' not in out


@pytest.mark.parametrize('text', [
    '{"matches_x": true}\n{"matches_x": fal',          # torn last line
    '{"matches_x": fal\n{"matches_x": true}\n',        # damaged line in the middle
    '{"matches_x": true}\n[{"matches_x": false}]\n'])  # a JSON value that is not a record
def test_a_line_that_is_not_a_record_fails_naming_it(tmp_path, capsys, text):
  path = tmp_path / 'r.jsonl'
  path.write_text(text)
  assert check_matches.main([str(path)]) == 1
  assert 'not a JSON record' in capsys.readouterr().out


def test_a_missing_file_or_no_argument_is_a_usage_error(tmp_path, capsys):
  assert check_matches.main([str(tmp_path / 'missing.jsonl')]) == 2
  assert 'missing.jsonl' in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_:
    check_matches.main([])
  assert exit_.value.code == 2 and 'usage:' in capsys.readouterr().err
