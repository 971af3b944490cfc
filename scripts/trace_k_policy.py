"""Trace an adaptive K policy through the batching study's passes: which K it ran round by round,
what each probe scored and where its global α stood, beside the static settings' speedups, pass
by pass.

    python scripts/trace_k_policy.py [--batch 4] [--passes 6] [--workloads json,code,retrieval]
        [--settings 'k0=k:0;k2=k:2;goodput=k:8,k_policy:goodput']
        [--set 'goodput.policy.spec_margin=0.1' ...]

Engines are built, warmed up and stepped in turn as in the study (`configs/batching.py`,
`experiments.batching`: N = max(2 x B, 8) held-out prompts of 64 tokens per workload and pass,
each pass its own draw, 32 tokens each, greedy); every pass runs the workloads in order on the
same engines, so a policy's estimates carry from one workload to the next, as they do in a
sweep's case. --set overrides an attribute of a built engine (SETTING.PATH=VALUE, as in
`scripts/policy_host_time.py`). Per pass and workload it prints each setting's tokens/s over the
first setting's, a static setting's acceptance rate, and for each policy its rounds as runs of
one K (`K2x8`: eight rounds at K = 2) with every probe between them (`[6/8 g0.62]`: the draft's
scores summed to 6 over the 8 tokens it was scored on, at greedy the tokens it would have
proposed, the global α 0.62 before the probe) and every catch-up before a round at K >= 1 that
scored tokens (`{3/4 g0.70}`, before that round). The runs list the policy's choices: a K >= 1
chosen while a K = 0 round ran (`jaxspec.engine.draft_sync.DraftSync.overlaps`) is listed for
that round, which ran K = 0, and the next round's choice after it. Then per workload each
setting's mean speedup over the passes and each policy's mean over the best static setting's.
(The study's *fraction* divides mean tokens/s instead; the mean of per-pass ratios leaves out
the machine's drift between passes.)
"""

from __future__ import annotations

import argparse
import collections
import statistics

import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from experiments import batching
from jaxspec.data import make_prompts
from jaxspec.data.workloads import WORKLOADS

import policy_host_time


def runs_of(events: list) -> str:
  """'K0x3 [1/2 g0.60] K2x8' from events: ints (one round at that K) and strings (a probe or a
  catch-up, as printed)."""
  out, last, count = [], None, 0
  for event in events + [None]:
    if isinstance(event, int) and event == last:
      count += 1
      continue
    if last is not None:
      out.append(f'K{last}x{count}')
    last, count = (event, 1) if isinstance(event, int) else (None, 0)
    if isinstance(event, str):
      out.append(event)
  return ' '.join(out)


def _traced(policy, events: list, draft_sync=None) -> None:
  """Wrap the policy's K choices (`repeat`, `choose`) and catch-up scores to append to `events`:
  a K per round, '[s/t gα]' per probe and '{s/t gα}' per catch-up of `draft_sync` (the engine's
  lazy draft cache, if any) before a round at K >= 1, put before that round's K (the engine
  chooses K first, then catches the draft up)."""
  choose, repeat, probe = policy.choose, policy.repeat, policy.observe_probe
  syncing = [False]
  if draft_sync is not None:
    before_round = draft_sync.before_round

    def synced(decodes, k):
      syncing[0] = True
      try:
        return before_round(decodes, k)
      finally:
        syncing[0] = False
    draft_sync.before_round = synced

  def chosen(request_ids):
    k, ks = choose(request_ids)
    events.append(int(k))
    return k, ks

  def repeated(*args, **kwargs):
    out = repeat(*args, **kwargs)
    if out is not None:
      events.append(int(out[0]))
    return out

  def probed(request_id, successes, trials, later_successes, later_trials, confidence=None):
    tracker = getattr(policy, 'tracker', None)
    alpha = f' g{tracker.global_alpha:.2f}' if tracker is not None else ''
    if syncing[0] and events and isinstance(events[-1], int):
      events.insert(len(events) - 1, f'{{{successes:.0f}/{trials:.0f}{alpha}}}')
    else:
      events.append(f'[{successes:.0f}/{trials:.0f}{alpha}]')
    return probe(request_id, successes, trials, later_successes, later_trials, confidence)

  policy.choose, policy.repeat, policy.observe_probe = chosen, repeated, probed


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--batch', type=int, default=4, help='engine slots B')
  parser.add_argument('--passes', type=int, default=6, help='passes over the workloads')
  parser.add_argument('--workloads', default='json,code,retrieval',
                      help='comma-separated, run in this order every pass')
  parser.add_argument('--settings', default='k0=k:0;k2=k:2;goodput=k:8,k_policy:goodput',
                      help='as configs/batching.py settings; the first is the baseline')
  parser.add_argument('--set', action='append', default=[], metavar='SETTING.PATH=VALUE',
                      help='override an attribute of a built engine (repeatable)')
  args = parser.parse_args()
  if args.batch < 1 or args.passes < 1:
    parser.error(f'--batch and --passes must be >= 1, got {args.batch} and {args.passes}')
  workloads = args.workloads.split(',')
  unknown = [w for w in workloads if w not in WORKLOADS]
  if unknown:
    parser.error(f'--workloads {args.workloads!r}: unknown {unknown}; known: {sorted(WORKLOADS)}')
  config, settings, engines, tokenizer = policy_host_time.build_study(args, parser)
  n = max(config.requests_per_slot * args.batch, config.min_requests)

  def prompts_of(workload, repeat):
    return [p.tokens for p in make_prompts(workload, tokenizer, n, config.prompt_len,
                                           split='test',
                                           seed=batching.prompt_seed(config, repeat))]
  stop = tokenizer.eos_ids
  warm = [list(p[:config.chunk_size]) for p in prompts_of(workloads[0], 0)[:args.batch]]
  for name in engines:          # one untimed pass each (first-call host work)
    batching.measure({name: engines[name]}, warm, max_tokens=4, stop_tokens=stop)
  events = {name: [] for name, (e, _) in engines.items() if e.policy is not None and
            batching.describe(settings[name])['k_policy'] != 'fixed'}
  for name in events:
    _traced(engines[name][0].policy, events[name], engines[name][0].draft_sync)
  base = next(iter(engines))
  speeds = collections.defaultdict(list)
  for p in range(args.passes):
    for w, workload in enumerate(workloads):
      for trace in events.values():
        trace.clear()
      runs = batching.measure(engines, prompts_of(workload, p), max_tokens=config.max_tokens,
                              stop_tokens=stop, seed=p * len(workloads) + w)
      ratios = {name: run['tokens_per_s'] / runs[base]['tokens_per_s']
                for name, run in runs.items()}
      for name, ratio in ratios.items():
        speeds[(workload, name)].append(ratio)
      line = ' '.join(f'{name} {ratio:.2f}' + (
          f' (α {runs[name]["acceptance_rate"]:.2f})'
          if name not in events and runs[name]['acceptance_rate'] is not None else '')
                      for name, ratio in ratios.items())
      print(f'pass {p} {workload}: {line}')
      for name, trace in events.items():
        print(f'  {name}: {runs_of(trace)}')
  for workload in workloads:
    means = {name: statistics.mean(speeds[(workload, name)]) for name in engines}
    best = max((name for name in engines if name not in events), key=means.get)
    print(f'{workload}: ' + ' '.join(f'{name} {m:.3f}' for name, m in means.items()) +
          ''.join(f'; {name} / best static ({best}) {means[name] / means[best]:.3f}'
                  for name in events))


if __name__ == '__main__':
  main()
