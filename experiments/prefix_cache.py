"""Prefix caching off / on / on with a small pool / on with a host tier, on multi-turn agent loops.

Every setting has its own generator (pool, prefix index, host tier) over the same model; turns are
interleaved setting by setting, so TTFT ratios are taken under the same machine conditions. All
prefill shapes and copies are compiled before anything is timed.
"""

from __future__ import annotations


import numpy as np

from experiments import report
from experiments.common import check_fields, comma_list, draft_label, load_tokenizer
from experiments.speculative import load_pair, ratio
from jaxspec.cache import pages_needed
from jaxspec.data import make_conversations, turn_prompt
from jaxspec.decoding import PrefixCachedGenerator
from jaxspec.decoding.generate import MAX_K
from jaxspec.models import shipped

SETTINGS = ('off', 'on', 'on_small', 'on_host')
REPORT_TURNS = (2, 5, 10)  # 1-based turns whose TTFT ratio the summary states


def _settings(config) -> list[str]:
  # Each once: the same generator would run each turn twice, hitting its own pages.
  return comma_list(config, 'settings', SETTINGS, what='setting')


def _generator(setting, config, models, pool_pages):
  target, target_params, draft, draft_params = models
  spec = dict(draft=draft, draft_params=draft_params, k=config.k) if config.k else {}
  small = setting in ('on_small', 'on_host')
  return PrefixCachedGenerator(
      target, target_params, page_size=config.page_size, prefix_caching=setting != 'off',
      num_pages=(config.small_pool_pages if small else pool_pages) + 1,
      host_pages=config.host_pages if setting == 'on_host' else 0, **spec)


def validate(config) -> None:
  """Check a prefix_cache config before any model loads (`experiments.common.validate`; it reads
  the tokenizer and builds the conversations, ~1 s).

  Raises:
    ValueError: an unknown or repeated setting, K out of [0, MAX_K], a size < 1, a pool or host
      tier too small for one request of the longest turn (`_plan`).
  """
  _check_fields(config)
  _plan(config, _tokenizer(config))


def _tokenizer(config):
  return load_tokenizer(config.tokenizer, config.target or shipped('target'),
                        config.draft or shipped('draft'))


def _check_fields(config) -> None:
  _settings(config)
  if not 0 <= config.k <= MAX_K:
    raise ValueError(f'speculation length K must be an int in [0, {MAX_K}] (0 = off), got '
                     f'{config.k}')
  check_fields(config, ('reply_tokens', 'num_conversations', 'num_turns', 'page_size'))


def _plan(config, tokenizer) -> dict:
  """The conversations and the pages they need: convs, slack (tokens past a reply: K + 1, or 1),
  longest (prompt tokens of the last turn at most), per_request (pages one request can take),
  pool_pages (the full pool: config.pool_pages, or every conversation's per_request).

  Raises:
    ValueError: pool_pages, small_pool_pages or host_pages below one request's pages for the
      settings that use it (named).
  """
  settings = _settings(config)
  convs = make_conversations(tokenizer, num_conversations=config.num_conversations,
                             num_turns=config.num_turns, prefix_tokens=config.prefix_tokens,
                             tool_tokens=config.tool_tokens, seed=config.seed)
  slack = config.k + 1 if config.k else 1
  longest = (config.prefix_tokens + max(len(r) for c in convs for r in c.tool_results)
             * config.num_turns + config.reply_tokens * (config.num_turns - 1))
  per_request = pages_needed(longest + config.reply_tokens + slack, config.page_size)
  pool_pages = config.pool_pages or per_request * config.num_conversations
  checks = [('pool_pages', pool_pages, per_request, {'off', 'on'}),
            ('small_pool_pages', config.small_pool_pages, per_request, {'on_small', 'on_host'}),
            ('host_pages', config.host_pages, 1, {'on_host'})]
  for name, value, least, users in checks:
    if users & set(settings) and value < least:
      raise ValueError(f'{name}={value} is too small for settings {sorted(users & set(settings))}'
                       f': need >= {least} (one request can take {per_request} pages)')
  return dict(convs=convs, slack=slack, longest=longest, per_request=per_request,
              pool_pages=pool_pages)


