"""Where an adaptive K policy's host time goes: each setting's decode rounds split into the device
call, the K choice (`speculation.choose`: the policy, probes and catch-ups) and gathering the
queue and split inputs (`speculation.horizon`), against plain continuous batching, in one run.

    python scripts/policy_host_time.py [--batch 4] [--workload code | json,code,retrieval]
        [--passes 6] [--settings 'k0=k:0;goodput=k:8,k_policy:goodput']
        [--set 'goodput.draft_sync.probe_every=None' ...] [--per_pass] [--costs] [--parts]

Engines are built and warmed up as in the batching study (`configs/batching.py`:
`experiments.batching.build_engines`, N = max(2 x B, 8) held-out prompts of 64 tokens, 32 tokens
each, greedy), then stepped in turn (`experiments.batching.measure`, the order shuffled every
round) for --passes passes. Each pass runs the --workload list in order on that pass's prompts
(`experiments.batching.prompt_seed`: a new draw each pass), as each repeat of the sweep does:
with 'json,code,retrieval' a policy meets the workload changes the sweep's cells meet (after a
K >= 1 stretch on json, the code prompts' prefill fills the draft's cache too and the probes
start early again). --set overrides an attribute of a built engine before the runs
(SETTING.PATH=VALUE, PATH dotted from the engine, VALUE a Python literal): e.g. two goodput
settings, one with the lazy draft's probes off (`draft_sync.probe_every=None`), split the policy's
overhead into probes and the rest (what picks a compiled variant, such as the policy's
spec_confidence, is fixed at construction: give it in the setting, k_policy.spec_confidence:true,
so warm-up compiles it). --per_pass also prints each pass and workload (what one
stretch at K >= 1 costs: prefill calls and their milliseconds, catch-ups, rounds with an idle
row). Per setting and workload it prints tokens/s as a ratio to the first setting (mean over
passes), decode rounds per pass, the mean microseconds per round of each part ('rest': the
step's wall time besides its device and prefill calls and the choices made before a round, i.e.
scheduling, round inputs and emitting), the prefill calls' milliseconds per pass, the rounds per
K, and for a lazy draft cache its catch-up calls and milliseconds per pass and the tokens its
catch-ups scored per pass (what the policy learns of α while it runs K = 0). --costs also prints,
per setting, the median seconds of its decode calls of the full batch's row bucket (B rows
computed) at each K it ran, and for a policy that prices rounds (goodput) the warm-up table and the
table it priced with at the start (K >= 1 on the Theil-Sen line, `live_costs.line_through`), all in
units of the first K = 0 setting's warm-up K = 0 round: whether the live rounds cost what the
policy was told. --parts also times the K policy's and the lazy draft's calls one by one
(`PARTS`: choose, repeat, worth_probing, round_timing, overlaps, probe_due, catch_up,
after_round) and prints each one's microseconds per decode round and its calls, e.g. with
`--set 'gp.policy.spec_margin=10.0'` what goodput's rounds cost it while it stays at K = 0 (a
part inside another counts in both). The times are the wall clock around each call (a choice
made while a K = 0 round runs, `jaxspec.engine.draft_sync.DraftSync.overlaps`, counts in both
'device' and 'choose': compare a twin with `--set NAME.draft_sync.overlap_choice=False` by
device + choose), so the parts include the Python that runs right after a device call (slower
than the same code in a tight loop: the step has pushed the interpreter's data out of the
caches).
"""

from __future__ import annotations

import argparse
import ast
import collections
import statistics
import time

import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import batching as batching_config
from experiments import batching
from experiments.speculative import load_pair
from jaxspec.data import make_prompts
from jaxspec.data.workloads import WORKLOADS
from jaxspec.engine import engine as engine_lib


def _timed(totals: collections.Counter, part: str, function):
  """`function` wrapped to add its wall seconds to totals[part]."""
  def call(*args, **kwargs):
    start = time.perf_counter()
    try:
      return function(*args, **kwargs)
    finally:
      totals[part] += time.perf_counter() - start
  return call


