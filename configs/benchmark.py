"""Benchmark: autoregressive vs speculative tokens/s over K in one run, decode-step MBU, and the
draft/target cost ratio c.

    python -m experiments.run --config=configs/benchmark.py
    python -m experiments.run --config=configs/benchmark.py:smoke

One record per K (speedup, α, τ, and the speedup Leviathan et al.'s formula predicts from the
measured per-position acceptance and c, with and without the measured cost v of a K+1-token
verification pass in decode steps), then one record with the decode step's bytes, time and MBU
for each model.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'benchmark'
  c.target = ''
  c.draft = ''
  c.tokenizer = ''         # tokenizer.json; '' = the target's own, else the shipped one
  c.dtype = 'float32'      # params and activations ('bfloat16' halves the memory)
  c.workload = 'json'
  c.ks = '1,2,4,8'
  c.temperature = 0.0
  c.max_new_tokens = 128
  c.num_prompts = 8
  c.prompt_len = 384
  c.page_size = 16
  c.repeats = 2          # timed passes over the prompts per decoder (best pass is reported)
  c.seed = 0
  if arg == 'smoke':
    c.ks = '1,2'
    c.num_prompts = 1
    c.max_new_tokens = 16
    c.prompt_len = 128
    c.repeats = 1
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r} of configs/benchmark.py (known: smoke)')
  return c
