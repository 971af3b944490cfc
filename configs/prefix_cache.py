"""Prefix caching and the host tier on multi-turn agent loops.

    python -m experiments.run --config=configs/prefix_cache.py
    python -m experiments.run --config=configs/prefix_cache.py --config.settings=off,on
    python -m experiments.run --config=configs/prefix_cache.py:smoke

Replays `num_conversations` agent conversations (a shared system prefix of instructions, real
botocore tool schemas and a real code exemplar; each turn re-sends the whole history plus a new
real JSON tool result) under each setting, interleaved turn by turn so that the settings share
machine conditions:

  off       prefix caching off (every turn prefills its whole prompt), large pool
  on        prefix caching on, large pool
  on_small  prefix caching on, a device pool of `small_pool_pages` (too small to keep every
            conversation), no host tier
  on_host   as on_small plus a host tier of `host_pages` pages

One record per (setting, conversation, turn) with TTFT, tokens prefilled, prefix hit rate, and
device/host pages in use; one summary record per setting; plots/ttft_vs_turn.png.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.experiment = 'prefix_cache'
  c.target = ''            # model directory; '' = the shipped target
  c.draft = ''             # used only when k > 0
  c.tokenizer = ''         # tokenizer.json; '' = the target's own, else the shipped one
  c.dtype = 'float32'
  c.k = 0                  # speculation length K; 0 = autoregressive replies
  c.settings = 'off,on,on_small,on_host'
  c.num_conversations = 4
  c.num_turns = 10
  c.prefix_tokens = 320    # shared system prefix, tokens
  c.tool_tokens = 40       # JSON tokens per tool result (+ ~14 of header and marker)
  c.reply_tokens = 12      # max new tokens per reply
  c.page_size = 16
  c.pool_pages = 0         # device pool of off / on; 0 = enough for every conversation
  c.small_pool_pages = 96  # device pool of on_small / on_host (pages)
  c.host_pages = 512       # host tier capacity of on_host (pages)
  c.seed = 0
  if arg == 'smoke':
    c.num_conversations = 2
    c.num_turns = 3
    c.prefix_tokens = 96
    c.tool_tokens = 16
    c.reply_tokens = 4
    c.small_pool_pages = 14
    c.host_pages = 32
  elif arg not in (None, ''):
    raise ValueError(f'unknown variant {arg!r} of configs/prefix_cache.py (known: smoke)')
  return c
