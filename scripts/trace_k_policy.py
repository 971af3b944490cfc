"""Trace an adaptive K policy through the batching study's passes: which K it ran round by round,
what each probe scored and where its global α stood, beside the static settings' speedups, pass
by pass.

    python scripts/trace_k_policy.py [--batch 4] [--passes 6] [--workloads json,code,retrieval]
        [--settings 'k0=k:0;k2=k:2;goodput=k:8,k_policy:goodput']
        [--set 'goodput.policy.spec_margin=0.1' ...] [--scores]

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

With --scores, every full scoring of a goodput policy's choice (`GoodputK._scores` called from
`choose`, not from probes' what-ifs) is listed under its runs (`scoring_line`): the queue, the
requests' rooms, how it priced them (`GoodputK.pricing`), their mean α / β estimates, the cost
table's t(0) and t(2) / t(0), host seconds per round at K = 0 and 2, the one-time costs of
K >= 1 (`once_s`: the catch-up `sync_s` plus, after K = 0 rounds, the switch's slower first
rounds; `split_s` apart) and each K <= 4's goodput over K = 0's before the policy's margins: what
it weighed each time.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np

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


def scoring_line(policy, alphas, later, goodput: dict) -> str:
  """One full scoring of a `GoodputK` as text: 'q2 n4 rooms100 queue a0.62 b0.55 t0 5.10ms t2/t0
  1.90 h0 0.80ms h2 1.20ms once 12.0ms (sync 10.0) split 21.0ms | 1:1.041 2:0.987 ...', from its
  arguments alphas [n] and later [n, K_max] and its result {K: goodput}: each K <= 4 over the
  smallest K's goodput (K = 0's when it is a candidate; a missing K is left out; '-' when that
  is 0: nothing left to emit), and as `GoodputK.pricing` gives them for the policy's state as
  `_scores` left it, the rows it scored (those not finished: n) with their rooms (none unless
  one per request: 'rooms-') and mean α / β, how it priced ('finish', 'queue' or 'round') and
  the cost table it priced with (the full batch's for 'queue', else the round's bucket's)."""
  rooms, priced, keep = policy.pricing(len(alphas))
  table = policy.live.table(None if priced == 'queue' else policy.rows)
  base = min(goodput)
  ratio = ' '.join(f'{k}:{v / goodput[base]:.3f}' if goodput[base] else f'{k}:-'
                   for k, v in sorted(goodput.items()) if base < k <= 4)
  t2 = f' t2/t{base} {table[2] / table[base]:.2f}' if 2 in table and base < 2 else ''

  def mean(values) -> str:          # over the rows the scoring kept
    return f'{float(np.mean(np.asarray(values)[keep])):.2f}' if keep else '-'

  return (f'q{policy.queued or 0} n{len(keep)} rooms{"-" if rooms is None else sum(rooms)} '
          f'{priced} a{mean(alphas)} b{mean(later)} '
          f't{base} {table[base] * 1e3:.2f}ms{t2} h0 {policy.host.of(0) * 1e3:.2f}ms '
          f'h2 {policy.host.of(2) * 1e3:.2f}ms once {policy.once_s * 1e3:.1f}ms '
          f'(sync {policy.sync_s * 1e3:.1f}) split {policy.split_s * 1e3:.1f}ms | {ratio}')


def _traced(policy, events: list, draft_sync=None, scores: list | None = None) -> None:
  """Wrap the policy's K choices (`repeat`, `choose`) and catch-up scores to append to `events`:
  a K per round, '[s/t gα]' per probe and '{s/t gα}' per catch-up of `draft_sync` (the engine's
  lazy draft cache, if any) before a round at K >= 1, put before that round's K (the engine
  chooses K first, then catches the draft up). With a `scores` list and a policy that scores
  (`GoodputK._scores`), each scoring inside `choose` appends its `scoring_line` there."""
  choose, repeat, probe = policy.choose, policy.repeat, policy.observe_probe
  choosing = [False]
  if scores is not None and hasattr(policy, '_scores'):
    score = policy._scores

    def scored(alphas, later, *args, **kwargs):
      out = score(alphas, later, *args, **kwargs)
      if choosing[0]:
        scores.append(scoring_line(policy, alphas, later, out))
      return out
    policy._scores = scored
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
    choosing[0] = True
    try:
      k, ks = choose(request_ids)
    finally:
      choosing[0] = False
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
  parser.add_argument('--scores', action='store_true',
                      help="list every full scoring of a goodput policy's choice")
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
  scorings = {name: [] for name in events} if args.scores else {}
  for name in events:
    _traced(engines[name][0].policy, events[name], engines[name][0].draft_sync,
            scorings.get(name))
  base = next(iter(engines))
  speeds = collections.defaultdict(list)
  for p in range(args.passes):
    for w, workload in enumerate(workloads):
      for trace in [*events.values(), *scorings.values()]:
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
        for line in scorings.get(name, ()):
          print(f'    {line}')
  for workload in workloads:
    means = {name: statistics.mean(speeds[(workload, name)]) for name in engines}
    best = max((name for name in engines if name not in events), key=means.get)
    print(f'{workload}: ' + ' '.join(f'{name} {m:.3f}' for name, m in means.items()) +
          ''.join(f'; {name} / best static ({best}) {means[name] / means[best]:.3f}'
                  for name in events))


if __name__ == '__main__':
  main()
