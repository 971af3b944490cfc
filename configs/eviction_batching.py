"""Eviction against batching: at the same KV memory (num_pages), the plain continuous-batching
engine (full caches) against the evicting engine (a budget per request, so more requests at once)
for a few policies and budgets; throughput, concurrency, TTFT, TPOT, peak KV bytes and quality
against the plain engine's outputs on the same requests.

    python -m experiments.run --config=configs/eviction_batching.py
    python -m experiments.run --config=configs/eviction_batching.py --config.budgets=64,128 \
        --config.policies=h2o --config.repeats=3
    python -m experiments.run --config=configs/eviction_batching.py --config.lookup_k=3
    python -m experiments.run --config=configs/eviction_batching.py:smoke         # < 1 min
    python -m experiments.report runs/eviction_batching/RUN_ID/results.jsonl       # table + plot

Memory: num_pages = memory_requests x (pages of one whole request: prompt_len + max_tokens + 1
tokens, + lookup_k when K > 0, so a prompt-lookup twin's request fits too) + 1 (the null page).
The plain engine gets plain_slots batch slots (0: as many as the pool can admit at once with
prompt pages only, so memory binds, not slots; lazy growth + preemption do the rest); each
evicting setting gets min(num_requests, (num_pages - 1) // pages per request at
its budget) slots. The control setting (window at a budget of the whole span, so nothing is ever
evicted) separates the evicting engine's own cost and its floating-point differences from the
plain engine (the floor of the quality metrics) from what eviction changes. lookup_k = K > 0 adds,
beside every setting, the same engine speculating with prompt lookup at K (drafter 'ngram'; under
eviction the policy's reuse_delay is K + 1, so its slots, pages per request and slot count may
differ from the K = 0 twin's): speculation and eviction combined, against each alone.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'eviction_batching'
  c.target = ''              # model directory; '' = the shipped target
  c.tokenizer = ''           # tokenizer.json; '' = the target's own, else the shipped one
  c.dtype = 'float32'      # params and activations ('bfloat16' halves the memory)
  c.workloads = 'code,json'  # held-out prompts, split evenly over these
  c.num_requests = 16        # all submitted at once
  c.prompt_len = 384         # tokens per prompt (prompt + max_tokens <= 512, the target's
  c.max_tokens = 128         # trained window); no stop token: every request emits max_tokens
  c.memory_requests = 4      # KV memory, in whole requests (prompt + max_tokens) of full cache
  c.plain_slots = 0          # 0: what the pool admits with prompt pages only
  c.policies = 'window,sinks,h2o'
  c.budgets = '64,128,256'   # live tokens per request and layer
  c.control = True           # also the evicting engine at a budget covering every request
                             # (window@span: nothing evicted, full-cache pages per request)
  c.page_size = 16
  c.chunk_size = 64          # prefill tokens per request per step (both engines)
  c.prefill_group = 4        # evicting engine: tokens per model call inside a prefill chunk
  c.repeats = 3              # timed runs per setting, interleaved across settings
  c.score_reference = True   # log-prob of the plain engine's outputs under each evicting cache
  c.lookup_k = 0             # > 0: every setting also with prompt lookup at this K
  c.seed = 0
  if arg == 'smoke':
    c.workloads = 'code'
    c.num_requests = 3
    c.prompt_len = 40
    c.max_tokens = 8
    c.memory_requests = 1
    c.policies = 'h2o'
    c.budgets = '16'
    c.chunk_size = 16
    c.repeats = 1
    c.control = False
    c.lookup_k = 2
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r} of configs/eviction_batching.py (known: smoke)')
  return c
