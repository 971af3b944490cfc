"""What exact mode costs to compile: the cached model call (decode, verification, a prefill
chunk) of T tokens, traced, lowered and compiled by XLA with `ModelConfig.exact_verify` on and
off, in one process.

    python scripts/exact_compile_time.py [--model test-tiny] [--tokens 1,4,16,32] [--batch 1]
        [--opt_level 0]

Exact mode makes a (K+1)-token verification round like K + 1 one-token decode steps bit for
bit (`jaxspec.models.llama.matmul_rows`, `RMSNorm(exact=True)`,
`jaxspec.kernels.attention.gqa_attention_per_query`). Every greedy-equality test runs in it,
so its compile time is a large part of the test suite's. Per T the script prints the jaxpr's
equation count and the trace, lower and XLA compile seconds in each mode, and exact's compile
seconds over the default's. --opt_level sets XLA:CPU's backend optimisation level (the tests
run at 0, tests/conftest.py; XLA's default is 3; called in a process whose JAX backend has
started, the level it started with stays). Nothing runs: the weights are shapes
(`jax.eval_shape`), which is all that compiles. One untimed trace comes first (the first pays
JAX's own start-up). T is at most 32 (`llama.EXACT_ROWS`: longer calls are not exact); exact
mode also cuts a call's batch x T rows into blocks of 32 (`matmul_rows`), so beyond batch 1 its
program grows with batch x T / 32 (--batch is refused above 256).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

PAGE = 8
MAX_BATCH = 256     # sequences per call; 4x the study's largest batch (B = 64)


def compile_times(model: str, tokens: int, batch: int, exact: bool, compile_: bool = True):
  """{'eqns', 'trace_s', 'lower_s', 'compile_s'} of `Transformer.apply` jitted on a paged cache,
  `tokens` tokens per sequence at positions 0..tokens - 1, `batch` sequences (compile_s None
  unless compile_). Seconds of wall time; eqns: the top-level jaxpr's equation count.
  Raises ValueError for a model that is not a preset (`ModelConfig.from_name`)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxspec.cache import PageAllocator, pages_needed
  from jaxspec.models import ModelConfig, Transformer, cache_for
  from jaxspec.training import init_params

  config = ModelConfig.from_name(model, exact_verify=exact, dtype='float32')
  params = jax.eval_shape(lambda: init_params(config, 0))   # shapes only: nothing runs
  pages = pages_needed(tokens, PAGE)
  alloc = PageAllocator(batch * pages + 1)
  table = np.array([alloc.allocate(pages) for _ in range(batch)])
  cache = cache_for(config, table, alloc.num_pages, PAGE)
  ids = jnp.zeros((batch, tokens), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
  start = time.perf_counter()
  traced = jax.jit(Transformer(config).apply).trace(params, ids, positions, cache)
  traced_at = time.perf_counter()
  lowered = traced.lower()
  lowered_at = time.perf_counter()
  if compile_:
    lowered.compile()
  done = time.perf_counter()
  return {'eqns': len(traced.jaxpr.jaxpr.eqns), 'trace_s': traced_at - start,
          'lower_s': lowered_at - traced_at, 'compile_s': done - lowered_at if compile_ else None}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='test-tiny')
  parser.add_argument('--tokens', default='1,4,16,32', help='comma-separated T values')
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--opt_level', type=int, default=0, choices=range(4))
  args = parser.parse_args(argv)
  try:
    tokens = [int(t) for t in args.tokens.split(',')]
  except ValueError:
    parser.error(f'--tokens must be comma-separated ints, got {args.tokens!r}')
  if any(t < 1 for t in tokens) or args.batch < 1:
    parser.error(f'--tokens and --batch must be >= 1, got {tokens} and {args.batch}')
  if args.batch > MAX_BATCH:     # exact mode's program grows with batch x T / 32 row blocks
    parser.error(f'--batch {args.batch} is above {MAX_BATCH}: exact mode compiles one block of '
                 f'32 rows per 32 of batch x T, so its program (and its compile memory) grows '
                 f'with --batch (the largest B of the batching study is 64)')
  # Before JAX initialises its backend (the imports of jax are deferred for this).
  flags = os.environ.get('XLA_FLAGS', '')
  os.environ['XLA_FLAGS'] = f'{flags} --xla_backend_optimization_level={args.opt_level}'.strip()
  from jaxspec.models import ModelConfig
  from jaxspec.models.llama import EXACT_ROWS
  if max(tokens) > EXACT_ROWS:
    parser.error(f'--tokens {max(tokens)} is above {EXACT_ROWS} (llama.EXACT_ROWS): such a call '
                 f'is not exact, and both modes would compile the same program')
  try:
    ModelConfig.from_name(args.model)
  except ValueError as error:
    parser.error(f'--model: {error}')
  compile_times(args.model, 1, args.batch, False, compile_=False)      # JAX's start-up, untimed
  print(f'{args.model}, batch {args.batch}, XLA:CPU -O{args.opt_level}')
  print(f'{"T":>3} {"mode":>7} {"eqns":>5} {"trace s":>8} {"lower s":>8} {"compile s":>10}')
  for t in tokens:
    compiled = {}
    for exact in (False, True):
      r = compile_times(args.model, t, args.batch, exact)
      compiled[exact] = r['compile_s']
      print(f'{t:>3} {"exact" if exact else "default":>7} {r["eqns"]:>5} {r["trace_s"]:>8.2f} '
            f'{r["lower_s"]:>8.2f} {r["compile_s"]:>10.2f}')
    print(f'{t:>3} exact / default compile: {compiled[True] / compiled[False]:.2f}')


if __name__ == '__main__':
  main()
