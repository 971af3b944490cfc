"""Replay K policies at batch size 1 on recorded greedy acceptance: every policy on the same
rounds, without timing noise, in seconds.

At greedy decoding a round at K that starts at output position t accepts min(L_t, K) proposals,
L_t the run of positions from t where the draft's argmax, given the target's own tokens before
it, is the target's token (after an accepted proposal the draft's context is the target's), and
emits one more token. So one teacher-forced draft pass over each request's greedy output
(`acceptance_sequence`) fixes every round of every K schedule (`replay`). A round's seconds are
the start-up table d(K) of a B = 1 engine (`Engine.step_costs`, idle rows). Left out against an
engine run: host time; the lazy draft's catch-up seconds (the policy is told 0, so it returns to
K >= 1 more readily); the engine probes only now and then, here every K = 0 round gives the
policy a one-token probe observation; and a round cut by the output's end is observed only up
to it (the engine sees what the draft did past a stop token). Prints, per workload, each
policy's decode speedup over K = 0 (tokens per table second), its fraction of the best static K
and its rounds per K.

    PYTHONPATH=$PWD python scripts/replay_k_policy.py [--requests 8] [--k-max 8]
        [--workloads json,code,retrieval] [--static 1,2,3,4,8] [--costs 1,1.46,1.70,...]

--costs gives d(K) / d(0) for K = 0..k_max instead of timing them (the start-up table moves by
~10 % between runs on the development CPU, and the replay's ratios with it).

The study's shape (`configs/batching.py`): the shipped pair, held-out prompts of 64 tokens,
`max_tokens` 32, greedy. Measured engine runs add host work and catch-ups on top
(`experiments.run --config=configs/batching.py --config.batch_size=1`).
"""

from __future__ import annotations

import argparse
import collections

import jax.numpy as jnp
import numpy as np

from configs import batching as batching_config
from experiments import batching
from experiments.common import parse_workloads
from experiments.speculative import load_pair
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


def replay(policy: KPolicy, sequences, costs: dict, max_tokens: int) -> tuple:
  """Run `policy` (set up, with its costs) over requests decoded one after another at B = 1.

  Args:
    sequences: per request, its `acceptance_sequence` (a request emits len + 1 tokens: the
      prefill's and one per position).
    costs: {K: seconds} of one decode round (the policy's candidates); max_tokens: the
      requests' token limit (what the policy is told their room is).
  Returns:
    [(K, tokens emitted)] per decode round, in order.
  """
  rounds = []
  for i, seq in enumerate(sequences):
    pos, emitted, total = 0, 1, len(seq) + 1
    queued = len(sequences) - i - 1
    while emitted < total:
      room = max_tokens - emitted
      policy.rooms, policy.rows, policy.queued, policy.slots = [room], 1, queued, 1
      policy.queue_rooms = [max_tokens - 1] if queued else []
      policy.split_s, policy.split_tokens, policy.sync_s = 0.0, 0, 0.0
      again = policy.repeat([i], 1, queued, [room])
      k, caps = again if again is not None else policy.choose([i])
      cap = min(caps[0], total - emitted - 1)
      run = 0
      while run < cap and seq[pos + run]:
        run += 1
      if k == 0:                                  # a probe: one drafted token scored
        policy.observe(i, 0, 0, float(seq[pos]), 1.0)
      elif cap:         # capped at the output's end: no rejection is known past it
        policy.observe(i, cap, run, float(run), float(run + (run < cap)))
      policy.round_timing(k, costs[k], 0.0)
      pos, emitted = pos + run + 1, emitted + run + 1
      rounds.append((k, run + 1))
    policy.forget(i)
  return rounds


def _policies(names, static, k_max):
  out = {f'k{k}': (lambda k=k: FixedK(), k) for k in static}
  out.update({name: (lambda name=name: make_policy(name), k_max) for name in names})
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--requests', type=int, default=8)
  parser.add_argument('--k-max', type=int, default=8)
  parser.add_argument('--workloads', default='json,code,retrieval')
  parser.add_argument('--static', default='1,2,3,4,8')
  parser.add_argument('--costs', default='', help='d(K) / d(0) for K = 0..k_max')
  args = parser.parse_args()
  static = [int(k) for k in args.static.split(',') if k]
  if args.requests < 1 or not 1 <= args.k_max <= 8 or any(not 1 <= k <= args.k_max
                                                          for k in static):
    parser.error(f'want --requests >= 1, --k-max in [1, 8] and --static in [1, --k-max], got '
                 f'{args.requests}, {args.k_max}, {static}')
  config = batching_config.get_config()
  config.batch_size, config.workloads = 1, args.workloads
  try:
    given = [float(c) for c in args.costs.split(',') if c.strip()]
  except ValueError:
    parser.error(f'--costs must be numbers, got {args.costs!r}')
  if given and (len(given) != args.k_max + 1 or min(given) <= 0):
    parser.error(f'--costs wants {args.k_max + 1} positive numbers (K = 0..{args.k_max}), '
                 f'got {given}')
  config.settings = 'k0=k:0' + ('' if given else f';gp=k:{args.k_max},k_policy:goodput')
  workloads = parse_workloads(config)
  target, target_params, draft, draft_params, tokenizer = load_pair(config)
  engines = batching.build_engines(config, batching.parse_settings(config.settings), target,
                                   target_params, draft, draft_params)
  # d(K), K = 0..k_max, of a B = 1 round: given, or the goodput engine's start-up table.
  costs = dict(enumerate(given)) if given else dict(engines['gp'][0].step_costs)
  print('d(K) / d(0): ' + ', '.join(f'{k}: {t / costs[0]:.2f}' for k, t in costs.items()))
  engine = engines['k0'][0]
  for workload in workloads:
    prompts, outputs = batching.decode_alone(engine, config, tokenizer, workload, args.requests)
    sequences = [acceptance_sequence(draft, draft_params, p.tokens, out.tokens)
                 for p, out in zip(prompts, outputs)]
    speed = {'k0': (1.0 / costs[0], {0: sum(map(len, sequences))})}   # one token a round
    for name, (make, k) in _policies(['schedule', 'goodput'], static, args.k_max).items():
      policy = make()
      policy.setup(k)
      if policy.needs_costs:
        policy.set_costs({c: costs[c] for c in policy.candidates})
      rounds = replay(policy, sequences, costs, config.max_tokens)
      speed[name] = (sum(e for _, e in rounds) / sum(costs[k] for k, _ in rounds),
                     collections.Counter(k for k, _ in rounds))
    base = speed['k0'][0]
    best = max(v for n, (v, _) in speed.items() if n.startswith('k'))
    print(f'{workload} ({sum(map(len, sequences))} drafted positions, '
          f'{np.mean([s for q in sequences for s in q]):.2f} accepted):')
    for name, (v, by_k) in speed.items():
      print(f'  {name:>9}: {v / base:.3f}x K = 0, {v / best:.3f} of the best static; rounds by K '
            f'{dict(sorted(by_k.items()))}')


if __name__ == '__main__':
  main()
