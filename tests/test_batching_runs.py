"""experiments/batching_runs.py: adaptive K against the best static setting across runs."""

import json
import re

import pytest

from experiments import batching_runs


def _run(goodput_tps, k1_tps, b=2, workload='code', repeats=2):
  """One run's records: K = 0 at 100 tokens/s, K = 1 and goodput as given, every pass alike."""
  out = []
  for repeat in range(repeats):
    for setting, k, policy, tps, alpha in (('k0', 0, 'fixed', 100.0, None),
                                           ('k1', 1, 'fixed', k1_tps, 0.6),
                                           ('goodput', 8, 'goodput', goodput_tps, 0.6)):
      out.append(dict(case_id=f'batch_size={b}', batch_size=b, workload=workload,
                      setting=setting, k=k, drafter='model' if k else 'none', k_policy=policy,
                      repeat=repeat, tokens_per_s=tps, decode_tokens_per_s=tps,
                      round_s=0.01 * (1 + 0.4 * (k == 1)), acceptance_rate=alpha,
                      mean_accepted_length=1.6 if k else 1.0, ttft_s=0.01, tpot_s=0.002,
                      speedup=tps / 100.0, decode_speedup=tps / 100.0))
  return out


def test_each_run_is_held_against_its_own_best_static_setting():
  """Run 1: K = 1 best (110), goodput 99 -> 0.9; run 2: K = 0 best, goodput 98 -> 0.98; the
  mean, the spread between runs and its standard error follow."""
  rows = batching_runs.across_runs([_run(99.0, 110.0), _run(98.0, 90.0)])
  assert len(rows) == 1
  row = rows[0]
  assert (row['batch_size'], row['workload'], row['setting']) == (2, 'code', 'goodput')
  assert row['fractions'] == [pytest.approx(0.9), pytest.approx(0.98)]
  assert row['mean'] == pytest.approx(0.94)
  assert row['sd'] == pytest.approx(0.08 / 2 ** 0.5)
  assert row['se'] == pytest.approx(0.04)
  md = batching_runs.table(rows, aim=0.95)
  assert '| 2 | code | goodput | 2 | 0.900 0.980 | 0.940 | 0.057 | 0.040 | 1 |' in md


def test_one_run_has_no_spread_and_cells_missing_from_a_run_count_only_where_present():
  rows = batching_runs.across_runs([_run(99.0, 110.0),
                                    _run(97.0, 90.0, workload='json')])
  assert [(r['workload'], len(r['fractions']), r['sd'], r['se']) for r in rows] == [
      ('code', 1, None, None), ('json', 1, None, None)]


def test_cli_reads_files_and_directories_and_names_what_it_cannot(tmp_path, capsys):
  for i, run in enumerate((_run(99.0, 110.0), _run(98.0, 90.0))):
    (tmp_path / f'r{i}').mkdir()
    (tmp_path / f'r{i}' / 'results.jsonl').write_text(
        ''.join(json.dumps(r) + '\n' for r in run))
  assert batching_runs.main([str(tmp_path / 'r0'), str(tmp_path / 'r1' / 'results.jsonl')]) == 0
  assert '| 2 | code | goodput | 2 | 0.900 0.980 |' in capsys.readouterr().out
  with pytest.raises(SystemExit):
    batching_runs.main([str(tmp_path / 'missing')])
  assert 'missing' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    batching_runs.main([str(tmp_path / 'r0'), '--aim', '0'])
  assert '--aim' in capsys.readouterr().err


def test_records_without_an_adaptive_setting_say_so(tmp_path, capsys):
  run = [r for r in _run(99.0, 110.0) if r['setting'] != 'goodput']
  path = tmp_path / 'results.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in run))
  assert batching_runs.main([str(path)]) == 1
  assert 'nothing to compare' in capsys.readouterr().out


def _with_tables(run, warm_c1, idle_c1):
  """`run` with goodput's warm-up table {0: 1 ms, 1: warm_c1 ms} and the static K = 1
  setting's idle round at idle_c1 x K = 0's (every record of a setting alike, as the study
  writes them)."""
  for r in run:
    if r['setting'] == 'goodput':
      r['warmup_step_costs'] = {'0': 0.001, '1': 0.001 * warm_c1, '2': 0.003}
    elif r['setting'] == 'k1':
      r['idle_round_cost'] = idle_c1
  return run


