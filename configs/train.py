"""Train a model on the train split of the real-text corpora (stdlib code + botocore JSON).

    python -m experiments.run --config=configs/train.py:target   # the shipped target (~1 h)
    python -m experiments.run --config=configs/train.py:draft    # the shipped draft (~10 min)
    python -m experiments.run --config=configs/train.py:smoke
    # then copy WORKDIR/train/RUN_ID/model to jaxspec/assets/{target,draft} (or set --config.out)
    python -m experiments.run --config=configs/train.py:target --config.checkpoint_dir=/tmp/ckpt
    # interrupted? the same command continues from the last state (every 100 steps)

The shipped pair was made with exactly these settings (seed 0).
"""

import ml_collections


def get_config(arg='target'):
  c = ml_collections.ConfigDict()
  c.experiment = 'train'
  c.model = 'target-12m'         # a preset of jaxspec.models.PRESETS
  c.tokenizer = ''               # '' = the shipped tokenizer
  c.steps = 1100
  c.batch_size = 8
  c.seq_len = 512
  c.learning_rate = 1e-3
  c.warmup_steps = 100
  c.weight_decay = 0.1
  c.grad_clip = 1.0
  c.seed = 0
  c.max_docs = 0                 # per corpus kind; 0 = all
  c.eval_batches = 8
  c.store_dtype = 'bfloat16'     # dtype of the saved tensors
  c.out = ''                     # model directory; '' = WORKDIR/train/RUN_ID/model
  c.checkpoint_dir = ''          # resumable training state; the same command again resumes it
  c.checkpoint_every = 100       # steps between states written there (and at the end)
  if arg in (None, '', 'target'):
    pass
  elif arg == 'draft':
    c.model = 'draft-1m'
    c.steps = 1500
    c.learning_rate = 2e-3
  elif arg == 'smoke':
    c.model = 'test-tiny'
    c.steps = 3
    c.batch_size = 2
    c.seq_len = 64
    c.warmup_steps = 1
    c.max_docs = 4
    c.eval_batches = 1
  else:
    raise ValueError(f'unknown variant {arg!r} of configs/train.py (known: target, draft, smoke)')
  return c