def _parse_override(override: str, names, parser) -> tuple:
  """(SETTING, [PATH...], VALUE) of SETTING.PATH=VALUE, checked against the setting names
  before any engine is built."""
  target, _, value = override.partition('=')
  name, *path = target.split('.')
  if not _ or not path or name not in names:
    parser.error(f'--set {override!r}: want SETTING.PATH=VALUE with SETTING in {list(names)}')
  try:
    value = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    parser.error(f'--set {override!r}: {value!r} is not a Python literal')
  return name, path, value


def _kind(value):
  return 'bool' if isinstance(value, bool) else (
      'number' if isinstance(value, (int, float)) else type(value).__name__)


def _override(engines, override: str, parser) -> None:
  """Set SETTING.PATH=VALUE on the setting's engine (PATH dotted attributes from it). The value
  must be of the attribute's kind (a number for a number, None allowed either way), and a count
  (an int >= 1, such as draft_sync.probe_every) stays >= 1."""
  name, path, value = _parse_override(override, engines, parser)
  owner = engines[name][0]
  for attribute in path[:-1]:
    owner = getattr(owner, attribute, None)
  if owner is None or not hasattr(owner, path[-1]):
    parser.error(f'--set {override!r}: the {name} engine has no {".".join(path)}')
  old = getattr(owner, path[-1])
  if old is not None and value is not None and _kind(old) != _kind(value):
    parser.error(f'--set {override!r}: {".".join(path)} is a {_kind(old)} ({old!r}), got '
                 f'{value!r}')
  if _kind(old) == 'number' and isinstance(old, int) and old >= 1 and value is not None and \
      not (isinstance(value, int) and value >= 1):
    parser.error(f'--set {override!r}: {".".join(path)} is a count ({old!r}): want an int >= 1')
  try:
    setattr(owner, path[-1], value)
  except AttributeError:           # a property without a setter (e.g. draft_sync.live_ratio)
    parser.error(f'--set {override!r}: {".".join(path)} cannot be set')


def build_study(args, parser) -> tuple:
  """(config, settings, engines, tokenizer) for `args.batch`, `args.settings` and `args.set`: the
  batching study's config at B = args.batch, the settings' engines built as the study builds
  them (`experiments.batching.build_engines`, warmed up), each --set applied. Bad settings or
  overrides, a setting the engine refuses included (`experiments.batching.validate`), end in
  `parser.error` before any model loads."""
  config = batching_config.get_config()
  config.batch_size, config.settings = args.batch, args.settings
  try:
    settings = batching.parse_settings(config.settings)
  except ValueError as error:
    parser.error(f'--settings: {error}')
  for override in args.set:           # the setting names, before anything is built
    _parse_override(override, settings, parser)
  try:
    batching.validate(config)         # a setting the engine refuses (e.g. k out of range)
  except ValueError as error:
    parser.error(f'--settings: {error}')
  target, target_params, draft, draft_params, tokenizer = load_pair(config)
  engines = batching.build_engines(config, settings, target, target_params, draft,
                                   draft_params)
  for override in args.set:
    _override(engines, override, parser)
  return config, settings, engines, tokenizer


def _sync_marks(engine) -> tuple:
  """(catch-up calls, seconds) the engine's lazy draft cache has run so far ((0, 0) without
  one)."""
  sync = engine.draft_sync
  return (sync.num_calls, sync.seconds) if sync is not None else (0, 0.0)


