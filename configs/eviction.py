"""KV eviction under a budget: quality (perplexity, next-token agreement with the full cache),
peak KV bytes and decode tokens/s per policy x budget, on long held-out code and JSON.

    python -m experiments.run --config=configs/eviction.py                        # H2O at 20 %
    python -m experiments.run --config=configs/eviction.py --config.policy=window \
        --config.budget_frac=0.1
    python -m experiments.run --config=configs/eviction.py:smoke                  # seconds
    python -m experiments.run --config=configs/eviction.py:worker                 # flat KV memory
    python -m experiments.sweep --config=configs/eviction.py                      # policy x budget

Quality mode feeds every sequence through the target one token at a time with the cache under the
policy and scores each next-token prediction against the same model with the full cache.
Worker mode generates `worker_tokens` tokens from one held-out prompt in chunks and records the
cached tokens and KV bytes after each chunk.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'eviction'
  c.mode = 'quality'        # 'quality' | 'worker'
  c.target = ''             # model directory; '' = the shipped target
  c.tokenizer = ''          # tokenizer.json; '' = the target's own, else the shipped one
  c.dtype = 'float32'      # params and activations ('bfloat16' halves the memory)
  c.workloads = 'code,json'
  c.policy = 'h2o'          # full | window | sinks | h2o | h2o_norm | tova
  c.budget_frac = 0.2       # budget = round(budget_frac * seq_len) live tokens per sequence
  c.seq_len = 512           # tokens per held-out sequence (the window the target was trained on)
  c.num_sequences = 8       # per workload
  c.batch_size = 4
  c.page_size = 16
  c.use_kernel = False      # Pallas kernels instead of jnp refs (compiled on a GPU; CPU: slow)
  c.worker_tokens = 4096    # worker mode: tokens generated
  c.worker_chunk = 512      # worker mode: tokens per measured chunk
  c.worker_budget = 256     # worker mode: budget in tokens
  c.seed = 0
  if arg == 'smoke':
    c.workloads = 'code'
    c.seq_len = 96
    c.num_sequences = 2
    c.batch_size = 2
  elif arg == 'worker':
    c.mode = 'worker'
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r} of configs/eviction.py (known: smoke, worker)')
  return c


def get_sweep():
  """policy x budget (5, 10, 20, 50, 100 % of the sequence), plus one worker-loop run."""
  from experiments.sweeps import product
  quality = product(policy=['window', 'sinks', 'h2o', 'h2o_norm', 'tova'],
                    budget_frac=[0.05, 0.1, 0.2, 0.5, 1.0])
  return quality + [dict(mode='worker')]
