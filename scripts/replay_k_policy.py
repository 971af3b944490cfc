"""Replay K policies on recorded greedy acceptance: every policy on the same rounds, priced by a
fixed cost table (no timing noise), in seconds of wall time, at batch size 1 or on a B-slot
engine's schedule.

At greedy decoding a round at K that starts at output position t accepts min(L_t, K) proposals,
L_t the run of positions from t where the draft's argmax, given the target's own tokens before
it, is the target's token (after an accepted proposal the draft's context is the target's), and
emits one more token. So one teacher-forced draft pass over each request's greedy output
(`acceptance_sequence`) fixes every round of every K schedule; `replay` runs a policy over them
with the engine's scheduling (admissions, prefill calls, row buckets, finishes). A round's
seconds are the start-up table of a B-slot engine (`Engine.row_costs`, idle rows) and a
prefill call's `Engine.prefill_costs`. Left out against an engine run: host time, and live
rounds costing more than idle ones (at B = 2 the replay puts static K = 1-4 4-30 % above
K = 0, where the study measured 0.85-1.06x: the policy's live ratios and h(K) see that, this
replay does not, nor the live prefill calls' ratio that scales the split,
`Engine.prefill_live`); the lazy draft's catch-up seconds (the policy is told 0, so it returns
to K >= 1 more readily); the engine probes only now and then, here every K = 0 round gives the
policy a one-token probe observation; and a round cut by the output's end is observed only up
to it (the engine sees what the draft did past a stop token). Prints, per workload, each
policy's speedup over K = 0 (table seconds), its fraction of the best static K and its rounds
per K (with --batch > 1, the requests each prefill call admitted).

    python scripts/replay_k_policy.py [--batch 1] [--requests N] [--sets 1] [--k_max 8]
        [--workloads json,code,retrieval] [--static 1,2,3,4,8] [--costs 1,1.46,1.70,...]
        [--live runs/batching/sweep/results.jsonl]

--costs (B = 1) gives d(K) / d(0) for K = 0..k_max instead of timing them and counts decode
rounds only (the start-up table moves by 10-15 % between runs on the development CPU, and the
replay's ratios with it). --live RESULTS prices full rounds by a batching study's measured
decode-only step seconds at this B (`live_table`; other row buckets scaled alike), host work
included: at B = 2 the static ratios then match the study's within 0.035. N defaults to the
study's max(2 B, 8). K = 0 is always replayed (the baseline). --sets S replays S prompt sets of N
requests, drawn as the study's passes draw theirs (`experiments.batching.prompt_seed`: seed + s),
one after another through each policy (its estimates carry over, as an engine's do between
passes): a policy's speedup is then the mean over the sets of its per-set speedup, its fraction
that over the best static setting's mean (the study's *fraction*), and the per-set fractions
(each set's own best static, as a study with one prompt set for every pass measured) follow.
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import statistics
import types
from typing import Optional

import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax.numpy as jnp
import numpy as np

from configs import batching as batching_config
from experiments import batching
from experiments.records import read_results
from jaxspec.engine import device, speculation
from jaxspec.engine.goodput import GoodputK
from jaxspec.engine.k_policy import FixedK, KPolicy, make_policy
from jaxspec.models.llama import Transformer


def acceptance_sequence(draft, draft_params, prompt, output) -> list:
  """[len(output) - 1] of 0/1: whether the draft's greedy token given prompt + output[:i] is
  output[i], for i = 1..len(output) - 1 (output[0] comes from the prefill, never drafted).

  Args:
    draft: the draft's `ModelConfig`; prompt, output: token ids (the target's greedy output).
  """
  tokens = list(prompt) + list(output)
  ids = jnp.asarray([tokens], jnp.int32)
  logits, _ = Transformer(draft).apply(draft_params, ids, jnp.arange(len(tokens))[None])
  guess = np.asarray(jnp.argmax(logits[0], axis=-1))
  start = len(prompt)
  return [int(guess[start + i - 1] == tokens[start + i]) for i in range(1, len(output))]


def replay(policy: KPolicy, sequences, costs: dict, max_tokens: int, slots: int = 1,
           prefill_costs: Optional[dict] = None) -> tuple:
  """Run `policy` (set up, with its costs) over the requests, all queued at once, on an engine
  of `slots` slots as `jaxspec.engine.Engine` schedules them: each step admits waiting requests
  into free slots (first come, first served) and prefills them in one call, which emits their
  first token, then runs one decode round for the requests that were decoding before it, in a
  row bucket (`Engine.decode_buckets`) at the K the policy chooses; a request that emitted its
  whole output frees its slot for the next step. The policy is asked through
  `speculation.choose`, as the engine asks it (rooms, row bucket, queue, its rooms, slots, the
  split admission `speculation.split_cost`, one prefill chunk per prompt), but with no lazy
  draft: no probes or catch-up seconds of the engine's (a K = 0 round observes a probe here: its
  position, and the pair with the one before when the round before scored it,
  `KPolicy.observe_probe`).

  Args:
    sequences: per request, its `acceptance_sequence` (a request emits len + 1 tokens: the
      prefill's and one per position).
    costs: {rows: {K: seconds}} of one decode round per row bucket (each bucket the engine
      would use; the policy's candidates); max_tokens: the requests' token limit (what the
      policy is told their room is).
    slots: the engine's batch slots; prefill_costs: {rows: seconds} one prefill call per
      prefill bucket (powers of two up to `slots`; None: prefill is free).
  Returns:
    (rounds: [(K, rows, {request index: tokens emitted})] per decode round, prefills: [requests
    admitted] per prefill call, seconds: the decode rounds' and prefill calls' table seconds).
  """
  buckets = device.decode_buckets(slots, None)
  prefill_buckets = device.prefill_buckets(slots)
  pos, emitted = [0] * len(sequences), [0] * len(sequences)
  total = [len(seq) + 1 for seq in sequences]
  waiting, held, decoding = list(range(len(sequences))), [], []
  rounds, prefills, seconds = [], [], 0.0
  scored = {}          # request -> the position its last K = 0 round scored
  while waiting or held:
    admitted = waiting[:slots - len(held)]
    waiting = waiting[len(admitted):]
    if admitted:
      prefills.append(len(admitted))
      rows = min(b for b in prefill_buckets if b >= len(admitted))
      seconds += (prefill_costs or {}).get(rows, 0.0)
      for i in admitted:
        emitted[i] = 1
    held += admitted
    if decoding:
      rows = min(b for b in buckets if b >= len(decoding))
      queued = len(waiting) + len(admitted)
      decodes = [types.SimpleNamespace(id=i, room=max_tokens - emitted[i]) for i in decoding]
      queue = [types.SimpleNamespace(prefill_tokens=[0], max_tokens=max_tokens)] * len(waiting)

      def horizon(decodes=decodes, queue=queue, queued=queued):   # `speculation.horizon`'s
        split = speculation.split_cost(decodes, queue, prefill_costs or {}, 1)
        return split, queued, [max_tokens - 1] * min(queued, slots), slots

      k, caps = speculation.choose(policy, decodes, rows, policy.k_max, queued=queued,
                                   horizon=horizon)
      out = {}
      for i, cap in zip(decoding, caps):
        seq, p = sequences[i], pos[i]
        cap = min(cap, total[i] - emitted[i] - 1)
        run = 0
        while run < cap and seq[p + run]:
          run += 1
        if k == 0:      # a probe: one drafted token scored, with its neighbour if scored too
          before = float(seq[p - 1]) if scored.get(i) == p - 1 else 0.0
          policy.observe_probe(i, float(seq[p]), 1.0, before * seq[p], before)
          scored[i] = p
        elif cap:       # capped at the output's end: no rejection is known past it
          policy.observe(i, cap, run, float(run), float(run + (run < cap)))
        pos[i], emitted[i], out[i] = p + run + 1, emitted[i] + run + 1, run + 1
      policy.round_timing(k, costs[rows][k], 0.0)
      seconds += costs[rows][k]
      rounds.append((k, rows, out))
      for i in decoding:
        if emitted[i] >= total[i]:
          policy.forget(i)
          held.remove(i)
    decoding = sorted(held)
  return rounds, prefills, seconds


def live_table(records, batch: int, k_max: int) -> dict:
  """{K: seconds} for K = 0..k_max of one decode round of a B-slot engine as the batching study
  measured it: the median `round_s` (a decode-only engine step, host work included) of its fixed
  draft-model settings (and K = 0) at batch size `batch`, linear in K between the measured K
  (constant past the largest).

  Raises:
    ValueError: no K = 0 record, or none at K >= 1, at that batch size.
  """
  by_k = collections.defaultdict(list)
  for r in records:
    if r.get('batch_size') == batch and r.get('k_policy') == 'fixed' and \
        r.get('round_s') is not None and (r.get('k') == 0 or r.get('drafter') == 'model'):
      seconds = float(r['round_s'])
      if not 0 < seconds < math.inf:
        raise ValueError(f'a study record at B={batch} K={r["k"]} has round_s={seconds}: a '
                         f'round time must be a finite number > 0')
      by_k[int(r['k'])].append(seconds)
  known = sorted(by_k)
  if not known or known[0] != 0 or len(known) < 2:
    raise ValueError(f'the study records hold no decode-only round times at K = 0 and K >= 1 '
                     f'for batch size {batch} (found K {known})')
  return dict(enumerate(np.interp(range(k_max + 1), known,
                                  [float(np.median(by_k[k])) for k in known])))


def summarize(seconds: dict, statics) -> dict:
  """{name: (speedup, fraction, per_set)} from seconds {name: [replayed seconds per prompt
  set]} (every policy the same sets; 'k0' among them): speedup the mean over the sets of
  seconds['k0'] / the policy's, fraction that over the largest mean speedup of the `statics`
  names (K = 0 included), per_set the policy's speedup in each set over that set's largest static
  one."""
  speed = {name: [base / t for base, t in zip(seconds['k0'], times)]
           for name, times in seconds.items()}
  best = max(statistics.mean(speed[name]) for name in statics)
  per_set_best = [max(speed[name][i] for name in statics) for i in range(len(seconds['k0']))]
  return {name: (statistics.mean(v), statistics.mean(v) / best,
                 [x / b for x, b in zip(v, per_set_best)]) for name, v in speed.items()}


def _policies(static, k_max):
  """{name: (make, K_max)}: K = 0 (a goodput policy with no other candidate), each static K,
  the schedule and goodput."""
  out = {'k0': (lambda: make_policy(GoodputK(candidates=[0])), k_max)}
  out.update({f'k{k}': (lambda k=k: FixedK(), k) for k in static})
  out.update({name: (lambda name=name: make_policy(name), k_max)
              for name in ('schedule', 'goodput')})
  return out


def main():
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--batch', type=int, default=1, help='engine slots B (default 1)')
  parser.add_argument('--requests', type=int, default=0,
                      help='requests per workload (default: the study\'s max(2 B, 8))')
  parser.add_argument('--sets', type=int, default=1,
                      help='prompt sets of N requests replayed in turn, drawn as the study\'s '
                           'passes draw theirs (default 1)')
  parser.add_argument('--k_max', '--k-max', type=int, default=8,
                      help='K_max of the adaptive policies, in [1, 8] (default 8)')
  parser.add_argument('--workloads', default='json,code,retrieval')
  parser.add_argument('--static', default='',
                      help='the static K replayed beside K = 0 (default 1,2,3,4,8 up to --k_max)')
  parser.add_argument('--costs', default='',
                      help='d(K) / d(0) for K = 0..k_max instead of timing them (B = 1 only; '
                           'decode rounds only; skips the goodput engine\'s start-up timing)')
  parser.add_argument('--live', default='',
                      help='a batching study results.jsonl: price full rounds by its measured '
                           'decode-only step seconds at this B')
  args = parser.parse_args()
  try:
    static = [int(k) for k in args.static.split(',') if k.strip()] if args.static else \
        [k for k in (1, 2, 3, 4, 8) if k <= args.k_max]
    if args.static and not static:
      raise ValueError
    given = [float(c) for c in args.costs.split(',') if c.strip()]
  except ValueError:
    parser.error(f'--static (at least one K) and --costs must be numbers, got {args.static!r}, '
                 f'{args.costs!r}')
  for name, value, ok in (('--batch', args.batch, args.batch >= 1),
                          ('--requests', args.requests, args.requests >= 0),
                          ('--sets', args.sets, args.sets >= 1),
                          ('--k_max', args.k_max, 1 <= args.k_max <= 8),
                          ('--static', static, all(1 <= k <= args.k_max for k in static))):
    if not ok:
      parser.error(f'{name} {value} is out of range (--batch >= 1, --requests >= 0, --sets >= 1, '
                   f'--k_max in [1, 8], --static in [1, --k_max={args.k_max}])')
  if given and (args.batch != 1 or args.live or len(given) != args.k_max + 1 or
                not all(0 < c < math.inf for c in given)):
    parser.error(f'--costs wants --batch 1, no --live and {args.k_max + 1} finite positive '
                 f'numbers (K = 0..{args.k_max}), got --batch {args.batch} and {given}')
  live = None
  if args.live:               # read before the engines are built: a bad file is named at once
    try:
      live = live_table(read_results(args.live), args.batch, args.k_max)
    except (OSError, ValueError) as err:
      parser.error(f'--live {args.live}: {err}')
  config = batching_config.get_config()
  config.batch_size, config.workloads = args.batch, args.workloads
  requests = args.requests or max(config.requests_per_slot * args.batch, config.min_requests)
  config.settings = 'k0=k:0' + ('' if given else f';gp=k:{args.k_max},k_policy:goodput')
  try:
    workloads, pair, engines = batching.load_study(config)
  except ValueError as err:
    parser.error(str(err))
  target, target_params, draft, draft_params, tokenizer = pair
  # Round costs per row bucket and prefill calls: given (B = 1, decode only), or the goodput
  # engine's start-up tables.
  if given:
    costs, prefill_costs = {1: dict(enumerate(given))}, None
  else:
    costs, prefill_costs = engines['gp'][0].row_costs, engines['gp'][0].prefill_costs
  if live is not None:
    # Live rounds of the full bucket from the study; other buckets scaled alike per K.
    idle = costs[args.batch]
    costs = {rows: {k: t * live[k] / idle[k] for k, t in table.items()}
             for rows, table in costs.items()}
  full = costs[args.batch]
  print(f'B = {args.batch}, {requests} requests per workload; d(K) / d(0) of a full round: ' +
        ', '.join(f'{k}: {t / full[0]:.2f}' for k, t in full.items()) +
        ('; prefill calls counted' if prefill_costs else '; decode rounds only') +
        (f'; live rounds from {args.live}' if args.live else ''))
  one = batching_config.get_config()
  one.batch_size = 1
  alone = batching.build_engines(one, {'k0': {'k': 0}}, target, target_params, draft,
                                 draft_params)['k0'][0] if args.batch > 1 else engines['k0'][0]
  for workload in workloads:
    sets = []
    for i in range(args.sets):        # the study's pass i draws its prompts with this seed
      drawn = copy.deepcopy(config)
      drawn.seed = batching.prompt_seed(config, i)
      prompts, outputs = batching.decode_alone(alone, drawn, tokenizer, workload, requests)
      sets.append([acceptance_sequence(draft, draft_params, p.tokens, out.tokens)
                   for p, out in zip(prompts, outputs)])
    seconds, by_k, calls = {}, {}, {}
    for name, (make, k) in _policies(static, args.k_max).items():
      policy = make()
      policy.setup(k)
      if policy.needs_costs:
        policy.set_costs({c: full[c] for c in policy.candidates},
                         by_rows={rows: {c: t[c] for c in policy.candidates}
                                  for rows, t in costs.items()})
      seconds[name], by_k[name], calls[name] = [], collections.Counter(), []
      for sequences in sets:
        rounds, admitted, spent = replay(policy, sequences, costs, config.max_tokens,
                                         args.batch, prefill_costs)
        seconds[name].append(spent)
        by_k[name].update(k for k, _, _ in rounds)
        calls[name] += admitted
    drafted = [s for sequences in sets for q in sequences for s in q]
    print(f'{workload} ({len(drafted)} drafted positions, the draft\'s greedy token is the '
          f'target\'s at {np.mean(drafted):.2f} of them' +
          (f'; {args.sets} prompt sets of {requests} requests' if args.sets > 1 else '') + '):')
    summary = summarize(seconds, [n for n in seconds if n[1:].isdigit()])
    for name, (speedup, fraction, per_set) in summary.items():
      print(f'  {name:>9}: {speedup:.3f}x over K = 0, {fraction:.3f} of the best static; '
            f'rounds by K {dict(sorted(by_k[name].items()))}' +
            (f'; requests per prefill call {calls[name]}' if args.batch > 1 and args.sets == 1
             else '') +
            (f'; per set {" ".join(f"{x:.3f}" for x in per_set)}' if args.sets > 1 else ''))

if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