def _instrument(engine, name, totals, current, calls) -> None:
  """Wrap the engine's calls to add to totals[(name, current workload)]: its decode calls'
  seconds ('device', and `calls` per K of the full row bucket), its prefill calls' ('prefill',
  'prefills'), its decode rounds with an idle row ('part_rounds') and the tokens its catch-ups
  scored ('probe_tokens'); `current` = [setting, workload] is set for each step."""
  def counters():
    return totals[(name, current[1])]
  decode = engine._call_decode

  def call_decode(*args, **kwargs):
    start = time.perf_counter()
    try:
      return decode(*args, **kwargs)
    finally:
      seconds = time.perf_counter() - start
      counters()['device'] += seconds
      if len(args[0]) == engine.num_slots:            # args[0]: the call's page table
        calls[kwargs.get('k', 0)].append(seconds)
  engine._call_decode = call_decode
  prefill = engine._call_prefill

  def call_prefill(*args, **kwargs):
    counters()['prefills'] += 1
    return _timed(counters(), 'prefill', prefill)(*args, **kwargs)
  engine._call_prefill = call_prefill
  layout = engine._decode_layout

  def counted(decodes):
    counters()['part_rounds'] += len(decodes) < engine.num_slots    # a round with an idle row
    return layout(decodes)
  engine._decode_layout = counted
  step = engine.step

  def stepped():
    current[0] = name
    return _timed(counters(), 'step', step)()
  engine.step = stepped
  if engine.draft_sync is not None and engine.policy is not None:
    observe_probe = engine.policy.observe_probe

    def probed(request_id, successes, trials, *args, **kwargs):
      counters()['probe_tokens'] += trials             # a catch-up's scores: drawn at K = 0
      return observe_probe(request_id, successes, trials, *args, **kwargs)
    engine.policy.observe_probe = probed


# `--parts`: the K policy's and the lazy draft's calls timed one by one (owner attribute, method).
PARTS = (('policy', 'choose'), ('policy', 'repeat'), ('policy', 'worth_probing'),
         ('policy', 'round_timing'), ('draft_sync', 'overlaps'), ('draft_sync', 'probe_due'),
         ('draft_sync', 'catch_up'), ('draft_sync', 'after_round'))


def _instrument_parts(engine, name, totals, current) -> None:
  """`--parts`: wrap each of `PARTS` the engine has (on the instance, so calls from inside the
  owner count too) to add its wall seconds to totals[(name, workload)]['part OWNER.METHOD'] and
  its calls to ['calls OWNER.METHOD']. A part called inside another counts in both (catch_up
  inside a probe's choice, probe_due inside overlaps)."""
  for owner_name, method in PARTS:
    owner = getattr(engine, owner_name, None)
    function = getattr(owner, method, None)
    if function is None:
      continue
    label = f'{owner_name}.{method}'

    def timed(*args, _function=function, _label=label, **kwargs):
      counters = totals[(name, current[1])]
      counters[f'calls {_label}'] += 1
      return _timed(counters, f'part {_label}', _function)(*args, **kwargs)
    setattr(owner, method, timed)


def _parts_line(t, rounds: int) -> str:
  """`--parts`: each timed part's microseconds per decode round and its calls, from the
  counters `_instrument_parts` fills ('' when none was called)."""
  parts = [(label[len('part '):], seconds) for label, seconds in t.items()
           if label.startswith('part ')]
  return ', '.join(f'{label} {seconds / max(1, rounds) * 1e6:.1f} us '
                   f'({t["calls " + label]} calls)' for label, seconds in sorted(parts))


def _print_costs(name, engine, calls, priced, unit) -> None:
  """`--costs`: the setting's live decode calls of the full row bucket per K (median, and how
  many), and a pricing policy's warm-up and priced tables, each over `unit` seconds (a warm-up
  K = 0 round)."""
  line = f'{name:>10} costs: live ' + ', '.join(
      f'K={k} {statistics.median(t) / unit:.2f} ({len(t)})' for k, t in sorted(calls.items()))
  if priced is not None:
    line += ('; warm-up ' + ' '.join(f'{engine.step_costs[k] / unit:.2f}'
                                     for k in sorted(engine.step_costs)) +
             '; priced ' + ' '.join(f'{priced[k] / unit:.2f}' for k in sorted(priced)))
  print(line)


