"""Structured context hydration vs prompt stuffing over replayed agent loops (issue 8).

    python -m experiments.run --config=configs/hydration.py                 # draft extracts
    python -m experiments.run --config=configs/hydration.py --config.extractor=oracle
    python -m experiments.run --config=configs/hydration.py --config.extractor=target
    python -m experiments.run --config=configs/hydration.py:smoke           # < 60 s

Each episode replays `num_turns` describe_operation calls on one held-out AWS service (real
botocore records). Per turn and strategy (stuffing, stuffing_prefix_cache, hydration,
hydration_prefix_cache) one record: big-model context tokens, tokens prefilled, TTFT, KV bytes;
hydration records add the extraction time, retries, fallback and fidelity. Then one summary
record per strategy, and α of constrained speculative decoding on the extraction prompts with
the schema constraint on and off.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'hydration'
  c.target = ''            # the big model; '' = shipped target
  c.draft = ''             # the small model; '' = shipped draft
  c.tokenizer = ''         # tokenizer.json; '' = the target's own, else the shipped one
  c.dtype = 'float32'      # params and activations ('bfloat16' halves the memory)
  c.num_episodes = 3
  c.num_turns = 10
  c.max_result_tokens = 400  # tool results longer than this are skipped (not cut)
  c.extractor = 'draft'    # 'draft' | 'target' | 'oracle'
  c.extractor_k = 0        # > 0 (with extractor='target'): the extractor decodes speculatively
                           #   (draft proposes, target checks)
  c.constrained = True     # False: extraction without the schema constraint (ablation)
  c.shots = 1              # demonstrations (tool result -> record) in the extractor's prompt
  c.max_extract_tokens = 256
  c.retries = 2
  c.retry_temperature = 1.0
  c.strategies = 'stuffing,stuffing_prefix_cache,hydration,hydration_prefix_cache'
  c.ttft_repeats = 3       # TTFT = fastest of this many prefills of the same turn
  c.alpha_prompts = 10     # extraction prompts for α with the constraint on / off (0 = skip)
  c.alpha_k = 4
  c.alpha_temperatures = '0.0,1.0'
  c.page_size = 16
  c.seed = 0
  if arg == 'smoke':
    c.num_episodes = 1
    c.num_turns = 3
    c.ttft_repeats = 1
    c.alpha_prompts = 1
    c.alpha_temperatures = '1.0'
    c.retries = 1
    c.max_extract_tokens = 160
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r} of configs/hydration.py (known: smoke)')
  return c
