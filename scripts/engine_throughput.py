"""Throughput of the continuous-batching engine, speculative (K) against plain (K = 0), with the
shipped pair on held-out JSON prompts; ratios are taken within this one run.

    PYTHONPATH=$PWD python scripts/engine_throughput.py [--batch 1,4] [--k 4] [--requests 8]

For each batch size B: one engine per K (compiled by `warm_up` before timing), the same requests
(greedy, stop at <|eos|>) submitted at once, K = 0 and K = k runs alternated `--repeats` times.
tokens/s = tokens emitted ÷ wall seconds of `Engine.run()` (prefill, decode and the host-side
scheduler included). At B = 1 it also times one request through the engine against
`generate`'s compiled loop (the engine's host overhead). A first measurement, not the issue's
sweep (configs/batching.py, later).
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxspec.data import Tokenizer, make_prompts
from jaxspec.decoding import generate
from jaxspec.engine import Engine
from jaxspec.models import load_model, shipped


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', default='1,4')
  parser.add_argument('--k', type=int, default=4)
  parser.add_argument('--requests', type=int, default=8)
  parser.add_argument('--prompt_len', type=int, default=128)
  parser.add_argument('--max_tokens', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  target, target_params = load_model(shipped('target'))
  draft, draft_params = load_model(shipped('draft'))
  tok = Tokenizer.load(shipped('tokenizer.json'))
  prompts = [p.tokens for p in make_prompts('json', tok, args.requests, args.prompt_len)]
  per_request = -(-(args.prompt_len + args.max_tokens + args.k + 1) // 16)
  print(f'{args.requests} json prompts of {args.prompt_len} tokens, max_tokens '
        f'{args.max_tokens}, greedy, stop at eos')
  print('| B | K=0 tokens/s | K=%d tokens/s | ratio K=%d / K=0 | α (K=%d) |' % ((args.k,) * 3))
  print('|---|---|---|---|---|')
  for b in [int(x) for x in args.batch.split(',')]:
    engines = {}
    for k in (0, args.k):
      spec = dict(draft=draft, draft_params=draft_params, k=k) if k else {}
      engines[k] = Engine(target, target_params, num_slots=b, num_pages=b * per_request + 1,
                          chunk_size=64, max_seq_len=per_request * 16, **spec)
      engines[k].warm_up()
    rates = {0: [], args.k: []}
    alpha = []
    for _ in range(args.repeats):
      for k, engine in engines.items():
        engine.prefix.reset()          # every run prefills its prompts (no cross-run hits)
        ids = [engine.add_request(p, max_tokens=args.max_tokens, stop_tokens=tok.eos_ids)
               for p in prompts]
        start = time.perf_counter()
        outs = engine.run()
        seconds = time.perf_counter() - start
        rates[k].append(sum(len(outs[i].tokens) for i in ids) / seconds)
        if k:
          alpha.append(sum(outs[i].metrics.accepted for i in ids) /
                       sum(outs[i].metrics.proposed for i in ids))
        for i in ids:
          del engine.outputs[i]
    if b == 1:
      overhead = engine_vs_generate(engines[0], target, target_params, prompts[0],
                                    args.max_tokens, args.repeats)
    r0, rk = statistics.mean(rates[0]), statistics.mean(rates[args.k])
    ratios = [y / x for x, y in zip(rates[0], rates[args.k])]
    print(f'| {b} | {r0:.0f} | {rk:.0f} | {statistics.mean(ratios):.2f} '
          f'({min(ratios):.2f}–{max(ratios):.2f}) | {statistics.mean(alpha):.2f} |', flush=True)
  if 1 in [int(x) for x in args.batch.split(',')]:
    print(f'one request of {args.max_tokens} tokens, engine (B=1, K=0) seconds ÷ generate '
          f'seconds: {statistics.mean(overhead):.2f} ({min(overhead):.2f}–{max(overhead):.2f})')


def engine_vs_generate(engine, target, target_params, prompt, max_tokens, repeats):
  """Per repeat, seconds of one request through `engine` ÷ through `generate` (compiled
  loop), no stop token, alternated in this process."""
  generate(target, target_params, [list(prompt)], max_new_tokens=max_tokens)   # compile
  ratios = []
  for _ in range(repeats):
    start = time.perf_counter()
    generate(target, target_params, [list(prompt)], max_new_tokens=max_tokens)
    reference = time.perf_counter() - start
    engine.prefix.reset()
    rid = engine.add_request(prompt, max_tokens=max_tokens)
    start = time.perf_counter()
    engine.run()
    ratios.append((time.perf_counter() - start) / reference)
    del engine.outputs[rid]
  return ratios


if __name__ == '__main__':
  main()