def _print_pass(p, workload, runs, base, totals, marks, engines) -> None:
  """One line per setting of pass p's run of `workload` (`--per_pass`): tokens/s against
  `base`, engine ms, prefill calls and ms, rounds at K >= 1, catch-up ms and decode rounds with
  an idle row; `marks` {setting: (its counters, its catch-up (calls, seconds))} before the run."""
  for name, run in runs.items():
    spec = sum(n for k, n in run['rounds_by_k'].items() if int(k) >= 1)
    counted, (_, sync_s) = marks[name]
    t = totals[(name, workload)]
    sync_ms = (_sync_marks(engines[name][0])[1] - sync_s) * 1e3
    print(f'pass {p} {workload:>9} {name:>10}: '
          f'{run["tokens_per_s"] / runs[base]["tokens_per_s"]:.3f}x, '
          f'{run["engine_s"] * 1e3:.0f} ms, {run["prefill_steps"]} prefill calls '
          f'{(t["prefill"] - counted["prefill"]) * 1e3:.1f} ms, {spec} rounds at K >= 1, '
          f'catch-ups {sync_ms:.1f} ms, {t["part_rounds"] - counted["part_rounds"]} rounds with '
          f'an idle row')


def _summary_line(name, engine, t, rounds_by_k, speeds, base_speeds, passes) -> str:
  """A setting's line of one workload: tokens/s against the base (mean of the passes' ratios),
  rounds, the parts' microseconds per round, prefill ms, rounds per K and catch-ups, per pass."""
  rounds = max(1, sum(rounds_by_k.values()))
  ratio = statistics.mean(a / b for a, b in zip(speeds, base_speeds))
  # The step's wall time besides its device and prefill calls and the choices made before a
  # round (catch-ups included; one made while the round runs is inside 'device').
  rest = t['step'] - t['device'] - t['prefill'] - (t['choose'] - t['overlapped'])
  line = (f'{name:>10}: {ratio:.3f}x, {rounds / passes:.0f} rounds/pass, per round: '
          f'device {t["device"] / rounds * 1e6:.0f} us, choose {t["choose"] / rounds * 1e6:.0f}'
          f' us, horizon {t["horizon"] / rounds * 1e6:.0f} us, rest {rest / rounds * 1e6:.0f} us;'
          f' prefill {t["prefills"] / passes:.1f}'
          f' calls/pass, {t["prefill"] / passes * 1e3:.1f} ms/pass; rounds by K '
          f'{dict(sorted(rounds_by_k.items()))}')
  if engine.draft_sync is not None:
    line += (f'; catch-ups {t["catch_ups"] / passes:.1f}/pass, '
             f'{t["catch_up_s"] / passes * 1e3:.1f} ms/pass, scoring '
             f'{t["probe_tokens"] / passes:.1f} tokens/pass')
  return line


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--batch', type=int, default=4, help='engine slots B')
  parser.add_argument('--workload', default='code',
                      help='held-out prompts of this workload, or a comma-separated list run in '
                           'order each pass (json,code,retrieval: as the sweep)')
  parser.add_argument('--passes', type=int, default=6, help='timed passes over the prompts')
  parser.add_argument('--settings', default='k0=k:0;goodput=k:8,k_policy:goodput',
                      help="the study's settings string; the first is the ratios' base")
  parser.add_argument('--per_pass', '--per-pass', action='store_true',
                      help='also print each pass: every setting against the first, its engine '
                           'ms, prefill calls, rounds at K >= 1, catch-up ms, and decode rounds '
                           'with fewer requests than slots')
  parser.add_argument('--costs', action='store_true',
                      help='also print each setting\'s live decode calls per K and a pricing '
                           'policy\'s warm-up and priced cost tables, in warm-up K = 0 rounds')
  parser.add_argument('--parts', action='store_true',
                      help="also time each of the K policy's and the lazy draft's calls "
                           '(choose, repeat, worth_probing, round_timing, overlaps, probe_due, '
                           'catch_up, after_round): microseconds per decode round and calls')
  parser.add_argument('--set', action='append', default=[], metavar='SETTING.PATH=VALUE',
                      help='override an engine attribute, e.g. goodput.policy.spec_margin=0.1')
  args = parser.parse_args()
  if args.batch < 1 or args.passes < 1:
    parser.error(f'--batch and --passes must be >= 1, got {args.batch} and {args.passes}')
  workloads = args.workload.split(',')
  unknown = [w for w in workloads if w not in WORKLOADS]
  if unknown or len(set(workloads)) < len(workloads):
    parser.error(f'--workload {args.workload!r}: ' + (
        f'unknown {unknown}; known: {sorted(WORKLOADS)}' if unknown else 'a workload twice'))
  config, _, engines, tokenizer = build_study(args, parser)
  n = max(config.requests_per_slot * args.batch, config.min_requests)

  def prompts_of(workload, p):
    return [q.tokens for q in make_prompts(workload, tokenizer, n, config.prompt_len,
                                           split='test', seed=batching.prompt_seed(config, p))]
  stop = tokenizer.eos_ids
  warm = prompts_of(workloads[0], 0)
  for name in engines:          # one untimed pass each (first-call host work)
    batching.measure({name: engines[name]}, [q[:config.chunk_size] for q in warm[:args.batch]],
                     max_tokens=4, stop_tokens=stop)

  # totals[(setting, workload)]: seconds of each part, rounds, catch-ups, scored tokens.
  totals = collections.defaultdict(collections.Counter)
  current = [None, None]
  speculation = engine_lib.speculation
  choose, horizon = speculation.choose, speculation.horizon

  def timed_choose(*a, **k):
    part = _timed(totals[tuple(current)], 'choose', choose)
    if k.get('overlapped'):
      part = _timed(totals[tuple(current)], 'overlapped', part)
    return part(*a, **k)
  speculation.choose = timed_choose
  speculation.horizon = lambda *a, **k: _timed(totals[tuple(current)], 'horizon', horizon)(*a,
                                                                                         **k)
  by_k = {name: collections.defaultdict(list) for name in engines}
  priced = {name: dict(e.policy.live.idle.get(None) or {})
            if getattr(e.policy, 'live', None) is not None else None
            for name, (e, _) in engines.items()}
  for name, (engine, _) in engines.items():
    _instrument(engine, name, totals, current, by_k[name])
    if args.parts:
      _instrument_parts(engine, name, totals, current)
  speeds = collections.defaultdict(list)
  rounds_by_k = collections.defaultdict(collections.Counter)
  base = next(iter(engines))
  try:
    for p in range(args.passes):
      for w, workload in enumerate(workloads):
        current[1] = workload
        prompts = prompts_of(workload, p)
        marks = {n: (collections.Counter(totals[(n, workload)]), _sync_marks(e))
                 for n, (e, _) in engines.items()}
        runs = batching.measure(engines, prompts, max_tokens=32, stop_tokens=stop,
                                seed=p * len(workloads) + w)
        for name, run in runs.items():
          t = totals[(name, workload)]
          speeds[(name, workload)].append(run['tokens_per_s'])
          calls, seconds = (a - b for a, b in zip(_sync_marks(engines[name][0]),
                                                  marks[name][1]))
          t['catch_ups'] += calls
          t['catch_up_s'] += seconds
          rounds_by_k[(name, workload)].update({int(k): r for k, r in
                                                run['rounds_by_k'].items()})
        if args.per_pass:
          _print_pass(p, workload, runs, base, totals, marks, engines)
  finally:
    speculation.choose, speculation.horizon = choose, horizon
  for workload in workloads:
    print(f'B = {args.batch}, {workload}, {args.passes} pass{"es" * (args.passes != 1)}; '
          f'tokens/s against {base}')
    for name, (engine, _) in engines.items():
      print(_summary_line(name, engine, totals[(name, workload)], rounds_by_k[(name, workload)],
                          speeds[(name, workload)], speeds[(base, workload)], args.passes))
      parts = _parts_line(totals[(name, workload)], sum(rounds_by_k[(name, workload)].values()))
      if args.parts and parts:
        print(f'{"":>12}parts per round: {parts}')
  if args.costs:        # one scale: the first warm-up K = 0 round of any setting
    unit_of = next((n for n, (e, _) in engines.items() if 0 in e.step_costs), None)
    if unit_of is None:
      print('--costs: no setting timed a K = 0 round at warm-up (add k0=k:0)')
      return
    unit = engines[unit_of][0].step_costs[0]
    print(f'costs in warm-up K = 0 rounds of {unit_of} ({unit * 1e3:.2f} ms):')
    for name, (engine, _) in engines.items():
      _print_costs(name, engine, by_k[name], priced[name], unit)


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
