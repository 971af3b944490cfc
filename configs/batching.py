"""Speculative decoding against plain continuous batching: the α-threshold study (issue 6).

    python -m experiments.run --config=configs/batching.py --config.batch_size=8   # one B
    python -m experiments.run --config=configs/batching.py:smoke
    python -m experiments.sweep --config=configs/batching.py --workdir=runs         # B = 1 .. 64
    python -m experiments.sweep --config=configs/batching.py --only=batch_size=16
    python -m experiments.report runs/batching/sweep/results.jsonl   # threshold table + plots
    python -m experiments.run --config=configs/batching.py \
      --config.settings='k0=k:0;k3=k:3;big_chunk=k:3,chunk_size:128'   # any Engine kwargs

One run = one batch size B: one engine per setting (same target/draft pair, same pool and
max_seq_len), N = max(requests_per_slot x B, min_requests) held-out prompts per workload and
pass (a new draw each pass: new_prompts) submitted at once, greedy, stop at <|eos|>, the
settings' engines stepped in turn (order shuffled every round), each timed on its own step
clock. Records and fields:
experiments/batching.py; the threshold analysis (cost ratio c(B, K) of a decode round, the α at
which speculation starts to pay, best K, model-vs-measured speedups, adaptive vs best static):
experiments/batching_report.py, written by the sweep (and `experiments.report`) to
threshold.md / threshold.json beside summary.md, plots in plots/.

Sizes: per workload N = max(2 x B, 8) requests of 64-token prompts, 32 tokens each, one pass:
the 7-case sweep took 15-21 min on the 2-core development machine with --config.repeats=3
(20 min 58 s at 81d42c8, the README's tables), most of it compiling the step variants (every
K of every setting at every decode row bucket: up to ~100 at B = 64) and the B = 32 and 64
cases; `:smoke` ~10-60 s.

settings: 'name=key:value,...;name2=...', keys are `Engine` keyword arguments (k, drafter,
k_policy, chunk_size, prefix_caching, ...), and k_policy.OPTION for the K policy's constructor
(k_policy.spec_margin:0.1); k >= 1 uses the draft model unless drafter:ngram (prompt lookup).
The first K = 0 setting is the baseline. Default: K in {0, 1, 2, 4, 8} with the
draft model; goodput (SmartSpec-style K per round from per-request α estimates and the round
costs `warm_up` measures, K_max = 8); schedule (+2 if all accepted, −1 otherwise, K_max = 8);
ngram4 (prompt lookup, K = 4).
"""

import ml_collections

STATIC = 'k0=k:0;k1=k:1;k2=k:2;k4=k:4;k8=k:8'
ADAPTIVE = 'goodput=k:8,k_policy:goodput;schedule=k:8,k_policy:schedule'
NGRAM = 'ngram4=k:4,drafter:ngram'


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'batching'
  c.target = ''            # model directory (ours or Hugging Face); '' = the shipped target
  c.draft = ''             # '' = the shipped draft
  c.tokenizer = ''         # tokenizer.json; '' = the target's own, else the shipped one
  c.dtype = 'float32'
  c.exact_verify = False
  c.settings = ';'.join([STATIC, ADAPTIVE, NGRAM])
  c.workloads = 'json,code,retrieval'
  c.batch_size = 8         # B, engine slots
  c.requests_per_slot = 2  # N = max(requests_per_slot x B, min_requests) requests per
  c.min_requests = 8       #   (workload, setting, repeat): at B = 1-2 a pass of 2-4 requests
                           #   moved a cell's ratio by +-0.05 between runs
  c.prompt_len = 64        # tokens (retrieval: at most); one prefill chunk
  c.max_tokens = 32        # tokens emitted per request at most (stops earlier at <|eos|>)
  c.repeats = 1            # passes over every (workload, setting); the settings step in an
                           # order shuffled every round, seeded per (repeat, workload)
                           # (interleave='runs': whole runs, the order rotated per pass)
  c.new_prompts = True     # each pass draws its own N prompts (seed + repeat); False: every
                           # pass reruns the first pass's N
  c.interleave = 'steps'   # 'steps': engines step in turn (robust under load); 'runs': one by one
  c.cost_rounds = 30      # interleaved idle decode rounds per fixed setting (round-cost ratios)
  c.chunk_size = 64        # prefill chunk per request per step (tokens)
  c.page_size = 16
  c.pool_pages = 0         # device pool in pages; 0 = B requests at full length (no preemption)
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  if arg == 'smoke':
    c.settings = 'k0=k:0;k2=k:2'
    c.workloads = 'json'
    c.batch_size = 2
    c.requests_per_slot = 1
    c.min_requests = 0
    c.prompt_len = 48
    c.max_tokens = 8
    c.repeats = 1
    c.cost_rounds = 3
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r} of configs/batching.py (known: smoke)')
  return c


def get_sweep():
  """One case per batch size B; every workload and setting inside each case."""
  from experiments.sweeps import product
  return product(batch_size=[1, 2, 4, 8, 16, 32, 64])
