"""How often the draft's j-th proposal of a round is accepted given that the ones before it were,
per workload, at one fixed K: P(n >= j | n >= j - 1) from the accepted counts n of every decode
round. An i.i.d. acceptance gives the same value at every j; the (α, β) model of the goodput
policy (`jaxspec.engine.acceptance`) one value at j = 1, one per request for the later j, and a
global profile over the later j (`AlphaTracker.profile`).

    python scripts/acceptance_by_position.py [--k 8] [--requests 8]
        [--workloads json,code,retrieval]

One engine at batch size 1 with the shipped pair (`configs/batching.py`'s shape), greedy, the
study's held-out prompts (64 tokens, `max_tokens` 32); a request's last round is left out (its
room may cut it). Prints, per workload, the rounds counted and the conditional acceptance at
j = 1..K, with the rounds that reached position j in brackets.
"""

from __future__ import annotations

import argparse
import collections

import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import batching as batching_config
from experiments import batching


def conditional_acceptance(accepted, k: int) -> list:
  """[(P(n >= j | n >= j - 1), rounds with n >= j - 1)] for j = 1..k from accepted counts n
  (ints in [0, k]); the probability is None where no round reached position j."""
  counts = collections.Counter(accepted)
  reach = [sum(v for n, v in counts.items() if n >= j) for j in range(k + 1)]
  return [(reach[j] / reach[j - 1] if reach[j - 1] else None, reach[j - 1])
          for j in range(1, k + 1)]


def main():
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--k', type=int, default=8)
  parser.add_argument('--requests', type=int, default=8)
  parser.add_argument('--workloads', default='json,code,retrieval')
  args = parser.parse_args()
  if args.k < 1 or args.requests < 1:
    parser.error(f'--k and --requests must be >= 1, got {args.k} and {args.requests}')
  config = batching_config.get_config()
  config.batch_size, config.settings, config.workloads = 1, f'k0=k:0;k=k:{args.k}', args.workloads
  try:
    workloads, (_, _, _, _, tokenizer), engines = batching.load_study(config)
  except ValueError as err:
    parser.error(str(err))
  engine = engines['k'][0]
  for workload in workloads:
    _, outputs = batching.decode_alone(engine, config, tokenizer, workload, args.requests)
    accepted = [e - 1 for out in outputs for e in out.metrics.accepted_lengths[:-1]]
    cells = ' '.join('-' if p is None else f'{p:.2f} ({n})'
                     for p, n in conditional_acceptance(accepted, args.k))
    print(f'{workload}: {len(accepted)} rounds; P(accept j | accepted before), j = 1..{args.k}: '
          f'{cells}')


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