def run(config, results) -> None:
  """Replay the conversations under every setting; write per-turn and per-setting records."""
  _check_fields(config)              # and `_plan`, once: `validate` without a second plan
  plan = _plan(config, _tokenizer(config))                    # before any model loads
  settings = _settings(config)
  target, target_params, draft, draft_params, tokenizer = load_pair(config)
  if not config.k:
    draft = draft_params = None
  convs, slack, longest, pool_pages = (plan[k] for k in ('convs', 'slack', 'longest',
                                                         'pool_pages'))
  context = min(m.max_seq_len for m in (target, draft) if m is not None)
  if longest + config.reply_tokens + slack > context:
    raise ValueError(
        f'the last turn can reach {longest} prompt tokens + {config.reply_tokens} reply + {slack} '
        f'slack > the context of {context}: lower num_turns, tool_tokens or prefix_tokens')
  models = (target, target_params, draft, draft_params)
  gens = {s: _generator(s, config, models, pool_pages) for s in settings}
  stop = tokenizer.eos_ids
  for gen in gens.values():
    gen.warm_up(longest, config.reply_tokens, stop_tokens=stop)

  replies = {s: [[] for _ in convs] for s in settings}
  peak_host = dict.fromkeys(settings, 0)
  turns = {s: [] for s in settings}
  for turn in range(config.num_turns):
    for c, conv in enumerate(convs):
      records = []
      for setting in settings:
        gen = gens[setting]
        prompt = turn_prompt(conv, turn, replies[setting][c])
        out = gen.generate(prompt, max_new_tokens=config.reply_tokens, stop_tokens=stop,
                           seed=config.seed + turn).check_draft(draft_label(config))
        replies[setting][c].append(out.tokens[0])
        peak_host[setting] = max(peak_host[setting], gen.host_pages_used)
        record = dict(
            record='turn', setting=setting, conversation=c, turn=turn + 1,
            prompt_tokens=out.prompt_tokens, prefill_tokens=out.prefill_tokens,
            cached_tokens=out.cached_tokens, promoted_tokens=out.promoted_tokens,
            prefix_hit_rate=out.cached_tokens / out.prompt_tokens, ttft_s=out.ttft_s,
            device_pages_used=gen.device_pages_used, host_pages_used=gen.host_pages_used)
        if out.proposed:
          record.update(acceptance_rate=out.acceptance_rate,
                        mean_accepted_length=out.mean_accepted_length)
        records.append(record)
      for setting, record in zip(settings, records):  # compared once every setting has run
        if 'off' in settings and setting != 'off':
          record['matches_off'] = replies[setting][c][-1] == replies['off'][c][-1]
        turns[setting].append(record)
        results.write(record)

  for setting in settings:
    results.write(_summary(setting, turns, gens[setting], peak_host[setting], config))
  for path in report.plot(results.records, results.dir / 'plots', 'prefix_cache'):
    print(f'plot -> {path}', flush=True)


def _summary(setting, turns, gen, peak_host, config) -> dict:
  rows = turns[setting]
  ttft = lambda s, t: float(np.mean([r['ttft_s'] for r in turns[s] if r['turn'] == t]))
  prompt = sum(r['prompt_tokens'] for r in rows)
  prefilled = sum(r['prefill_tokens'] for r in rows)
  record = dict(
      record='summary', setting=setting, turns=config.num_turns,
      conversations=config.num_conversations, prompt_tokens=prompt, prefill_tokens=prefilled,
      prefill_tokens_saved=prompt - prefilled, prefix_hit_rate=ratio(prompt - prefilled, prompt),
      promoted_tokens=sum(r['promoted_tokens'] for r in rows),
      ttft_s_mean=float(np.mean([r['ttft_s'] for r in rows])),
      device_pool_pages=gen.prefix.num_pages - 1, device_pages_peak=gen.peak_device_pages,
      host_pages_peak=peak_host, demoted_pages=gen.prefix.stats['demoted_pages'],
      reclaimed_pages=gen.prefix.stats['reclaimed_pages'])
  for t in REPORT_TURNS:
    if t <= config.num_turns:
      record[f'ttft_s_turn{t}'] = ttft(setting, t)
      if 'off' in turns:
        record[f'ttft_ratio_off_turn{t}'] = ratio(ttft('off', t), ttft(setting, t))
  if 'off' in turns and setting != 'off':
    record['matches_off'] = all(r['matches_off'] for r in rows)
  return record
