"""Whether the target's confidence tells the draft's acceptance: per request, the target's mean
top probability max softmax(logits) over its greedy output against the first proposal's
acceptance α there (the draft's argmax equal to the target's), per workload and pooled.

    python scripts/confidence_vs_alpha.py [--requests 16] [--seeds 0,1]
        [--workloads json,code,retrieval] [--first 1,2,4,8,16]

The batching study's pair, prompts (64 tokens, test split, one draw per seed) and output length
(32 tokens, greedy, cut after a stop token); the target decodes each prompt, then one causal
pass of each model over prompt + output gives both models' logits at every output position
(teacher forcing: the α a K = 1 round would see). Prints per workload the mean α, the mean
confidence and their correlation over the requests, and the pooled correlation; then, pooled,
for each n of --first the correlation of α with the mean of the request's first n top
probabilities and that mean's least-squares slope over the largest n's: what the confidence a
new request is priced with after n tokens tells (a prefill's first token is n = 1). The goodput
policy moves a request's α prior by the target's confidence at K = 0, where it is free, weighed
by the tokens behind it (`jaxspec.engine.acceptance.AlphaTracker.confidence_shift`,
`confidence_weight`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from configs import batching as batching_config
from experiments.speculative import load_pair
from jaxspec.data import make_prompts
from jaxspec.data.workloads import WORKLOADS
from jaxspec.models.llama import Transformer


def _logits(config, params, tokens: np.ndarray) -> np.ndarray:
  """[B, T, V] float32 logits of a causal pass over tokens [B, T] int32 (no cache)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return np.asarray(_apply(config, params, jnp.asarray(tokens), positions))


@jax.jit
def _softmax(logits):
  return jax.nn.softmax(logits, axis=-1)


_apply = jax.jit(lambda config, params, tokens, positions:
                 Transformer(config).apply(params, tokens, positions)[0], static_argnums=0)


def request_stats(target, target_params, draft, draft_params, prompts, max_tokens: int,
                  stop_ids) -> list:
  """[(α, confidence, tokens, top probabilities)] per prompt: the target's greedy output of up
  to `max_tokens` tokens (cut after a stop id) and, over its positions, the share where the
  draft's argmax is the target's (α), the target's mean top probability (confidence), the
  output's length and the target's top probability at each of its positions. Prompts (int lists) are
  right-padded to one width; each greedy step recomputes the whole sequence (a measuring tool,
  not a decoder)."""
  lengths = np.array([len(p) for p in prompts])
  tokens = np.zeros((len(prompts), int(lengths.max()) + max_tokens), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  rows = np.arange(len(prompts))
  for step in range(max_tokens):
    at = lengths + step - 1
    tokens[rows, at + 1] = _logits(target, target_params, tokens)[rows, at].argmax(-1)
  p_target = np.asarray(_softmax(_logits(target, target_params, tokens)))
  d_argmax = _logits(draft, draft_params, tokens).argmax(-1)
  stats = []
  for i, n in enumerate(lengths):
    out = tokens[i, n:n + max_tokens].tolist()
    m = next((j + 1 for j, t in enumerate(out) if t in stop_ids), max_tokens)
    at = np.arange(n - 1, n - 1 + m)
    agree = p_target[i, at].argmax(-1) == d_argmax[i, at]
    top = p_target[i, at].max(-1)
    stats.append((float(agree.mean()), float(top.mean()), int(m), top.tolist()))
  return stats


def _varies(values) -> bool:
  return bool(np.var(values) > 1e-12)


def first_tokens(stats, counts) -> list:
  """[(n, correlation, slope)] for each n in counts: over the requests of `stats`
  (`request_stats`), the correlation of α with the mean top probability of the first n output
  tokens (all of them when an output is shorter), and that mean's least-squares slope of α over
  the one at the largest n (1 there; below 1 where a mean of n tokens over-moves an estimate
  fitted on means of more: the weight `AlphaTracker.confidence_weight` gives it). None where
  the means or α do not vary."""
  alpha = np.array([s[0] for s in stats])
  means = {n: np.array([np.mean(s[3][:n]) for s in stats]) for n in counts}
  slopes = {n: float(np.cov(x, alpha, bias=True)[0, 1] / np.var(x)) if _varies(x) else None
            for n, x in means.items()}
  top = slopes[max(counts)] if counts else None
  return [(n, float(np.corrcoef(means[n], alpha)[0, 1])
           if _varies(means[n]) and _varies(alpha) else None,
           slopes[n] / top if slopes[n] is not None and top else None) for n in counts]


def _text(value) -> str:
  return 'n/a' if value is None else f'{value:.2f}'


def main():
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--requests', type=int, default=16, help='prompts per workload and seed')
  parser.add_argument('--seeds', default='0,1', help='comma-separated prompt draws')
  parser.add_argument('--workloads', default='json,code,retrieval')
  parser.add_argument('--first', default='1,2,4,8,16',
                      help='comma-separated token counts n: α against the first n tokens\' '
                           'confidence, pooled (empty: skip)')
  args = parser.parse_args()
  try:
    seeds = [int(s) for s in args.seeds.split(',')]
    counts = [int(n) for n in args.first.split(',')] if args.first else []
  except ValueError as error:
    parser.error(f'--seeds {args.seeds!r} / --first {args.first!r}: {error}')
  if any(n < 1 for n in counts):
    parser.error(f'--first {args.first!r}: each count must be >= 1')
  workloads = args.workloads.split(',')
  unknown = [w for w in workloads if w not in WORKLOADS]
  if unknown:
    parser.error(f'--workloads {args.workloads!r}: unknown {unknown}; known: {sorted(WORKLOADS)}')
  if args.requests < 1:
    parser.error(f'--requests must be >= 1, got {args.requests}')
  config = batching_config.get_config()
  target, target_params, draft, draft_params, tokenizer = load_pair(config)
  pooled = []
  for workload in workloads:
    stats = []
    for seed in seeds:
      prompts = [p.tokens for p in make_prompts(workload, tokenizer, args.requests,
                                                config.prompt_len, split='test', seed=seed)]
      stats += request_stats(target, target_params, draft, draft_params, prompts,
                             config.max_tokens, set(tokenizer.eos_ids))
    alpha, confidence = np.array([s[0] for s in stats]), np.array([s[1] for s in stats])
    pooled += stats
    print(f'{workload}: {len(stats)} requests, α {alpha.mean():.3f} (sd {alpha.std():.3f}), '
          f'confidence {confidence.mean():.3f} (sd {confidence.std():.3f}), correlation '
          f'{np.corrcoef(alpha, confidence)[0, 1]:.2f}')
  if len(workloads) > 1:
    alpha, confidence = np.array([s[0] for s in pooled]), np.array([s[1] for s in pooled])
    print(f'pooled: {len(pooled)} requests, correlation {np.corrcoef(alpha, confidence)[0, 1]:.2f}')
  for n, correlation, slope in first_tokens(pooled, counts):
    print(f'first {n} tokens: correlation {_text(correlation)}, slope {_text(slope)} of the '
          f'first {max(counts)}\'s')


if __name__ == '__main__':
  main()
