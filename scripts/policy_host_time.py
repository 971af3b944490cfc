"""Where an adaptive K policy's host time goes: each setting's decode rounds split into the device
call, the K choice (`speculation.choose`: the policy, probes and catch-ups) and gathering the
queue and split inputs (`speculation.horizon`), against plain continuous batching, in one run.

    python scripts/policy_host_time.py [--batch 4] [--workload code]
        [--passes 6] [--settings 'k0=k:0;goodput=k:8,k_policy:goodput']
        [--set 'goodput.draft_sync.probe_every=None' ...] [--per_pass] [--costs]

Engines are built and warmed up as in the batching study (`configs/batching.py`:
`experiments.batching.build_engines`, N = max(2 x B, 8) held-out prompts of 64 tokens, 32 tokens
each, greedy), then stepped in turn (`experiments.batching.measure`, the order shuffled every
round) for --passes passes. --set overrides an attribute of a built engine before the runs
(SETTING.PATH=VALUE, PATH dotted from the engine, VALUE a Python literal): e.g. two goodput
settings, one with the lazy draft's probes off (`draft_sync.probe_every=None`), split the policy's
overhead into probes and the rest. --per_pass also prints each pass (what one stretch at K >= 1
costs: prefill calls, catch-ups, rounds with an idle row). Per setting it prints tokens/s as a
ratio to the first setting (mean over passes), decode rounds per pass, the mean microseconds per
round of each part, the rounds per K, and for a lazy draft cache its catch-up calls and
milliseconds per pass and the tokens its catch-ups scored per pass (what the policy learns of α
while it runs K = 0). --costs also prints, per setting, the median seconds of its decode
calls of the full batch's row bucket (B rows computed) at each K it ran, and for a policy that
prices rounds (goodput) the warm-up table and the table it priced with at the start (K >= 1 on
the Theil-Sen line, `live_costs.line_through`), all in units of the first K = 0 setting's
warm-up K = 0 round: whether the live rounds cost what the policy was told. The times are the
wall clock around each call, so the parts include the Python that runs right after a device call
(slower than the same code in a tight loop: the step has pushed the interpreter's data out of the
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
  setattr(owner, path[-1], value)


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


def _sync_s(engine) -> float:
  """Seconds the engine's lazy draft cache has spent catching up (0 without one)."""
  return engine.draft_sync.seconds if engine.draft_sync is not None else 0.0


def _timed_decode(totals: collections.Counter, calls: dict, engine):
  """The engine's decode call wrapped to add its wall seconds to totals['device'] and, when it
  computes the full batch's row bucket, to calls[K] (K its `k` keyword)."""
  function = engine._call_decode

  def call(*args, **kwargs):
    start = time.perf_counter()
    try:
      return function(*args, **kwargs)
    finally:
      seconds = time.perf_counter() - start
      totals['device'] += seconds
      if len(args[0]) == engine.num_slots:            # args[0]: the call's page table
        calls[kwargs.get('k', 0)].append(seconds)
  return call


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


