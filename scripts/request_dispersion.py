"""How far apart requests' accepted tokens spread against independent rounds at one acceptance
estimate: φ (`jaxspec.engine.acceptance.Dispersion`, the factor the goodput policy puts on the
makespan model's variances), per workload, at fixed K.

    PYTHONPATH=$PWD python scripts/request_dispersion.py [--k 2,4] [--requests 24]
        [--workloads json,code,retrieval]

One engine per K at batch size 1 with the shipped pair (`configs/batching.py`'s shape), greedy,
the study's held-out prompts (64 tokens, `max_tokens` 32). The first-proposal α and the later
positions' β are fitted over every round of the workload (a request's last round left out: its
room may cut it) and stand in for the policy's global estimates; each request's accepted count
over its rounds then gives z = (A - M) / sqrt(V), and φ is their variance around their mean
(no prior). Also printed: the spread (sd) of the requests' rounds against the one independent
rounds would give. φ = 1 is what the makespan model assumed before `Dispersion`.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from configs import batching as batching_config
from experiments import batching
from jaxspec.engine import makespan
from jaxspec.engine.acceptance import Dispersion


def fitted_acceptance(accepted, k: int) -> list:
  """[k] P(proposal j accepted | the ones before it were), j = 1..k, from accepted counts n of
  rounds at cap k (1.0 where no round reached position j)."""
  out = []
  for j in range(1, k + 1):
    reached = sum(1 for n in accepted if n >= j - 1)
    out.append(sum(1 for n in accepted if n >= j) / reached if reached else 1.0)
  return out


def main():
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--k', default='2,4')
  parser.add_argument('--requests', type=int, default=24)
  parser.add_argument('--workloads', default='json,code,retrieval')
  args = parser.parse_args()
  try:
    ks = [int(k) for k in args.k.split(',')]
  except ValueError:
    parser.error(f'--k must be comma-separated ints, got {args.k!r}')
  if min(ks) < 1 or args.requests < 2:
    parser.error(f'--k values must be >= 1 and --requests >= 2, got {args.k} and '
                 f'{args.requests}')
  config = batching_config.get_config()
  config.batch_size, config.workloads = 1, args.workloads
  config.settings = 'k0=k:0;' + ';'.join(f'k{k}=k:{k}' for k in ks)
  try:
    workloads, (_, _, _, _, tokenizer), engines = batching.load_study(config)
  except ValueError as err:
    parser.error(str(err))
  for workload in workloads:
    for k in ks:
      _, outputs = batching.decode_alone(engines[f'k{k}'][0], config, tokenizer, workload,
                                         args.requests)
      lengths = [out.metrics.accepted_lengths[:-1] for out in outputs]
      p = fitted_acceptance([t - 1 for ls in lengths for t in ls], k)
      alpha, later = p[0], (p[1:] + [p[-1]] * 8)[:8]
      dispersion = Dispersion(window=len(lengths), prior_requests=0.0)
      for i, ls in enumerate(lengths):
        for t in ls:
          dispersion.round(i, k, t - 1)
        dispersion.finish(i, alpha, later)
      mean, var = makespan.token_moments(np.array([alpha]), k, np.array([later]))
      e, v = mean[0, k], var[0, k]
      rounds = [len(ls) for ls in lengths]
      model_sd = statistics.mean((sum(ls) * v / e ** 3) ** 0.5 for ls in lengths)
      print(f'{workload} K={k}: {len(lengths)} requests, α {alpha:.2f}, β '
            f'{[round(b, 2) for b in p[1:]]}; φ {dispersion.value:.2f}; rounds per request '
            f'{statistics.mean(rounds):.1f}, sd {statistics.pstdev(rounds):.2f} against '
            f'{model_sd:.2f} for independent rounds')


if __name__ == '__main__':
  main()
