"""The α-threshold analysis of the batching study (records of experiments/batching.py).

Model (Leviathan et al. 2023, §3.1, i.i.d. acceptance): a round at speculation length K drafts K
tokens and verifies K + 1 in one target pass, and emits on average

    τ(α, K) = (1 − α^{K+1}) / (1 − α)          tokens per request (τ(1, K) = K + 1)

where α is the probability that a draft token is accepted. A round of a full batch computes all B
slots, so its cost depends on B and K, not on the workload; measured as

    c(B, K) = t_round(B, K) / t_round(B, 0)    (seconds of a decode-only engine step)

(Leviathan et al.'s own c, `jaxspec.eval.expected_speedup`, is a draft step over a target step
at batch 1; here the whole round, K draft steps + one (K + 1)-token verify of B slots, is timed.)

Speculation at (B, K) pays iff τ(α, K) > c(B, K). The threshold α*(B) is the smallest α at which
some K >= 1 pays (0 when a round at some K costs no more than a plain one), and the best K at a
given α maximises τ(α, K) / c(B, K) (K = 0, ratio 1, included). As B grows the verify pass of
B·(K + 1) tokens stops being memory-bound, c grows, and α* rises: the effect behind vLLM's
finding that speculative decoding slows serving at high load, and behind SmartSpec (Liu et al.
2024, goodput-driven K) and TurboSpec (closed-loop K under load) choosing K per step.

    python -m experiments.report runs/batching/sweep/results.jsonl  # threshold.md/json + plots

The sweep runner writes the same after every sweep (`experiments.report.SUMMARIES`).
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
import statistics

from jaxspec.checks import check_int
from jaxspec.eval import expected_tokens_per_round

ALPHAS = (0.5, 0.7, 0.9)  # α values at which the best K is reported


def expected_tokens(alpha: float, k: int) -> float:
  """τ(α, K) = (1 − α^{K+1}) / (1 − α): expected tokens emitted per round per request under
  i.i.d. acceptance at rate α (Leviathan et al. 2023, Eq. 1); K + 1 at α = 1, 1 at K = 0.

  Raises:
    ValueError: α outside [0, 1] or K not an int >= 0.
  """
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f'acceptance rate α must be in [0, 1], got {alpha!r}')
  check_int('K', k, 0)
  return expected_tokens_per_round(alpha, k)


def alpha_to_pay(cost: float, k: int, tol: float = 1e-9) -> float:
  """The smallest α with τ(α, K) > cost, as an infimum: 0 when cost <= 1 (τ(0, K) = 1),
  math.inf when cost >= K + 1 (τ < K + 1 for every α < 1), else the root of τ(α, K) = cost
  (τ increases strictly in α; bisection to `tol`).

  Raises:
    ValueError: K < 1, or a cost that is not a positive finite number.
  """
  check_int('K', k, 1)
  if not (isinstance(cost, (int, float)) and math.isfinite(cost) and cost > 0):
    raise ValueError(f'cost ratio must be a positive finite number, got {cost!r}')
  if cost <= 1.0:
    return 0.0
  if cost >= k + 1:
    return math.inf
  lo, hi = 0.0, 1.0
  while hi - lo > tol:
    mid = (lo + hi) / 2
    if expected_tokens(mid, k) > cost:
      hi = mid
    else:
      lo = mid
  return hi


def equivalent_alpha(tau: float, k: int) -> float:
  """The i.i.d. α whose τ(α, K) equals a measured τ (0 for τ <= 1, 1 for τ >= K + 1): the α to
  hold against α* when acceptances are correlated (copying runs accept in streaks, so the
  measured per-token α understates τ). Raises ValueError for K < 1 or a τ that is not a positive
  finite number."""
  a = alpha_to_pay(tau, k)
  return 1.0 if math.isinf(a) else a


def threshold(costs: dict) -> tuple[float, int | None]:
  """(α*, K reaching it) over costs {K: c(B, K)} of one B: the smallest α at which some K >= 1
  pays; (math.inf, None) when none can (or no K >= 1 was measured). Ties go to the smaller K."""
  best = (math.inf, None)
  for k in sorted(k for k in costs if k >= 1):
    a = alpha_to_pay(costs[k], k)
    if a < best[0]:
      best = (a, k)
  return best


def best_k(costs: dict, alpha: float) -> int:
  """The K maximising predicted speedup τ(α, K) / c(B, K) among the measured K (K = 0, ratio 1,
  always a candidate); ties go to the smaller K."""
  best, value = 0, 1.0
  for k in sorted(k for k in costs if k >= 1):
    v = expected_tokens(alpha, k) / costs[k]
    if v > value + 1e-12:
      best, value = k, v
  return best


def _mean(values):
  values = [float(v) for v in values if v is not None]
  return sum(values) / len(values) if values else None


def _static_model(r: dict) -> bool:
  """A fixed-K record of the draft model or the K = 0 baseline: the cost-table settings."""
  return r.get('k_policy', 'fixed') == 'fixed' and r.get('drafter') in ('model', 'none')


COST_FIELDS = {'idle': 'idle_round_cost', 'steps': 'round_cost'}


def cost_table(records: list[dict], source: str = 'steps') -> dict[int, dict[int, float]]:
  """{B: {K: c(B, K)}} from fixed-K draft-model settings (K = 0 is 1 by definition).

  Args:
    source: 'steps': the per-(repeat, workload) `round_cost` of the decode-only engine steps of
      the runs (what serving pays: device round + the engine's host work per step); 'idle':
      each run's `idle_round_cost` (device rounds on idle rows, the settings interleaved round
      by round: steadier on a loaded machine, but without the host work, which adds the same
      seconds at every K, so it overstates c where host work is a large part of a step, at
      small B). Either is the median over the records of a (B, K), so one disturbed run does
      not move it. A B whose records lack the field gets no entry.
  Raises:
    ValueError: an unknown source.
  """
  if source not in COST_FIELDS:
    raise ValueError(f'unknown cost source {source!r}; expected one of {sorted(COST_FIELDS)}')
  field = COST_FIELDS[source]
  groups = collections.defaultdict(list)
  for r in records:
    if _static_model(r) and r.get(field) is not None and r.get('k') is not None:
      groups[(int(r['batch_size']), int(r['k']))].append(float(r[field]))
  table = collections.defaultdict(dict)
  for (b, k), values in sorted(groups.items()):
    table[b][k] = 1.0 if k == 0 else statistics.median(values)
  return {b: t for b, t in table.items() if any(k >= 1 for k in t)}


def _by_setting(records):
  """{(B, workload, setting): [records]} in first-seen order."""
  groups = collections.defaultdict(list)
  for r in records:
    if r.get('setting') is not None:
      groups[(int(r['batch_size']), r['workload'], r['setting'])].append(r)
  return groups


def _check_one_case(records) -> None:
  """ValueError unless each (B, workload, setting) comes from one sweep case: records of a sweep
  over more than batch_size (other prompt lengths, say) would be averaged as if they were
  repeats of one cell. (Records of one case appended twice are averaged; `_per_pass` leaves
  their passes unpaired.)"""
  case_of = {}
  for r in records:
    if r.get('setting') is None:
      continue
    key = (int(r['batch_size']), r['workload'], r['setting'])
    case = (r.get('case_id'), r.get('temperature'), r.get('top_k'), r.get('top_p'))
    if case_of.setdefault(key, case) != case:
      raise ValueError(f'B={key[0]} {key[1]} {key[2]!r} has records of sweep cases / sampling '
                       f'(case_id, temperature, top_k, top_p) {case_of[key]!r} and {case!r}: the '
                       f'threshold analysis takes a sweep over batch_size only; report the cases '
                       f'apart')


def analyze(records: list[dict], source: str = 'steps') -> dict:
  """The threshold analysis of batching records (any subset of batch sizes and settings).

  Args:
    source: where c(B, K) comes from (`cost_table`); the other source is reported beside it.
  Returns:
    {'cost_source': source, 'costs': {B: {K: c}} from it, 'thresholds': [row per B:
    alpha_star, k_at_threshold, best_k_at_α, per-K cost_kK and alpha_to_pay_kK; where the
    records have the other source too, alpha_star_other and cost_other_kK from it],
    'settings': [row per (B, workload, setting): means over repeats of
    tokens_per_s, speedup, decode_speedup, α, τ, TTFT, TPOT, and for fixed-K draft-model settings
    the model's predicted speedups τ(α, K) / c(B, K) (predicted_speedup) and τ_measured / c(B, K)
    (predicted_from_tau), and alpha_equivalent (see `equivalent_alpha`); matches_baseline: the
    fraction of greedy passes whose tokens equalled the K = 0 engine's, None if none checked],
    'adaptive': [row per (B, workload, non-fixed policy): tokens/s as a fraction of the best
    static setting (K = 0 included), the same pass by pass with its standard error
    (`_per_pass`), and against the static setting chosen on the other passes (`_held_out`)],
    'at_k0': the adaptive settings' passes that ran K = 0 only, over the K = 0 setting's
    (`at_k0`)}. α* is math.inf where no K pays.
  Raises:
    ValueError: records of one (B, workload, setting) from several sweep cases
      (`_check_one_case`).
  """
  _check_one_case(records)
  costs = cost_table(records, source)
  other = cost_table(records, 'idle' if source == 'steps' else 'steps')
  thresholds = []
  for b, table in sorted(costs.items()):
    a, k = threshold(table)
    row = dict(batch_size=b, alpha_star=a, k_at_threshold=k)
    row.update({f'best_k_at_{x}': best_k(table, x) for x in ALPHAS})
    row.update({f'cost_k{k}': c for k, c in sorted(table.items()) if k})
    row.update({f'alpha_to_pay_k{k}': alpha_to_pay(c, k) for k, c in sorted(table.items()) if k})
    if b in other:
      row['alpha_star_other'] = threshold(other[b])[0]
      row.update({f'cost_other_k{k}': c for k, c in sorted(other[b].items()) if k})
    thresholds.append(row)
  rows = []
  groups = _by_setting(records)
  for (b, workload, setting), rs in groups.items():
    row = dict(batch_size=b, workload=workload, setting=setting, k=rs[0].get('k'),
               drafter=rs[0].get('drafter'), k_policy=rs[0].get('k_policy'), repeats=len(rs))
    for f in ('tokens_per_s', 'speedup', 'decode_speedup', 'round_cost', 'acceptance_rate',
              'mean_accepted_length', 'ttft_s', 'tpot_s'):
      row[f] = _mean(r.get(f) for r in rs)
    checked = [r['matches_baseline'] for r in rs if r.get('matches_baseline') is not None]
    row['matches_baseline'] = sum(map(bool, checked)) / len(checked) if checked else None
    k, alpha, c = row['k'], row['acceptance_rate'], costs.get(b, {}).get(row['k'])
    if _static_model(rs[0]) and k and alpha is not None and c:
      row['cost'] = c
      row['predicted_speedup'] = expected_tokens(min(max(alpha, 0.0), 1.0), int(k)) / c
      tau = row['mean_accepted_length']
      if tau is not None:
        row['predicted_from_tau'] = tau / c
        row['alpha_equivalent'] = equivalent_alpha(tau, int(k))
    rows.append(row)
  adaptive = []
  for row in rows:
    if row['k_policy'] in (None, 'fixed') or row['tokens_per_s'] is None:
      continue
    static = [s for s in rows if (s['batch_size'], s['workload']) == (row['batch_size'],
              row['workload']) and s['k_policy'] == 'fixed' and s['tokens_per_s'] is not None
              and s['drafter'] in ('none', row['drafter'])]
    if static:
      top = max(static, key=lambda s: s['tokens_per_s'])
      cell = (row['batch_size'], row['workload'])
      adaptive.append(dict(batch_size=row['batch_size'], workload=row['workload'],
                           setting=row['setting'], best_static=top['setting'],
                           fraction_of_best_static=row['tokens_per_s'] / top['tokens_per_s'],
                           **_per_pass(groups[cell + (row['setting'],)],
                                       groups[cell + (top['setting'],)]),
                           held_out=_held_out(groups[cell + (row['setting'],)],
                                              [groups[cell + (s['setting'],)] for s in static])))
  return dict(cost_source=source, costs=costs, thresholds=thresholds, settings=rows,
              adaptive=adaptive, at_k0=at_k0(groups), validation=validation(rows))


def _by_pass(records: list[dict]) -> dict:
  """{(case_id, repeat): tokens/s} of one setting's records, pass by pass: the key that pairs
  settings run in the same pass. A pass without exactly one record with a repeat and a tokens/s
  is left out (appended twice, or never run, it cannot be paired)."""
  def key(r):
    return r.get('case_id'), r.get('repeat')
  counts = collections.Counter(key(r) for r in records)
  return {key(r): r['tokens_per_s'] for r in records
          if r.get('repeat') is not None and r.get('tokens_per_s') is not None
          and counts[key(r)] == 1}


def _per_pass(adaptive: list[dict], best: list[dict]) -> dict:
  """The adaptive setting's tokens/s over the best static's pass by pass: {'per_pass':
  [fraction per pass, in record order], 'per_pass_se': the standard error of their mean (None
  with fewer than two)}. Records pair by (case_id, repeat): in one pass the settings' engines
  step in turn, so a drift in the machine's speed hits both. A pass without exactly one record
  of each is left out (`_by_pass`: records without a repeat, or appended twice, cannot be
  paired). What it measures is the spread between the passes of one run, which share their
  engines' warm-up tables; whole runs move more (B <= 4 passes last ~0.3-1 s each on the
  development CPU)."""
  rate, mine = _by_pass(best), _by_pass(adaptive)
  fractions = [t / rate[p] for p, t in mine.items() if rate.get(p)]
  se = statistics.stdev(fractions) / math.sqrt(len(fractions)) if len(fractions) > 1 else None
  return dict(per_pass=fractions, per_pass_se=se)


def _held_out(adaptive: list[dict], static: list[list[dict]]) -> float | None:
  """The adaptive setting's tokens/s over the static setting chosen without the pass it is
  scored on, mean over passes: per pass (repeat) r, the static setting with the best mean
  tokens/s over the other passes, and the ratio of the two in pass r. Choosing the best static
  on the same noisy passes it is compared in favours it (the largest of several noisy means);
  this is the fraction against a static choice made beforehand. None with fewer than two
  passes that every setting ran once (`_by_pass`)."""
  mine, others = _by_pass(adaptive), [_by_pass(s) for s in static]
  passes = [p for p in mine if all(p in o for o in others)]
  if len(passes) < 2:
    return None
  fractions = []
  for p in passes:
    rest = [q for q in passes if q != p]
    chosen = max(others, key=lambda o: statistics.mean(o[q] for q in rest))
    fractions.append(mine[p] / chosen[p])
  return statistics.mean(fractions)


def _ran_k0_only(record: dict) -> bool:
  """Whether a record's decode rounds all ran at K = 0 (`rounds_by_k`, its keys ints or the
  strings a results file holds); False without rounds, or with a key that names no int."""
  try:
    ks = {int(k) for k, n in (record.get('rounds_by_k') or {}).items() if n}
  except (TypeError, ValueError):
    return False
  return ks == {0}


def at_k0(groups: dict) -> list[dict]:
  """The adaptive settings' passes that ran K = 0 in every round, over the K = 0 setting's
  tokens/s in the same pass (paired by case and repeat, as `_per_pass`), per batch size and
  setting over the workloads: [{'batch_size', 'setting', 'passes': how many such passes,
  'of': the setting's passes at that B, 'mean', 'sd' (None with fewer than two)}]. In those
  passes the policy's engine ran the K = 0 engine's target rounds (the same tokens at greedy)
  plus its own work: the mean is what that work costs while it does not speculate (its
  choices, the lazy draft's probes), the spread mostly how far two runs of the same rounds land
  apart in one pass, the noise each pass of a fraction carries (a cell's fraction, the mean of
  R passes, carries ~sd / √R). The K = 0 setting of a (B, workload) is its one fixed K = 0
  setting without a drafter; a cell with none, or with several (other engine arguments), is
  left out. Empty where no adaptive setting ran a whole pass at K = 0."""
  zero = collections.defaultdict(list)
  for (b, w, s), rs in groups.items():
    if rs[0].get('k_policy') in (None, 'fixed') and rs[0].get('k') == 0 and \
        rs[0].get('drafter') in (None, 'none'):
      zero[(b, w)].append(s)
  ratios, total = collections.defaultdict(list), collections.Counter()
  for (b, workload, setting), rs in groups.items():
    if rs[0].get('k_policy') in (None, 'fixed') or len(zero[(b, workload)]) != 1:
      continue
    rate = _by_pass(groups[(b, workload, zero[(b, workload)][0])])
    passes = _by_pass(rs)                     # each pass once (`_by_pass`), then K = 0 only
    mine = {p: t for p, t in _by_pass([r for r in rs if _ran_k0_only(r)]).items() if p in passes}
    total[(b, setting)] += len(passes)
    ratios[(b, setting)] += [t / rate[p] for p, t in mine.items() if rate.get(p)]
  return [dict(batch_size=b, setting=setting, passes=len(r), of=total[(b, setting)],
               mean=statistics.mean(r), sd=statistics.stdev(r) if len(r) > 1 else None)
          for (b, setting), r in sorted(ratios.items()) if r]


def validation(rows: list[dict]) -> dict:
  """How well the model predicts the decode-only speedup of the fixed-K draft-model rows of
  `analyze`: the median and range of measured ÷ predicted, for τ(α, K) / c (i.i.d. α) and for
  τ_measured / c (rows without a prediction are skipped; {} when none has one)."""
  out = {}
  for name, field in (('iid_alpha', 'predicted_speedup'), ('measured_tau', 'predicted_from_tau')):
    q = sorted(r['decode_speedup'] / r[field] for r in rows
               if r.get(field) and r.get('decode_speedup') is not None)
    if q:
      out[name] = dict(rows=len(q), median=statistics.median(q), min=q[0], max=q[-1])
  return out


def _fmt(value, digits=2) -> str:
  if value is None:
    return ''
  if isinstance(value, float):
    if math.isinf(value):
      return 'never'
    return f'{value:.{digits}f}'
  return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
  return (['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
          + ['| ' + ' | '.join(_fmt(c) for c in row) + ' |' for row in rows])


def markdown(result: dict) -> str:
  """The analysis as markdown: threshold table, measured speedups per workload (end to end and
  decode-only, with the model's prediction), adaptive vs best static, and the adaptive settings'
  passes at K = 0 only against the K = 0 setting (`at_k0`)."""
  ks = sorted({k for t in result['costs'].values() for k in t if k})
  steps = result.get('cost_source', 'steps') == 'steps'
  how = ('decode-only engine steps of the runs' if steps else
         'device rounds on idle rows, interleaved') + '; in brackets, where measured: ' + (
         'device rounds on idle rows, settings interleaved round by round (no host work)'
         if steps else 'decode-only engine steps of the runs') + ', and α* from those'
  lines = ['## α threshold per batch size', '',
           f'c(B, K) = seconds of a decode round at K ÷ at K = 0, same run ({how}); α* = '
           'smallest α with τ(α, K) > c(B, K) for some K ≥ 1; best K maximises '
           'τ(α, K) / c(B, K).', '']

  def both(t, main, other):
    cell = _fmt(t.get(main))
    return f'{cell} ({_fmt(t[other])})' if t.get(other) is not None else cell

  if not result['settings']:       # a sweep whose cases all failed: not a settings problem
    lines += ['No batching records to analyse: every run (or sweep case) failed before writing '
              'one; see its FATAL line, or a sweep case\'s error.txt.']
  elif not result['thresholds']:   # an empty table would read as "measured, nothing pays"
    lines += ['No cost ratio c(B, K), so no threshold: these records hold no fixed K >= 1 '
              'draft-model setting beside K = 0 with its round times (add one, e.g. '
              "`--config.settings='k0=k:0;k2=k:2;...'`)."]
  else:
    lines += _table(
        ['B', 'α*', 'K at α*'] + [f'best K @ α={a}' for a in ALPHAS] + [f'c(K={k})' for k in ks],
        [[t['batch_size'], both(t, 'alpha_star', 'alpha_star_other'), t['k_at_threshold']]
         + [t[f'best_k_at_{a}'] for a in ALPHAS]
         + [both(t, f'cost_k{k}', f'cost_other_k{k}') for k in ks]
         for t in result['thresholds']])
  for workload in dict.fromkeys(r['workload'] for r in result['settings']):
    rows = [r for r in result['settings'] if r['workload'] == workload]
    lines += ['', f'## Measured: workload {workload}', '',
              'speedup = tokens/s ÷ K = 0 tokens/s (whole run, prefill included); decode = '
              'the same over decode-only steps; predicted (α) = τ(α, K) ÷ c(B, K) with the '
              'measured α (i.i.d. model); predicted (τ) = measured τ ÷ c(B, K); α_eq = the '
              'i.i.d. α with τ(α_eq, K) = measured τ, the α to hold against α*; = K0: the '
              'fraction of greedy passes whose tokens equalled the K = 0 engine\'s.', '']
    lines += _table(
        ['B', 'setting', 'tokens/s', 'speedup', 'decode speedup', 'predicted (α)',
         'predicted (τ)', 'α', 'α_eq', 'τ', 'TTFT ms', 'TPOT ms', '= K0'],
        [[r['batch_size'], r['setting'], _fmt(r['tokens_per_s'], 0), r['speedup'],
          r['decode_speedup'], r.get('predicted_speedup'), r.get('predicted_from_tau'),
          r['acceptance_rate'], r.get('alpha_equivalent'),
          r['mean_accepted_length'], None if r['ttft_s'] is None else r['ttft_s'] * 1e3,
          None if r['tpot_s'] is None else r['tpot_s'] * 1e3, r.get('matches_baseline')]
         for r in rows])
  for name, v in result.get('validation', {}).items():
    what = {'iid_alpha': 'τ(α, K) / c (i.i.d. α)', 'measured_tau': 'τ_measured / c'}[name]
    lines += ['', f'Measured decode-only speedup ÷ predicted {what}: median {v["median"]:.2f}, '
              f'range {v["min"]:.2f}–{v["max"]:.2f} over {v["rows"]} (B, workload, K) rows.']
  if result['adaptive']:
    lines += ['', '## Adaptive policies: tokens/s ÷ best static setting (K = 0 included)', '',
              'fraction: mean tokens/s ÷ the best static mean; per pass: the same ratio in each '
              'pass (repeat), ± the standard error of their mean; held out: per pass, ÷ the '
              'static setting best over the other passes, mean over passes.', '']
    lines += _table(['B', 'workload', 'setting', 'fraction', 'best static', 'per pass', '± se',
                     'held out'],
                    [[a['batch_size'], a['workload'], a['setting'], a['fraction_of_best_static'],
                      a['best_static'], ' '.join(_fmt(f) for f in a.get('per_pass', [])),
                      a.get('per_pass_se'), a.get('held_out')] for a in result['adaptive']])
  if result.get('at_k0'):
    lines += ['', '## Adaptive policies in passes at K = 0 only: tokens/s ÷ the K = 0 setting\'s',
              '', 'The passes in which an adaptive setting ran K = 0 in every round ran the K = 0 '
              "engine's rounds plus the policy's own work: mean, that work's cost while it does "
              'not speculate; sd, mostly the noise one pass of a fraction carries (over R '
              'passes, ~sd / √R).', '']
    lines += _table(['B', 'setting', 'passes', 'mean', 'sd'],
                    [[a['batch_size'], a['setting'], f'{a["passes"]} of {a["of"]}',
                      _fmt(a['mean'], 3), _fmt(a['sd'], 3)] for a in result['at_k0']])
  return '\n'.join(lines) + '\n'


def _json_safe(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {str(k): _json_safe(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_json_safe(v) for v in value]
  return value


def write_summary(records: list[dict], out_dir) -> list[pathlib.Path]:
  """Writes OUT_DIR/threshold.md and threshold.json (α* = null where no K pays); returns them."""
  out_dir = pathlib.Path(out_dir)
  result = analyze(records)
  md, js = out_dir / 'threshold.md', out_dir / 'threshold.json'
  md.write_text(markdown(result))
  js.write_text(json.dumps(_json_safe(result), indent=1) + '\n')
  return [md, js]