def _print_pass(p, runs, base, engines, totals, marks) -> None:
  """One line per setting of pass p (`--per_pass`): tokens/s against `base`, engine ms,
  prefill calls, rounds at K >= 1, catch-up ms and rounds with an idle row in this pass."""
  for name, run in runs.items():
    spec = sum(n for k, n in run['rounds_by_k'].items() if int(k) >= 1)
    part = totals[name]['part_rounds'] - marks[name][0]['part_rounds']
    sync_ms = (_sync_s(engines[name][0]) - marks[name][1]) * 1e3
    print(f'pass {p} {name:>10}: {run["tokens_per_s"] / runs[base]["tokens_per_s"]:.3f}x, '
          f'{run["engine_s"] * 1e3:.0f} ms, {run["prefill_steps"]} prefill calls, {spec} rounds '
          f'at K >= 1, catch-ups {sync_ms:.1f} ms, {part} rounds with an idle row')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--batch', type=int, default=4, help='engine slots B')
  parser.add_argument('--workload', default='code', choices=['json', 'code', 'retrieval'],
                      help='held-out prompts of this workload')
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
  parser.add_argument('--set', action='append', default=[], metavar='SETTING.PATH=VALUE',
                      help='override an engine attribute, e.g. goodput.policy.spec_margin=0.1')
  args = parser.parse_args()
  if args.batch < 1 or args.passes < 1:
    parser.error(f'--batch and --passes must be >= 1, got {args.batch} and {args.passes}')
  config, _, engines, tokenizer = build_study(args, parser)
  n = max(config.requests_per_slot * args.batch, config.min_requests)
  prompts = [p.tokens for p in make_prompts(args.workload, tokenizer, n, config.prompt_len,
                                            split='test', seed=0)]
  stop = tokenizer.eos_ids
  for name in engines:          # one untimed pass each (first-call host work)
    batching.measure({name: engines[name]}, [p[:config.chunk_size] for p in prompts[:args.batch]],
                     max_tokens=4, stop_tokens=stop)

  totals = {name: collections.Counter() for name in engines}
  current = [None]
  speculation = engine_lib.speculation
  choose, horizon = speculation.choose, speculation.horizon
  speculation.choose = lambda *a, **k: _timed(totals[current[0]], 'choose', choose)(*a, **k)
  speculation.horizon = lambda *a, **k: _timed(totals[current[0]], 'horizon', horizon)(*a, **k)
  before = {}
  by_k = {name: collections.defaultdict(list) for name in engines}
  priced = {name: dict(e.policy.live.idle.get(None) or {})
            if getattr(e.policy, 'live', None) is not None else None
            for name, (e, _) in engines.items()}
  for name, (engine, _) in engines.items():
    engine._call_decode = _timed_decode(totals[name], by_k[name], engine)
    layout = engine._decode_layout

    def counted(decodes, layout=layout, engine=engine, t=totals[name]):
      t['part_rounds'] += len(decodes) < engine.num_slots    # a round with an idle row
      return layout(decodes)
    engine._decode_layout = counted
    step = engine.step

    def stepped(step=step, name=name):
      current[0] = name
      return step()
    engine.step = stepped
    sync = engine.draft_sync
    before[name] = (dict(engine.k_rounds), sync.num_calls if sync else 0,
                    sync.seconds if sync else 0.0)
    if sync is not None and engine.policy is not None:
      observe = engine.policy.observe

      def probed(request_id, k, accepted, successes, trials, observe=observe, t=totals[name]):
        if k == 0:                          # a catch-up's scores: tokens drawn at K = 0
          t['probe_tokens'] += trials
        return observe(request_id, k, accepted, successes, trials)
      engine.policy.observe = probed
  speeds = collections.defaultdict(list)
  base = next(iter(engines))
  try:
    for p in range(args.passes):
      marks = {n: (collections.Counter(totals[n]), _sync_s(e)) for n, (e, _) in engines.items()}
      runs = batching.measure(engines, prompts, max_tokens=32, stop_tokens=stop, seed=p)
      for name, run in runs.items():
        speeds[name].append(run['tokens_per_s'])
      if args.per_pass:
        _print_pass(p, runs, base, engines, totals, marks)
  finally:
    speculation.choose, speculation.horizon = choose, horizon
  print(f'B = {args.batch}, {args.workload}, {args.passes} passes; tokens/s against {base}')
  for name, (engine, _) in engines.items():
    ks, calls, seconds = before[name]
    rounds_by_k = {k: n - ks.get(k, 0) for k, n in sorted(engine.k_rounds.items())
                   if n > ks.get(k, 0)}
    rounds = sum(rounds_by_k.values())
    t = totals[name]
    ratio = statistics.mean(a / b for a, b in zip(speeds[name], speeds[base]))
    line = (f'{name:>10}: {ratio:.3f}x, {rounds / args.passes:.0f} rounds/pass, per round: '
            f'device {t["device"] / rounds * 1e6:.0f} us, choose {t["choose"] / rounds * 1e6:.0f}'
            f' us, horizon {t["horizon"] / rounds * 1e6:.0f} us; rounds by K {rounds_by_k}')
    sync = engine.draft_sync
    if sync is not None:
      line += (f'; catch-ups {(sync.num_calls - calls) / args.passes:.1f}/pass, '
               f'{(sync.seconds - seconds) / args.passes * 1e3:.1f} ms/pass, scoring '
               f'{t["probe_tokens"] / args.passes:.1f} tokens/pass')
    print(line)
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
