"""Throughput of the continuous-batching engine, speculative (K) against plain (K = 0), with the
shipped pair on held-out JSON prompts; ratios are taken within this one run.

    python scripts/engine_throughput.py [--batch 1,4] [--k 4] [--requests 8]
        [--drafter model|ngram] [--k_policy fixed|schedule|goodput]

For each batch size B: one engine per K (compiled by `warm_up` before timing), the same requests
(greedy, stop at <|eos|>) submitted at once, K = 0 and K = k runs alternated `--repeats` times.
`--k 1,2,4` times several fixed K; `--k_policy schedule|goodput` adds an engine with that policy
(K_max = the largest k) to the alternation, and prints its throughput against the best static
choice (K = 0 included) and how often it chose each K. `--drafter ngram` drafts by prompt lookup
instead of the shipped draft model.
tokens/s = tokens emitted ÷ wall seconds of `Engine.run()` (prefill, decode and the host-side
scheduler included). At B = 1 it also times one request through the engine against
`generate`'s compiled loop (the engine's host overhead). A quick check; the full study is
configs/batching.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxspec.checks import check_int
from jaxspec.data import Tokenizer, make_prompts
from jaxspec.decoding import generate
from jaxspec.decoding.generate import MAX_K
from jaxspec.engine import Engine, check_outputs
from jaxspec.models import load_model, shipped


def _ints(text: str, flag: str) -> list[int]:
  """A comma-separated list of ints >= 1 (ValueError naming the flag otherwise)."""
  try:
    values = [int(x) for x in text.split(',') if x.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise ValueError(f'{flag} takes comma-separated ints >= 1, got {text!r}')
  return values


def main():
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--batch', default='1,4', help='batch sizes B (slots), comma-separated')
  parser.add_argument('--k', default='4', help='fixed K values, comma-separated')
  parser.add_argument('--drafter', default='model', choices=['model', 'ngram'])
  parser.add_argument('--k_policy', default='fixed', choices=['fixed', 'schedule', 'goodput'])
  parser.add_argument('--requests', type=int, default=8)
  parser.add_argument('--prompt_len', type=int, default=128)
  parser.add_argument('--max_tokens', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  for name in ('requests', 'prompt_len', 'max_tokens', 'repeats'):
    check_int(f'--{name}', getattr(args, name), 1)
  batches, ks = _ints(args.batch, '--batch'), _ints(args.k, '--k')
  if max(ks) > MAX_K:                                   # before the models load
    raise ValueError(f'--k: speculation length K must be in [1, {MAX_K}], got {max(ks)}')
  target, target_params = load_model(shipped('target'))
  draft, draft_params = load_model(shipped('draft')) if args.drafter == 'model' else (None, None)
  need = args.prompt_len + args.max_tokens + max(ks) + 1
  context = min([target.max_seq_len] + ([draft.max_seq_len] if draft else []))   # ngram: no draft
  whose = "models'" if draft else "target's"
  if need > context:
    raise ValueError(f'--prompt_len={args.prompt_len} + --max_tokens={args.max_tokens} + K + 1 = '
                     f'{need} tokens exceeds the {whose} context of {context}')
  tok = Tokenizer.load(shipped('tokenizer.json'))
  prompts = [p.tokens for p in make_prompts('json', tok, args.requests, args.prompt_len)]
  k_max = max(ks)
  per_request = -(-(args.prompt_len + args.max_tokens + k_max + 1) // 16)
  adaptive = args.k_policy != 'fixed'
  print(f'{args.requests} json prompts of {args.prompt_len} tokens, max_tokens '
        f'{args.max_tokens}, greedy, stop at eos, drafter {args.drafter}')
  names = [0] + ks + ([args.k_policy] if adaptive else [])
  header = (['B'] + [f'{_label(n)} tokens/s' for n in names] +
            [f'{_label(n)} ÷ K=0' for n in names[1:]] + [f'α (K={ks[-1]})'])
  if adaptive:
    header += [f'{args.k_policy} ÷ best static', f'{args.k_policy} rounds per K']
  print('| ' + ' | '.join(header) + ' |')
  print('|---' * len(header) + '|')
  for b in batches:
    engines = {}
    for name in names:
      k = k_max if name == args.k_policy else name
      spec = dict(k=k, k_policy=name if name == args.k_policy else 'fixed') if k else {}
      if k and args.drafter == 'model':
        spec.update(draft=draft, draft_params=draft_params)
      elif k:
        spec.update(drafter='ngram')
      engines[name] = Engine(target, target_params, num_slots=b,
                             num_pages=b * per_request + 1, chunk_size=64,
                             max_seq_len=min(per_request * 16, context), **spec)
      engines[name].warm_up()
    rates = {name: [] for name in names}
    alpha = []
    for _ in range(args.repeats):
      for k, engine in engines.items():
        engine.prefix.reset()          # every run prefills its prompts (no cross-run hits)
        ids = [engine.add_request(p, max_tokens=args.max_tokens, stop_tokens=tok.eos_ids)
               for p in prompts]
        start = time.perf_counter()
        outs = engine.run()
        seconds = time.perf_counter() - start
        check_outputs(outs[i] for i in ids)
        rates[k].append(sum(len(outs[i].tokens) for i in ids) / seconds)
        if k == ks[-1]:
          alpha.append(sum(outs[i].metrics.accepted for i in ids) /
                       max(1, sum(outs[i].metrics.proposed for i in ids)))
        for i in ids:
          del engine.outputs[i]
    if b == 1:
      overhead = engine_vs_generate(engines[0], target, target_params, prompts[0],
                                    args.max_tokens, args.repeats)
    mean = {n: statistics.mean(r) for n, r in rates.items()}
    row = f'| {b} | ' + ' | '.join(f'{mean[n]:.0f}' for n in names)
    for n in names[1:]:
      ratios = [y / x for x, y in zip(rates[0], rates[n])]
      row += f' | {statistics.mean(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})'
    row += f' | {statistics.mean(alpha):.2f} |'
    if adaptive:
      best = max(mean[n] for n in names if n != args.k_policy)
      policy = engines[args.k_policy]
      row += (f' {mean[args.k_policy] / best:.2f} | ' +
              ', '.join(f'{k}: {c}' for k, c in sorted(policy.k_rounds.items())) + ' |')
    print(row, flush=True)
    if adaptive:
      costs = engines[args.k_policy].step_costs
      print(f'  t(K) of the {args.k_policy} engine at B={b}, ms: ' +
            ', '.join(f'{k}: {t * 1e3:.1f}' for k, t in sorted(costs.items())), flush=True)
  if 1 in batches:
    print(f'one request of {args.max_tokens} tokens, engine (B=1, K=0) seconds ÷ generate '
          f'seconds: {statistics.mean(overhead):.2f} ({min(overhead):.2f}–{max(overhead):.2f})')


def _label(name) -> str:
  return f'K={name}' if isinstance(name, int) else str(name)


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
    check_outputs(engine.run().values())
    ratios.append((time.perf_counter() - start) / reference)
    del engine.outputs[rid]
  return ratios


if __name__ == '__main__':
  try:
    main()
  except ValueError as error:     # bad input: one line naming it
    sys.exit(f'FATAL: {error}')
