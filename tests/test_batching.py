"""Tests for the batching study: settings parser, α-threshold math, summary from records."""

import json
import math
import pathlib
import statistics
import types

import pytest

from experiments import batching, batching_report as br, batching_settings
from experiments import report
from jaxspec.decoding import SamplingParams


# ------------------------------------------------------------------ settings


def test_parse_settings_gives_engine_kwargs_with_typed_values():
  got = batching.parse_settings(
      'k0=k:0; k4 = k:4 ,chunk_size:128;pc=k:2,prefix_caching:false;plain=chunk_size:32;'
      'rows=decode_buckets:8/2/1;one=decode_buckets:8/')
  assert got == {'k0': {'k': 0}, 'k4': {'k': 4, 'chunk_size': 128},
                 'pc': {'k': 2, 'prefix_caching': False}, 'plain': {'chunk_size': 32, 'k': 0},
                 'rows': {'decode_buckets': (8, 2, 1), 'k': 0},
                 'one': {'decode_buckets': (8,), 'k': 0}}
  assert batching.baseline_name(got) == 'k0'
  assert batching.uses_draft_model(got['k4']) and not batching.uses_draft_model(got['k0'])
  assert batching.describe(got['k4']) == dict(k=4, drafter='model', k_policy='fixed',
                                              k_policy_options='', drafter_options='')
  assert batching.describe(got['k0'])['drafter'] == 'none'


@pytest.mark.parametrize('text, named', [
    ('k0=k:0;bad=kk:3', "'bad'"),               # not an Engine argument
    ('k0=k:0;x=draft:foo', "'x'"),              # set by the experiment itself
    ('k0=k:0;neg=k:-1', "'neg'"),               # k < 0
    ('k0=k:0;half=k:1.5', "'half'"),            # k not an int
    ('k0=k:0;nocolon=k4', "'nocolon'"),         # not key:value
    ('k0=k:0;k0=k:1', "'k0'"),                  # repeated name
    ('k0=k:0;twice=k:1,k:2', "'twice'"),        # repeated key
    ('k0:0', "'k0:0'"),                         # no '='
    ('k0=k:0;d=k:0,drafter.probe_every:4', "'d': drafter options .* at k = 0"),   # no drafter
    ('k0=k:0;d=k:2,drafter.1st:4', "'d': 'drafter.1st' is not drafter.OPTION"),
    (' ; ', 'no settings'),
    ('k2=k:2;k4=k:4', 'no K = 0 baseline'),
    ('k0=k:0;s=k:2,sampling:0.7', "'s': 'sampling' is set by the experiment"),
    ('k0=k:0;n=num_slots:4', "--config.batch_size"),
    ('k0=k:0;o=k:8,k_policy.spec_confidence:true', "'o': k_policy options .* without"),
    ('k0=k:0;o=k:8,k_policy:goodput,k_policy.:1', "'o': 'k_policy.' is not k_policy.OPTION"),
])
def test_bad_setting_raises_value_error_naming_it(text, named):
  with pytest.raises(ValueError, match=named):
    batching.parse_settings(text)


def test_rotation_puts_every_setting_first_once():
  names = ['a', 'b', 'c']
  firsts = [batching.rotated(names, r)[0] for r in range(3)]
  assert sorted(firsts) == names and batching.rotated(names, 4) == ['b', 'c', 'a']


# ------------------------------------------------------------------ threshold math


def test_expected_tokens_matches_the_series_and_limits():
  for alpha in (0.0, 0.3, 0.8, 0.999):
    for k in (0, 1, 4):
      assert br.expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))
  assert br.expected_tokens(1.0, 4) == 5.0
  for bad in (-0.1, 1.1):
    with pytest.raises(ValueError, match='α'):
      br.expected_tokens(bad, 2)
  with pytest.raises(ValueError, match='K'):
    br.expected_tokens(0.5, -1)


