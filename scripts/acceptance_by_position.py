"""How often the draft's j-th proposal of a round is accepted given that the ones before it were,
per workload, at one fixed K: P(n >= j | n >= j - 1) from the accepted counts n of every decode
round. An i.i.d. acceptance gives the same value at every j; the (α, β) model of the goodput
policy (`jaxspec.engine.acceptance`) one value at j = 1, one per request for the later j, and a
global profile over the later j (`AlphaTracker.profile`).

    python scripts/acceptance_by_position.py [--k 8] [--requests 8]
        [--workloads json,code,retrieval] [--after]

One engine at batch size 1 with the shipped pair (`configs/batching.py`'s shape), greedy, the
study's held-out prompts (64 tokens, `max_tokens` 32); a request's last round is left out (its
room may cut it). Prints, per workload, the rounds counted and the conditional acceptance at
j = 1..K, with the rounds that reached position j in brackets. With --after, also the first
proposal's acceptance split by how the request's round before ended (`after_round`): a request's
first decode round, after a round that rejected a proposal (its last token the target's
correction of a draft token) and after a round that accepted all K (its last token the target's
bonus token after K accepted ones). The goodput policy prices one first-proposal α per request
whatever the round before did; a split far from even says that α depends on K (at K = 1 most
rounds follow an accepted one, at K = 8 most follow a rejection).
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


def after_round(accepted_lengths, k: int) -> dict:
  """{'first' | 'after_reject' | 'after_all': (first proposals accepted, rounds)} over requests'
  rounds at a fixed K: per request, its decode rounds' accepted counts n in order (ints in
  [0, k]); a round's first proposal is accepted iff n >= 1, and it counts under how the round
  before ended: none (the request's first round), n < k (a rejection) or n = k (all accepted;
  a round its request's room capped below k counts as a rejection).

  Raises:
    ValueError: k < 1 or a count outside [0, k] (named).
  """
  if k < 1:
    raise ValueError(f'k must be >= 1, got {k}')
  out = {'first': [0, 0], 'after_reject': [0, 0], 'after_all': [0, 0]}
  for rounds in accepted_lengths:
    before = None
    for n in rounds:
      if not 0 <= n <= k:
        raise ValueError(f'an accepted count must be in [0, {k}], got {n}')
      kind = 'first' if before is None else 'after_all' if before == k else 'after_reject'
      out[kind][0] += int(n >= 1)
      out[kind][1] += 1
      before = n
  return {kind: tuple(v) for kind, v in out.items()}


def main():
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--k', type=int, default=8)
  parser.add_argument('--requests', type=int, default=8)
  parser.add_argument('--workloads', default='json,code,retrieval')
  parser.add_argument('--after', action='store_true',
                      help='also split the first proposal\'s acceptance by the round before')
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
    by_request = [[e - 1 for e in out.metrics.accepted_lengths[:-1]] for out in outputs]
    accepted = [n for rounds in by_request for n in rounds]
    cells = ' '.join('-' if p is None else f'{p:.2f} ({n})'
                     for p, n in conditional_acceptance(accepted, args.k))
    print(f'{workload}: {len(accepted)} rounds; P(accept j | accepted before), j = 1..{args.k}: '
          f'{cells}')
    if args.after:
      split = after_round(by_request, args.k)
      print('  first proposal accepted: ' + ', '.join(
          f'{kind.replace("_", " ")} ' + (f'{s / n:.2f} ({n})' if n else '- (0)')
          for kind, (s, n) in split.items()))


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