def test_tables_compare_each_engines_warm_up_c1_with_its_runs_idle_rounds(tmp_path, capsys):
  runs = [('a', _with_tables(_run(99.0, 110.0), 1.5, 1.5)),
          ('b', _with_tables(_run(99.0, 110.0, b=4), 2.0, 1.6)),     # 1.25: off by 25 %
          ('c', _run(99.0, 110.0))]                                  # no tables: left out
  rows, left = batching_runs.table_errors(runs)
  assert not left
  assert [(r['run'], r['batch_size'], r['setting']) for r in rows] == [
      ('a', 2, 'goodput'), ('b', 4, 'goodput')]      # one row per engine, not per record
  assert [r['quotient'] for r in rows] == [pytest.approx(1.0), pytest.approx(1.25)]
  text = batching_runs.errors_table(rows, off=0.1)
  assert text.startswith('2 engines of 2 cases in 2 files: warm-up c(1) / idle c(1) median 1.125, '
                         '10th-90th percentiles 1.025-1.225\n1 off by more than 10%:\n')
  assert "b B = 4 (case 'batch_size=4') goodput: warm-up c(1) 2.000, idle 1.600, quotient " \
      "1.250" in text
  assert batching_runs.errors_table(rows, off=0.3).endswith('0 off by more than 30%\n')
  assert '0 off by more than 12.5%' not in batching_runs.errors_table(rows, off=0.125)
  assert '1 off by more than 12.5%' in batching_runs.errors_table(rows, off=0.125)
  with pytest.raises(ValueError, match='at least one row'):
    batching_runs.errors_table([], off=0.1)
  for name, run in runs:
    (tmp_path / f'{name}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in run))
  assert batching_runs.main(['--tables', str(tmp_path / 'a.jsonl'),
                             str(tmp_path / 'b.jsonl')]) == 0
  assert 'quotient 1.250' in capsys.readouterr().out
  assert batching_runs.main(['--tables', str(tmp_path / 'c.jsonl')]) == 1
  assert 'nothing to compare' in capsys.readouterr().out
  for args, message in ((['--tables', '--off', '1.5'], r'--off must be in \(0, 1\), got 1.5'),
                        (['--tables', '--aim', '0.9'], '--aim applies to the fractions'),
                        (['--off', '0.2'], '--off applies to --tables only'),
                        (['--tables', str(tmp_path / 'b.jsonl')], 'b.jsonl.* again')):
    with pytest.raises(SystemExit):
      batching_runs.main(args + [str(tmp_path / 'b.jsonl')])
    assert re.search(message, capsys.readouterr().err), message


@pytest.mark.parametrize('field,value', [
    ('idle_round_cost', float('nan')), ('idle_round_cost', -1.5), ('idle_round_cost', '1.5'),
    ('idle_round_cost', True), ('idle_round_cost', 0.0),
    ('warmup_step_costs', {'0': 0.001, '1': float('inf')}),
    ('warmup_step_costs', {'0': '0.001', '1': 0.002})])
def test_tables_name_a_value_that_is_not_a_positive_number(tmp_path, capsys, field, value):
  run = _with_tables(_run(99.0, 110.0), 1.5, 1.5)
  for r in run:
    if field in r:
      r[field] = value
  with pytest.raises(ValueError, match=f"r: case 'batch_size=2' setting .*{field}"):
    batching_runs.table_errors([('r', run)])
  path = tmp_path / 'r.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in run))
  with pytest.raises(SystemExit):
    batching_runs.main(['--tables', str(path)])
  assert 'must be a finite number in (0.0, inf)' in capsys.readouterr().err


def test_tables_keep_sweep_cases_apart_and_refuse_two_static_k1_settings():
  first = _with_tables(_run(99.0, 110.0), 1.5, 1.5)
  second = _with_tables(_run(99.0, 110.0), 2.0, 1.6)
  for r in second:
    r['case_id'] = 'batch_size=2,rerun'
  rows, _ = batching_runs.table_errors([('s', first + second)])
  assert [(r['case'], r['quotient']) for r in rows] == [
      ('batch_size=2', pytest.approx(1.0)), ('batch_size=2,rerun', pytest.approx(1.25))]
  # Of two static K = 1 settings the study's k1; without one the case is left out, said so.
  other = [dict(r, setting='k1b', idle_round_cost=3.0) for r in first if r['setting'] == 'k1']
  rows, left = batching_runs.table_errors([('s', first + other)])
  assert [r['idle'] for r in rows] == [1.5] and not left
  renamed = [dict(r, setting='k1a') if r['setting'] == 'k1' else r for r in first]
  rows, left = batching_runs.table_errors([('s', renamed + other)])
  assert not rows and left == ["s case 'batch_size=2': static K = 1 settings ['k1a', 'k1b'], "
                               "none named k1"]
  lookup = [dict(r, setting='ngram1', drafter='ngram', idle_round_cost=0.5)
            for r in first if r['setting'] == 'k1']
  assert [r['idle'] for r in batching_runs.table_errors([('s', first + lookup)])[0]] == [1.5]


def test_a_run_given_twice_is_refused(tmp_path, capsys):
  (tmp_path / 'r').mkdir()
  (tmp_path / 'r' / 'results.jsonl').write_text(
      ''.join(json.dumps(r) + '\n' for r in _run(99.0, 110.0)))
  with pytest.raises(SystemExit):
    batching_runs.main([str(tmp_path / 'r'), str(tmp_path / 'r' / 'results.jsonl')])
  assert 'again: give each run once' in capsys.readouterr().err