def test_cost_one_everywhere_means_alpha_star_zero_and_largest_k_best():
  costs = {0: 1.0, 1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
  assert br.threshold(costs) == (0.0, 1)
  assert br.best_k(costs, 0.5) == 8          # free rounds: the longest draft wins for any α > 0
  assert br.best_k(costs, 0.0) == 0          # nothing accepted: every K ties with K = 0


def test_alpha_to_pay_solves_tau_equals_cost():
  # K = 1: τ = 1 + α, so cost 1.5 is paid above α = 0.5; K = 2: 1 + α + α² = 1.75 at α = 0.5.
  assert br.alpha_to_pay(1.5, 1) == pytest.approx(0.5, abs=1e-7)
  assert br.alpha_to_pay(1.75, 2) == pytest.approx(0.5, abs=1e-7)
  assert br.alpha_to_pay(0.9, 4) == 0.0
  assert br.alpha_to_pay(2.0, 1) == math.inf    # K = 1 emits < 2 tokens for every α < 1
  with pytest.raises(ValueError, match='cost'):
    br.alpha_to_pay(float('nan'), 2)
  with pytest.raises(ValueError, match='K'):
    br.alpha_to_pay(1.5, 0)


def test_threshold_and_best_k_on_a_known_cost_table():
  # K=1 pays above 0.6, K=2 above the root of 1+α+α² = 2.2 (α ≈ 0.6954), K=4 never (c = 6).
  costs = {0: 1.0, 1: 1.6, 2: 2.2, 4: 6.0}
  alpha, k = br.threshold(costs)
  assert (alpha, k) == (pytest.approx(0.6, abs=1e-7), 1)
  assert br.best_k(costs, 0.5) == 0            # below α*: no speculation
  assert br.best_k(costs, 0.7) == 1            # 1.7/1.6 = 1.0625 > (1+.7+.49)/2.2 = 0.995
  assert br.best_k(costs, 0.9) == 2            # 2.71/2.2 = 1.23 > 1.9/1.6 = 1.19
  assert br.threshold({0: 1.0, 1: 3.0}) == (math.inf, None)


# ------------------------------------------------------------------ summary from records


def _record(b, workload, setting, k, repeat, tps, round_s, alpha=None, policy='fixed',
            drafter=None, base=None):
  drafter = drafter or ('model' if k else 'none')
  tau = br.expected_tokens(alpha, k) if alpha is not None else 1.0
  rec = dict(case_id=f'batch_size={b}', batch_size=b, workload=workload, setting=setting, k=k,
             drafter=drafter, k_policy=policy, repeat=repeat, tokens_per_s=tps, round_s=round_s,
             decode_tokens_per_s=tps, acceptance_rate=alpha, mean_accepted_length=tau,
             ttft_s=0.01, tpot_s=0.002)
  base = base or (tps, round_s)
  rec.update(speedup=tps / base[0], decode_speedup=tps / base[0], round_cost=round_s / base[1])
  return rec


def _records():
  """B = 1: rounds at K = 2 cost 1.5× a plain one; B = 8: 3×. Two workloads, two repeats."""
  out = []
  for b, c in ((1, 1.5), (8, 3.0)):
    for workload, alpha in (('json', 0.4), ('retrieval', 0.9)):
      for repeat in (0, 1):
        base = (100.0 * b, 0.01)
        out.append(_record(b, workload, 'k0', 0, repeat, *base))
        tps2 = base[0] * br.expected_tokens(alpha, 2) / c
        out.append(_record(b, workload, 'k2', 2, repeat, tps2, 0.01 * c, alpha, base=base))
        out.append(_record(b, workload, 'goodput', 8, repeat, 0.9 * max(tps2, base[0]), 0.02,
                           alpha, policy='goodput', base=base))
  return out


def test_analyze_recovers_costs_thresholds_predictions_and_adaptive_fraction():
  result = br.analyze(_records())
  assert result['costs'] == {1: {0: 1.0, 2: pytest.approx(1.5)}, 8: {0: 1.0, 2: pytest.approx(3.0)}}
  rows = {t['batch_size']: t for t in result['thresholds']}
  # 1 + α + α² = 1.5 -> α = (-1 + sqrt(3)) / 2; = 3 -> α = 1.
  assert rows[1]['alpha_star'] == pytest.approx((math.sqrt(3) - 1) / 2, abs=1e-7)
  assert rows[1]['k_at_threshold'] == 2 and rows[1]['best_k_at_0.5'] == 2   # 1.75 > 1.5
  assert rows[1]['best_k_at_0.9'] == 2
  assert rows[8]['alpha_star'] == math.inf and rows[8]['best_k_at_0.9'] == 0
  k2 = [r for r in result['settings'] if r['setting'] == 'k2']
  for r in k2:     # the synthetic speedups follow the model exactly
    assert r['predicted_speedup'] == pytest.approx(r['speedup'])
  assert result['validation']['iid_alpha']['median'] == pytest.approx(1.0)
  assert result['validation']['measured_tau']['rows'] == 4
  goodput = [r for r in result['settings'] if r['setting'] == 'goodput']
  assert all('predicted_speedup' not in r for r in goodput)   # adaptive K: no single K to model
  assert len(result['adaptive']) == 4
  assert [a['fraction_of_best_static'] for a in result['adaptive']] == [pytest.approx(0.9)] * 4
  best = {(a['batch_size'], a['workload']): a['best_static'] for a in result['adaptive']}
  assert best[(1, 'retrieval')] == 'k2' and best[(8, 'json')] == 'k0'
  assert all(a['per_pass'] == [pytest.approx(0.9)] * 2 for a in result['adaptive'])
  assert all(a['per_pass_se'] == pytest.approx(0.0, abs=1e-12) for a in result['adaptive'])


def test_analyze_gives_the_fraction_of_greedy_passes_matching_k0_and_the_table_shows_it():
  """matches_baseline per (B, workload, setting): the fraction of its passes whose greedy tokens
  equalled the K = 0 engine's (one of two: 0.5); None where no record checked (the baseline,
  records from before the field)."""
  records = _records()
  for r in records:
    if r['setting'] == 'k2':
      r['matches_baseline'] = not (r['batch_size'] == 8 and r['repeat'] == 1)
    elif r['setting'] == 'k0':
      r['matches_baseline'] = None
  result = br.analyze(records)
  got = {(r['batch_size'], r['workload'], r['setting']): r['matches_baseline']
         for r in result['settings']}
  assert got[(1, 'json', 'k2')] == 1.0 and got[(8, 'retrieval', 'k2')] == 0.5
  assert got[(1, 'json', 'k0')] is None and got[(1, 'json', 'goodput')] is None
  md = br.markdown(result)
  assert '| = K0 |' in md and '| 0.50 |' in md


def test_adaptive_fraction_pass_by_pass_pairs_records_by_repeat():
  # Pass 1 ran 20 % slower for every setting (the machine's load): the paired ratios see
  # goodput at 0.8 and 1.0 of k0 in its two passes, whatever each pass's speed.
  records = [_record(4, 'json', 'k0', 0, 1, 100.0, 0.01),
             _record(4, 'json', 'k0', 0, 0, 125.0, 0.01),
             _record(4, 'json', 'goodput', 8, 0, 100.0, 0.01, 0.5, policy='goodput'),
             _record(4, 'json', 'goodput', 8, 1, 100.0, 0.01, 0.5, policy='goodput')]
  [a] = br.analyze(records)['adaptive']
  assert a['best_static'] == 'k0' and a['fraction_of_best_static'] == pytest.approx(200 / 225)
  assert a['per_pass'] == [pytest.approx(0.8), pytest.approx(1.0)]
  assert a['per_pass_se'] == pytest.approx(0.1)                # sd 0.1414 / sqrt(2)
  assert '| 0.80 1.00 | 0.10 |' in br.markdown(br.analyze(records))
  [one] = br.analyze(records[1:3])['adaptive']                # one pass each: no spread
  assert one['per_pass'] == [pytest.approx(0.8)] and one['per_pass_se'] is None
  # A pass the best static ran twice (records appended again) or without a repeat: unpaired.
  again = records + [_record(4, 'json', 'k0', 0, 1, 90.0, 0.01)]
  assert br.analyze(again)['adaptive'][0]['per_pass'] == [pytest.approx(0.8)]
  bare = [{k: v for k, v in r.items() if k != 'repeat'} for r in records[1:3]]
  assert br.analyze(bare)['adaptive'][0]['per_pass'] == []
  # Two sweep cases of one B (a sweep over prompt_len too) were averaged as one cell's repeats.
  mixed = [dict(r, case_id='batch_size=4') for r in records] + [
      dict(records[0], case_id='batch_size=4,prompt_len=128')]
  with pytest.raises(ValueError, match=r"B=4 json 'k0' has records of sweep cases .*"
                                       r"'batch_size=4', None.* and .*'batch_size=4,prompt_len"):
    br.analyze(mixed)
  # Records of one case at different temperatures (two runs appended): not one cell either.
  hot = [dict(r, temperature=0.0) for r in records] + [dict(records[0], temperature=1.0)]
  with pytest.raises(ValueError, match=r"0.0, None, None\) and \('batch_size=4', 1.0"):
    br.analyze(hot)


def test_held_out_fraction_chooses_the_static_setting_on_the_other_passes():
  # k2 is best on average (106.7 against 100) only through passes 0 and 1; chosen without the
  # pass it is scored on, pass 2's choice is k2 (130 on passes 0-1) and passes 0-1's is k0
  # (k2 95 on the other two).
  tps = {'k0': [100.0] * 3, 'k2': [130.0, 130.0, 60.0], 'goodput': [100.0] * 3}
  records = [_record(2, 'code', name, {'k0': 0, 'k2': 2, 'goodput': 8}[name], repeat, t, 0.01,
                     policy='goodput' if name == 'goodput' else 'fixed')
             for name, values in tps.items() for repeat, t in enumerate(values)]
  [a] = br.analyze(records)['adaptive']
  assert a['best_static'] == 'k2' and a['fraction_of_best_static'] == pytest.approx(300 / 320)
  assert a['held_out'] == pytest.approx((1.0 + 1.0 + 100 / 60) / 3)
  assert '| 1.22 |' in br.markdown(br.analyze(records))
  one = [r for r in records if r['repeat'] == 0]
  assert br.analyze(one)['adaptive'][0]['held_out'] is None


def test_passes_an_adaptive_policy_ran_at_k0_only_measure_its_cost_and_the_noise():
  # goodput ran K = 0 in every round of passes 0 and 2 of json and pass 0 of code (0.98, 1.02,
  # 0.96 of k0's tokens/s in those passes: mean 0.987); pass 1 of json and pass 1 of code
  # speculated, and a pass without rounds counts as neither. k0's speed differs pass to pass.
  rounds = {('json', 0): {'0': 62}, ('json', 1): {'0': 10, '2': 20}, ('json', 2): {0: 62},
            ('code', 0): {'0': 62, '2': 0}, ('code', 1): {'1': 30}, ('code', 2): {}}
  k0_tps = {0: 100.0, 1: 90.0, 2: 120.0}
  ratio = {('json', 0): 0.98, ('json', 2): 1.02, ('code', 0): 0.96}
  records = []
  for (workload, repeat), by_k in rounds.items():
    records.append(_record(4, workload, 'k0', 0, repeat, k0_tps[repeat], 0.01))
    tps = k0_tps[repeat] * ratio.get((workload, repeat), 1.1)
    records.append(dict(_record(4, workload, 'goodput', 8, repeat, tps, 0.01, 0.5,
                                policy='goodput'), rounds_by_k=by_k))
  [row] = br.analyze(records)['at_k0']
  assert (row['batch_size'], row['setting'], row['passes'], row['of']) == (4, 'goodput', 3, 6)
  assert row['mean'] == pytest.approx((0.98 + 1.02 + 0.96) / 3)
  assert row['sd'] == pytest.approx(statistics.stdev([0.98, 1.02, 0.96]))
  assert '| 4 | goodput | 3 of 6 | 0.987 | 0.031 |' in br.markdown(br.analyze(records))
  # A pass appended twice is no pass (as for the fractions); a round count under a key that is
  # no K makes a pass not K = 0-only, not an error.
  twice = records + [dict(records[1], tokens_per_s=1.0)]
  assert [(r['passes'], r['of']) for r in br.analyze(twice)['at_k0']] == [(2, 5)]
  odd = [dict(r, rounds_by_k={'0': 60, 'x': 2}) if r['setting'] == 'goodput' and
         r['repeat'] == 0 and r['workload'] == 'json' else r for r in records]
  assert br.analyze(odd)['at_k0'][0]['passes'] == 2
  # Two K = 0 settings in a cell (other engine arguments): which one is the base is unclear.
  other = records + [dict(r, setting='k0big') for r in records if r['setting'] == 'k0']
  assert br.analyze(other)['at_k0'] == []
  # Without a K = 0 setting, or when the policy always speculated: nothing to report.
  assert br.analyze([r for r in records if r['setting'] != 'k0'])['at_k0'] == []
  assert br.analyze([r for r in records if r['repeat'] == 1])['at_k0'] == []
  assert 'at K = 0 only' not in br.markdown(br.analyze([r for r in records if r['repeat'] == 1]))


def test_records_without_a_fixed_k_say_why_there_is_no_threshold():
  records = [r for r in _records() if r['setting'] != 'k2']      # K = 0 and goodput only
  result = br.analyze(records)
  assert result['thresholds'] == [] and result['costs'] == {}
  text = br.markdown(result)
  assert 'no threshold' in text and '| B | α* |' not in text
  assert '## Adaptive policies' in text                          # the rest is still written
  # No records at all (a sweep whose cases all failed) said to add a K >= 1 setting.
  text = br.markdown(br.analyze([]))
  assert 'No batching records to analyse' in text and 'no threshold' not in text


def test_summary_from_a_results_file_through_the_report_cli(tmp_path):
  path = tmp_path / 'results.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in _records()))
  (tmp_path / 'config.json').write_text(json.dumps({'experiment': 'batching'}))
  from experiments.records import read_results
  records = read_results(path)
  pngs = report.plot(records, tmp_path / 'plots', 'batching')
  files = report.experiment_summary(records, tmp_path, report.guess_experiment(path))
  assert sorted(p.name for p in pngs) == ['alpha_threshold_vs_batch.png', 'speedup_vs_batch.png']
  assert all(p.stat().st_size > 1000 for p in pngs)
  md = (tmp_path / 'threshold.md').read_text()
  assert '| 1 | 0.37 | 2 | 2 |' in md and '| 8 | never |' in md
  assert '## Measured: workload retrieval' in md and '## Adaptive policies' in md
  assert 'predicted τ(α, K) / c (i.i.d. α): median 1.00, range 1.00–1.00 over 4' in md
  data = json.loads((tmp_path / 'threshold.json').read_text())
  assert data['thresholds'][1]['alpha_star'] is None        # never pays: null in JSON
  assert [p.name for p in files] == ['threshold.md', 'threshold.json']


# ------------------------------------------------------------------ one measured run


def test_measure_times_only_decode_only_steps_and_counts_every_token(tiny):
  """3 requests of 12 tokens, 2 slots, chunk 8, 5 tokens each: steps 1-2 prefill requests 0 and
  1 (the first token comes with the last chunk), decode rounds follow until both finish, then
  request 2 prefills in 2 steps and decodes alone. Exactly the steps without a prefill chunk
  are timed as rounds; every emitted token is counted; two engines stepped in turn each get
  their own clock. No warm_up: the first steps compile, which only slows this run."""
  from jaxspec.engine import Engine
  config, params = tiny
  engine = Engine(config, params, num_slots=2, num_pages=32, page_size=8, chunk_size=8)
  twin = Engine(config, params, num_slots=2, num_pages=32, page_size=8, chunk_size=8)
  engines = {'a': (engine, batching.StepKinds(engine)), 'b': (twin, batching.StepKinds(twin))}
  prompts = [list(range(3 + i, 15 + i)) for i in range(3)]
  steps_before = engine.num_steps
  both = batching.measure(engines, prompts, max_tokens=5, stop_tokens=())   # stepped in turn
  steps = engine.num_steps - steps_before
  assert twin.num_steps == steps == 12
  for m in both.values():
    assert m['num_requests'] == 3 and m['tokens'] == 15
    assert m['decode_steps'] == steps - 4 and m['prefill_steps'] == 4   # 2 per wave
    assert (m['decode_steps'], m['mean_accepted_length'], m['acceptance_rate']) == (8, 1.0, None)
    assert m['round_s'] > 0 and m['tokens_per_s'] == pytest.approx(15 / m['engine_s'])
    assert 0 < m['ttft_s'] < m['engine_s'] and m['tpot_s'] > 0 and m['rounds_by_k'] == {'0': 8}
    assert [len(t) for t in m['outputs']] == [5, 5, 5]          # in prompt order
  assert both['a']['outputs'] == both['b']['outputs']             # one model, greedy
  assert not engine.outputs and not twin.outputs
  idle = batching.idle_round_costs(engines, {'a': {'k': 0}, 'b': {'k': 0}}, 'a', rounds=3)
  assert idle['a'][1] == 1.0 and idle['b'][0] > 0 and idle['b'][1] > 0


def test_measure_shuffles_the_step_order_every_round_reproducibly(tiny):
  """Engines stepped in turn follow one another in an order shuffled per round (a fixed cyclic
  order gave each setting the same predecessor every round, whose cache footprint its step
  paid for). Two 2-slot engines and a 1-slot one, which needs more steps for the same 3
  requests: while all three run, every round steps each once and over those rounds each follows
  both others; then the 1-slot engine steps alone. The same seed gives the same orders, another
  seed others, and no engine's results depend on them."""
  from jaxspec.engine import Engine
  config, params = tiny
  prompts = [list(range(3 + i, 15 + i)) for i in range(3)]

  def run(seed):
    engines, steps = {}, []
    for name, slots in (('a', 2), ('b', 2), ('c', 1)):
      engine = Engine(config, params, num_slots=slots, num_pages=32, page_size=8, chunk_size=8)
      step = engine.step
      engine.step = lambda step=step, name=name: steps.append(name) or step()
      engines[name] = (engine, batching.StepKinds(engine))
    runs = batching.measure(engines, prompts, max_tokens=5, stop_tokens=(), seed=seed)
    results = {n: (m['tokens'], m['decode_steps'], m['prefill_steps']) for n, m in runs.items()}
    return ''.join(steps), results

  steps, results = run(0)
  together, alone = steps[:36], steps[36:]
  rounds = [together[i:i + 3] for i in range(0, 36, 3)]
  assert all(sorted(r) == ['a', 'b', 'c'] for r in rounds)
  assert len(alone) > 0 and set(alone) == {'c'}           # a and b finished after 12 steps
  # Seed 0 shows every ordered pair in these 12 rounds (a given seed misses one ~5 % of the time).
  followed = {(r[i], r[i + 1]) for r in rounds for i in range(2)}
  assert followed == {(x, y) for x in 'abc' for y in 'abc' if x != y}
  again, same = run(0)
  other, results_other = run(1)
  assert again == steps and other != steps and same == results == results_other


def _stub_study(monkeypatch, make_prompts=None):
  """Stub out what `batching.run` loads and builds: the model pair, the prompts (by default one
  of 3 tokens per pass) and the engines (one stand-in shared by every setting)."""
  engine = types.SimpleNamespace(step_costs={})
  monkeypatch.setattr(batching, 'load_pair', lambda c: (None, None, None, None,
                                                        types.SimpleNamespace(eos_ids=())))
  monkeypatch.setattr(batching, 'make_prompts', make_prompts or (lambda *a, **k: [
      types.SimpleNamespace(tokens=[1, 2, 3])]))
  monkeypatch.setattr(batching, 'build_engines', lambda c, settings, *a: {
      n: (engine, None) for n in settings})


def test_run_gives_each_repeat_and_workload_its_own_step_order(monkeypatch):
  """`run` seeds `measure`'s per-round shuffles per (repeat, workload), so the passes of a sweep
  do not all replay one sequence of orders (with the model, engines and runs stubbed out)."""
  from configs import batching as batching_config
  config = batching_config.get_config('smoke')
  config.workloads, config.repeats, config.cost_rounds = 'json,code', 2, 0
  _stub_study(monkeypatch)
  seeds = []

  def measure(engines, prompts, *, max_tokens, stop_tokens, seed=0):
    if max_tokens == int(config.max_tokens):        # a timed pass, not the warm-up
      seeds.append(seed)
    return {n: dict(tokens_per_s=1.0, decode_tokens_per_s=1.0, round_s=1.0) for n in engines}
  monkeypatch.setattr(batching, 'measure', measure)
  written = []
  batching.run(config, types.SimpleNamespace(write=written.append))
  assert seeds == [0, 1, 2, 3] and len(written) == 4 * 2          # 2 repeats x 2 workloads
  assert {(r['temperature'], r['top_k'], r['top_p']) for r in written} == {(0.0, 0, 1.0)}


@pytest.mark.parametrize('new_prompts, seeds', [(True, [7, 7, 8, 8]), (False, [7, 7, 7, 7])])
def test_run_draws_new_prompts_for_every_repeat_unless_told_not_to(monkeypatch, new_prompts,
                                                                   seeds):
  """Each repeat submits its own draw of held-out prompts (`prompt_seed`: config.seed + repeat),
  every setting of a pass the same ones, and its records name the seed; with new_prompts False
  every pass reruns config.seed's (models, engines and runs stubbed out)."""
  from configs import batching as batching_config
  config = batching_config.get_config('smoke')
  config.workloads, config.repeats, config.cost_rounds = 'json,code', 2, 0
  config.seed, config.new_prompts = 7, new_prompts
  _stub_study(monkeypatch, lambda w, tok, n, length, split, seed: [
      types.SimpleNamespace(tokens=[seed, len(w)])])
  submitted = []

  def measure(engines, prompts, *, max_tokens, stop_tokens, seed=0):
    if max_tokens == int(config.max_tokens):        # a timed pass, not the warm-up
      submitted.append(prompts[0][0])
    return {n: dict(tokens_per_s=1.0, decode_tokens_per_s=1.0, round_s=1.0) for n in engines}
  monkeypatch.setattr(batching, 'measure', measure)
  written = []
  batching.run(config, types.SimpleNamespace(write=written.append))
  assert submitted == seeds
  assert [r['prompt_seed'] for r in written] == [s for s in seeds for _ in range(2)]


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_run_records_whether_each_greedy_setting_emitted_the_baselines_tokens(monkeypatch,
                                                                             temperature):
  """At temperature 0 every record but the baseline's says whether its requests' tokens equal
  the K = 0 baseline's in the same pass (one differing request makes it false); when sampling,
  and for the baseline, it is None. The token lists themselves stay out of the records."""
  from configs import batching as batching_config
  config = batching_config.get_config('smoke')
  config.settings, config.cost_rounds = 'k0=k:0;same=k:2;differs=k:2', 0
  config.temperature = temperature
  _stub_study(monkeypatch)
  outputs = {'k0': [[4, 5], [6]], 'same': [[4, 5], [6]], 'differs': [[4, 5], [7]]}

  def measure(engines, prompts, *, max_tokens, stop_tokens, seed=0):
    return {n: dict(tokens_per_s=1.0, decode_tokens_per_s=1.0, round_s=1.0,
                    outputs=outputs[n]) for n in engines}
  monkeypatch.setattr(batching, 'measure', measure)
  written = []
  batching.run(config, types.SimpleNamespace(write=written.append))
  got = {r['setting']: r['matches_baseline'] for r in written}
  greedy = temperature == 0
  assert got == {'k0': None, 'same': True if greedy else None,
                 'differs': False if greedy else None}
  assert not any('outputs' in r for r in written)


def test_run_records_a_calibrating_policys_factor_and_none_for_the_others(monkeypatch):
  """`calibration`, `calibration_rounds`: the goodput policy's realized-over-predicted factor
  and its K >= 1 rounds after the pass when it calibrates, None for a policy that does not and
  for an engine without a policy."""
  from configs import batching as batching_config
  from jaxspec.engine.goodput import GoodputK
  config = batching_config.get_config('smoke')
  config.settings, config.cost_rounds = 'k0=k:0;cal=k:2;plain=k:2', 0
  _stub_study(monkeypatch)
  calibrating = GoodputK(calibrate=True)
  calibrating.calibration.expect(tokens=4.0, seconds=1.0)
  calibrating.calibration.outcome(2)
  calibrating.calibration.round(1, 1.0)
  policies = {'k0': None, 'cal': calibrating, 'plain': GoodputK()}
  monkeypatch.setattr(batching, 'build_engines', lambda c, settings, *a: {
      n: (types.SimpleNamespace(step_costs={}, policy=policies[n]), None) for n in settings})
  monkeypatch.setattr(batching, 'measure', lambda engines, *a, **k: {
      n: dict(tokens_per_s=1.0, decode_tokens_per_s=1.0, round_s=1.0) for n in engines})
  written = []
  batching.run(config, types.SimpleNamespace(write=written.append))
  got = {r['setting']: (r['calibration'], r['calibration_rounds']) for r in written}
  assert got == {'k0': (None, None), 'cal': (calibrating.calibration.factor, 1),
                 'plain': (None, None)}
  assert got['cal'][0] < 1.0


def test_cost_sources_steps_by_default_idle_on_request_the_other_beside_it():
  records = _records()
  for r in records:
    r['idle_round_cost'] = {0: 1.0, 2: 1.2}.get(r['k']) if r['k_policy'] == 'fixed' else None
  records[1]['idle_round_cost'] = 50.0        # one disturbed run: the median ignores it
  result = br.analyze(records, source='idle')
  assert result['cost_source'] == 'idle'
  assert result['costs'][1][2] == pytest.approx(1.2) and result['costs'][8][2] == pytest.approx(1.2)
  rows = {t['batch_size']: t for t in result['thresholds']}
  assert rows[8]['alpha_star'] < 0.2 and rows[8]['alpha_star_other'] == math.inf
  assert rows[8]['cost_other_k2'] == pytest.approx(3.0)
  assert '| 8 | 0.17 (never) |' in br.markdown(result)
  default = br.analyze(records)             # the decode-only steps, idle rounds in brackets
  assert default['cost_source'] == 'steps' and default['costs'][8][2] == pytest.approx(3.0)
  assert '| 8 | never (0.17) |' in br.markdown(default)
  with pytest.raises(ValueError, match="'wall'"):
    br.cost_table(records, 'wall')


def test_equivalent_alpha_inverts_tau():
  assert br.equivalent_alpha(br.expected_tokens(0.7, 4), 4) == pytest.approx(0.7, abs=1e-7)
  assert br.equivalent_alpha(5.0, 4) == 1.0 and br.equivalent_alpha(1.0, 4) == 0.0


def test_an_engine_refusing_a_setting_names_the_setting(tiny, tiny_draft):
  import importlib.util
  path = pathlib.Path(__file__).parent.parent / 'configs' / 'batching.py'
  spec = importlib.util.spec_from_file_location('batching_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config('smoke')
  settings = batching.parse_settings('odd=k:2,k_policy:bogus;k0=k:0')   # fails before compiling
  with pytest.raises(ValueError, match="setting 'odd'.*bogus"):
    batching.build_engines(config, settings, *tiny, *tiny_draft)


def test_k_policy_options_build_each_engine_its_own_configured_policy():
  got = batching.parse_settings('k0=k:0;gp=k:8,k_policy:goodput,k_policy.spec_confidence:true,'
                                'k_policy.candidates:0/2/4,k_policy.spec_margin:0.1')
  assert got['gp']['k_policy.spec_confidence'] is True
  assert batching.describe(got['gp']) == dict(   # the records tell option-only settings apart
      k=8, drafter='model', k_policy='goodput',
      k_policy_options='candidates=0/2/4,spec_confidence=True,spec_margin=0.1',
      drafter_options='')
  first, second = (batching_settings.engine_kwargs(got['gp'])['k_policy'] for _ in range(2))
  assert first is not second                     # one instance per engine (each keeps state)
  assert (first.wants_spec_confidences, first.spec_margin) == (True, 0.1)
  assert 'k_policy.spec_confidence' not in batching_settings.engine_kwargs(got['gp'])
  assert batching_settings.engine_kwargs(got['k0']) == {'k': 0}


def test_drafter_options_build_each_engine_its_own_configured_drafter():
  got = batching.parse_settings('k0=k:0;gpf=k:8,k_policy:goodput,drafter.fill_prefill:true,'
                                'drafter.probe_budget:none,drafter.probe_rows:2;'
                                'ng=k:4,drafter:ngram,drafter.max_ngram:5;odd=k:2,drafter:none')
  assert got['gpf']['drafter.probe_budget'] is None           # an option's 'none' is None
  assert got['odd']['drafter'] == 'none'                      # elsewhere a string (unknown name)
  assert batching.describe(got['gpf'])['drafter_options'] == \
      'fill_prefill=True,probe_budget=None,probe_rows=2'
  first, second = (batching_settings.engine_kwargs(got['gpf'])['drafter'] for _ in range(2))
  assert first is not second                     # one instance per engine
  assert (first.fill_prefill, first.probe_budget, first.probe_rows, first.overlap_choice) == \
      (True, None, 2, True)
  assert not any(key.startswith('drafter.') for key in batching_settings.engine_kwargs(got['gpf']))
  ngram = batching_settings.engine_kwargs(got['ng'])['drafter']
  assert (type(ngram).__name__, ngram.max_ngram) == ('NGramDrafter', 5)


def test_an_engine_built_from_drafter_options_keeps_its_draft_cache_by_them(tiny, tiny_draft):
  from configs import batching as batching_config
  config = batching_config.get_config('smoke')
  settings = batching.parse_settings('k0=k:0;gp=k:2,k_policy:goodput;gpf=k:2,k_policy:goodput,'
                                     'drafter.fill_prefill:true,drafter.overlap_choice:false,'
                                     'drafter.probe_every:3')
  engines = batching_settings.make_engines(config, settings, *tiny, *tiny_draft,
                                           sampling=SamplingParams(), max_seq_len=128,
                                           num_pages=64, admit=False)
  plain, filled = engines['gp'].draft_sync, engines['gpf'].draft_sync
  assert (plain.fill_prefill, plain.overlap_choice, plain.probe_every) == (False, True, 8)
  assert (filled.fill_prefill, filled.overlap_choice, filled.probe_every) == (True, False, 3)


@pytest.mark.parametrize('settings, pool_pages, match', [
    ('k0=k:0;c=k:0,chunk_size:0', 0, r"setting 'c' .*: chunk_size must be an int >= 1, got 0"),
    ('k0=k:0;b=k:2,decode_buckets:3/', 0, r"setting 'b'.*decode_buckets=\(3,\)"),
    ('k0=k:0', 3, r"setting 'k0': a request of the run: .*pool has 2 \(--config.pool_pages=3;"),
    ('k0=k:0;g=k:2,k_policy:goodput,k_policy.spec_confidense:true', 0,
     r"setting 'g'.*no option 'spec_confidense' \(known: .*spec_confidence"),
    ('k0=k:0;g=k:2,k_policy:goodput,k_policy.margin:-1', 0, r"setting 'g'.*margin must be"),
    ('k0=k:0;g=k:2,drafter.probe_evry:4', 0,
     r"setting 'g'.*drafter 'model' has no option 'probe_evry' \(known: .*probe_every"),
    ('k0=k:0;g=k:2,drafter.fill_prefill:2', 0, r"setting 'g'.*fill_prefill must be a bool, got 2"),
    ('k0=k:0;n=k:2,drafter:ngram,drafter.min_ngram:0', 0,
     r"setting 'n'.*min_ngram must be an int >= 1, got 0"),
    ('k0=k:0;f=k:2,drafter.fill_prefill:true', 0,     # a fixed K >= 1 keeps no lazy draft cache
     r"setting 'f'.*drafter options \['fill_prefill'\] act on the lazy draft cache"),
    ('k0=k:0;f=k:2,drafter.probe_every:8', 0,         # named at its default: refused by name
     r"setting 'f': drafter options \['probe_every'\] act on the lazy draft cache, which this "
     r"engine does not keep"),
    ('k0=k:0;f=k:2,k_policy:goodput,drafter.fill_prefill:true,drafter.probe_every:none', 0,
     r"setting 'f'.*fill_prefill=True fills the draft at K = 0 only while probes may run"),
])
def test_validate_refuses_what_the_engine_would_before_any_model_loads(monkeypatch, settings,
                                                                       pool_pages, match):
  """A setting the Engine refuses (or a pool that cannot hold a request of the run) fails the
  config check, before a sweep's first case loads and compiles anything."""
  from configs import batching as batching_config
  config = batching_config.get_config('smoke')
  config.settings, config.pool_pages = settings, pool_pages
  monkeypatch.setattr(batching, 'load_pair', lambda c: pytest.fail('loaded a model'))
  with pytest.raises(ValueError, match=match):
    batching.validate(config)
  config.settings, config.pool_pages = 'k0=k:0;k2=k:2', 0
  batching.validate(config)                      # the smoke config's own settings pass
