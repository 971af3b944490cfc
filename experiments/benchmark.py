"""AR vs speculative decoding over K, as ratios taken in one run, plus decode-step MBU.

Every decoder runs over the same prompts (batch 1), `repeats` times, interleaved; the fastest
pass of each is kept, which filters out other load on a noisy machine.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import check_fields, comma_list, draft_label
from experiments.speculative import load_pair, ratio
from jaxspec.data import WORKLOADS, make_prompts
from jaxspec.data.workloads import check_prompt_len
from jaxspec.decoding import MAX_K, SamplingParams, generate
from jaxspec.cache import PageAllocator, pages_needed
from jaxspec.models import Transformer, cache_for
from jaxspec.eval import (decode_step_bytes, expected_speedup, expected_tokens_per_round, mbu,
                          measure_bandwidth)


def _timed(runs_per_repeat):
  """(tokens after the first, decode seconds) of the fastest repeat."""
  best = None
  for runs in runs_per_repeat:
    tokens = sum(r.num_tokens - len(r.tokens) for r in runs)
    seconds = sum(r.decode_s for r in runs)
    if best is None or tokens / seconds > best[0] / best[1]:
      best = (tokens, seconds)
  return best


def forward_seconds(config, params, context: int, num_tokens: int, page_size: int = 16,
                    repeats: int = 20) -> float:
  """Best-of-`repeats` seconds of one cached target forward pass over `num_tokens` new tokens
  (1 = a decode step, K+1 = a verification) after `context` cached tokens, batch 1."""
  per_seq = pages_needed(context + num_tokens, page_size)
  alloc = PageAllocator(per_seq + 1)
  cache = cache_for(config, np.array([alloc.allocate(per_seq)]), alloc.num_pages, page_size)
  cache = cache.replace(lengths=jnp.array([context], jnp.int32))
  tokens = jnp.zeros((1, num_tokens), jnp.int32)
  positions = context + jnp.arange(num_tokens, dtype=jnp.int32)[None]
  forward = jax.jit(Transformer(config).apply)
  jax.block_until_ready(forward(params, tokens, positions, cache))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(forward(params, tokens, positions, cache))
    best = min(best, time.perf_counter() - start)
  return best


def validate(config) -> None:
  """Check a benchmark config before any model loads (`experiments.common.validate`).

  Raises:
    ValueError: a K out of [1, MAX_K] in ks, repeats or num_prompts < 1, max_new_tokens < 2,
      an unknown workload or a prompt_len too short for it.
  """
  if config.workload not in WORKLOADS:
    raise ValueError(f'config.workload={config.workload!r} names no workload; known: '
                     f'{", ".join(WORKLOADS)}')
  check_prompt_len(config.workload, config.prompt_len, 'config.prompt_len')
  bad = [k for k in comma_list(config, 'ks', convert=int, what='K') if not 1 <= k <= MAX_K]
  if bad:
    raise ValueError(f'config.ks: speculation length K must be in [1, {MAX_K}], got {bad[0]}')
  check_fields(config, ('repeats', 'num_prompts'))
  check_fields(config, ('max_new_tokens',), minimum=2)   # a decode step to time after prefill


def run(config, results) -> None:
  """Measure configs/benchmark.py; one record per K, then one MBU record."""
  validate(config)
  ks = comma_list(config, 'ks', convert=int, what='K')
  sampling = SamplingParams(temperature=float(config.temperature))
  target, tparams, draft, dparams, tokenizer = load_pair(config)
  prompts = [p.tokens for p in make_prompts(config.workload, tokenizer, config.num_prompts,
                                            config.prompt_len, split='test', seed=config.seed)]
  common = dict(max_new_tokens=config.max_new_tokens, sampling=sampling,
                stop_tokens=tokenizer.eos_ids, page_size=config.page_size, seed=config.seed)
  decoders = {'target': lambda p: generate(target, tparams, [p], **common),
              'draft': lambda p: generate(draft, dparams, [p], **common)}
  for k in ks:
    decoders[k] = (lambda k: lambda p: generate(
        target, tparams, [p], draft=draft, draft_params=dparams, k=k,
        **common).check_draft(draft_label(config)))(k)
  for decode in decoders.values():                     # compile every loop before timing
    decode(prompts[0])
  runs = {name: [] for name in decoders}
  for _ in range(config.repeats):
    for name, decode in decoders.items():
      runs[name].append([decode(p) for p in prompts])

  best = {name: _timed(r) for name, r in runs.items()}
  tps = {name: ratio(tokens, seconds) for name, (tokens, seconds) in best.items()}
  step_s = {name: ratio(seconds, tokens) for name, (tokens, seconds) in best.items()}
  c = ratio(step_s['draft'], step_s['target'])
  context = max(len(p) for p in prompts) + config.max_new_tokens // 2
  one = forward_seconds(target, tparams, context, 1, config.page_size)
  for k in ks:
    # v = cost of verifying K+1 tokens in one pass, in decode steps: the formula assumes 1.
    v = forward_seconds(target, tparams, context, k + 1, config.page_size) / one
    last = runs[k][-1]
    accepted = sum(r.accepted for r in last)
    alpha = ratio(accepted, sum(r.proposed for r in last))
    beta = ratio(accepted, accepted + sum(r.rejected for r in last))
    results.write(dict(
        workload=config.workload, k=k, temperature=sampling.temperature,
        acceptance_rate=alpha, acceptance_per_position=beta,
        mean_accepted_length=ratio(sum(r.emitted for r in last), sum(r.target_calls for r in last)),
        expected_tokens_per_round=expected_tokens_per_round(beta, k),
        tokens_per_s_autoregressive=tps['target'], tokens_per_s_speculative=tps[k],
        speedup=ratio(tps[k], tps['target']), cost_ratio_c=c, verify_cost_steps=v,
        expected_speedup=expected_speedup(beta, k, c),
        expected_speedup_with_verify_cost=ratio(expected_tokens_per_round(beta, k), k * c + v)))

  bandwidth = measure_bandwidth()
  kv_slots = max(len(p) for p in prompts) + config.max_new_tokens  # slots a step attends at most
  record = dict(bandwidth_gb_s=bandwidth / 1e9, cost_ratio_c=c)
  for name, (cfg, params) in (('target', (target, tparams)), ('draft', (draft, dparams))):
    step_bytes = decode_step_bytes(cfg, params, 1, kv_slots)
    record[f'{name}_step_mb'] = step_bytes / 1e6
    record[f'{name}_step_ms'] = step_s[name] * 1e3
    record[f'{name}_mbu'] = mbu(step_bytes, step_s[name], bandwidth)
  results.write(record)
  if max(record['target_mbu'], record['draft_mbu']) > 1:
    print(f'warning: an MBU above 1 means a decode step read its bytes faster than the measured '
          f'bandwidth ({bandwidth / 1e9:.1f} GB/s): the measurement was disturbed (a busy '
          'machine: rerun idle) or the weights sit in a last-level cache larger than them, '
          'where MBU against DRAM bandwidth does not apply', flush=True)
