"""Speculative decoding vs autoregressive decoding on held-out real text (the default main job).

    python -m experiments.run                                   # this config, shipped models
    python -m experiments.run --config=configs/speculative.py --config.k=8 --workdir=/tmp/run
    python -m experiments.run --config=configs/speculative.py:smoke
    python -m experiments.run --config.target=/models/llama-8b --config.draft=/models/llama-1b
    python -m experiments.sweep --config=configs/speculative.py  # K x temperature x workload
    # target split over 8 devices (README "Beyond one device"), 2 processes on one machine:
    python -m experiments.run --config.mesh.model=2 --config.mesh.data=4 --config.batch_size=4
    JAX_COORDINATOR_ADDRESS=localhost:9876 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \
      python -m experiments.run --config.mesh.model=2      # and JAX_PROCESS_ID=1 beside it

One results line per workload: acceptance_rate, mean_accepted_length, tokens/s of both decoders,
speedup, TTFT, and (at temperature 0) whether every speculative output equals the autoregressive.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'speculative'
  c.target = ''          # model directory (ours or Hugging Face); '' = the shipped target
  c.draft = ''           # model directory (ours or Hugging Face); '' = the shipped draft
  c.tokenizer = ''       # tokenizer.json; '' = the target's own, else the shipped one
  c.dtype = 'float32'    # params and activations of both models ('bfloat16' halves the memory)
  c.workloads = 'json,code,retrieval'
  c.k = 4                # speculation length K
  c.max_k = 16           # largest K accepted
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.max_new_tokens = 128
  c.num_prompts = 8      # per workload
  c.prompt_len = 384     # tokens
  c.batch_size = 1
  c.page_size = 16
  c.seed = 0
  c.exact_verify = False  # verification rounds bit-for-bit like decode (slower; see README)
  # Devices: data x model must equal the devices of all processes; 1 x 1 = the default device.
  # 'model' splits the target's heads, KV pages and MLP; 'data' the batch (batch_size % data == 0).
  c.mesh = ml_collections.ConfigDict(dict(data=1, model=1))
  # Multi-process runs (jax.distributed): '' / 0 / -1 = read JAX_COORDINATOR_ADDRESS,
  # JAX_NUM_PROCESSES, JAX_PROCESS_ID from the environment (default: one process).
  c.distributed = ml_collections.ConfigDict(
      dict(coordinator_address='', num_processes=0, process_id=-1))
  if arg == 'smoke':
    c.num_prompts = 1
    c.max_new_tokens = 16
    c.prompt_len = 128
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r} of configs/speculative.py (known: smoke)')
  return c


def get_sweep():
  """K x temperature x workload, one case per combination."""
  from experiments.sweeps import product
  return product(k=[1, 2, 4, 8], temperature=[0.0, 1.0], workloads=['json', 'code', 'retrieval'])
