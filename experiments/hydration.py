"""Structured context hydration vs prompt stuffing (configs/hydration.py).

For every episode: the pipeline hydrates each turn (small-model extraction under the record
schema, validation, JSON Patch), then the big model prefills each turn's context under every
strategy, interleaved turn by turn so that all strategies see the same machine conditions. Then
α of constrained speculative decoding (draft proposes, target verifies, same mask on both) with
the schema constraint on and off, on the same extraction prompts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.common import check_fields, comma_list, draft_label
from experiments.speculative import load_pair, ratio
from jaxspec.data.tool_calls import tool_episodes
from jaxspec.decoding import SamplingParams
from jaxspec.decoding.constrained import constrained_generate
from jaxspec.decoding.generate import MAX_K, ContextOverflowError
from jaxspec.decoding.constraint import TokenConstraint
from jaxspec.hydration import ContextSession, ModelExtractor, OracleExtractor, hydrate
from jaxspec.hydration.schema import record_schema

STRATEGIES = ('stuffing', 'stuffing_prefix_cache', 'hydration', 'hydration_prefix_cache')
EXTRACTORS = ('draft', 'target', 'oracle')


def validate(config) -> tuple:
  """Check a hydration config before any model loads (`experiments.common.validate`).

  Returns:
    (strategies, α-phase temperatures).
  Raises:
    ValueError: an unknown strategy or extractor, a count out of range, no α temperature
      while the α phase runs, extractor_k without
      extractor=target, constrained=False with the oracle, alpha_k out of [1, MAX_K], a
      temperature SamplingParams refuses.
  """
  strategies = comma_list(config, 'strategies', STRATEGIES, what='strategy')
  if config.extractor not in EXTRACTORS:
    raise ValueError(f'config.extractor={config.extractor!r}; known {EXTRACTORS}')
  check_fields(config, ('num_episodes', 'num_turns', 'ttft_repeats', 'max_extract_tokens',
                        'page_size', 'max_result_tokens'))
  check_fields(config, ('retries', 'alpha_prompts', 'extractor_k', 'shots'), minimum=0)
  if config.extractor_k > MAX_K:
    raise ValueError(f'config.extractor_k must be in [0, {MAX_K}], got {config.extractor_k}')
  if config.extractor_k and config.extractor != 'target':
    raise ValueError(f'config.extractor_k={config.extractor_k} needs config.extractor=target (the '
                     f'target verifies what the draft proposes), got {config.extractor!r}')
  if config.extractor == 'oracle' and not config.constrained:
    raise ValueError('config.constrained=False has no effect with config.extractor=oracle (it '
                     'copies the true record and decodes nothing): use extractor=draft or target')
  if config.alpha_prompts and config.extractor != 'oracle' and not 1 <= config.alpha_k <= MAX_K:
    raise ValueError(f'config.alpha_k (the α phase\'s speculation length K) must be in '
                     f'[1, {MAX_K}], got {config.alpha_k}')
  temps = []
  if str(config.alpha_temperatures).strip(' ,'):
    temps = comma_list(config, 'alpha_temperatures', convert=float, what='temperature')
  if config.alpha_prompts and config.extractor != 'oracle' and not temps:
    raise ValueError(f'config.alpha_temperatures={config.alpha_temperatures!r} names no '
                     f'temperature: the α phase (alpha_prompts={config.alpha_prompts}) would '
                     f'measure nothing; set alpha_prompts=0 to skip it')
  named = [(f'config.alpha_temperatures={config.alpha_temperatures!r}', t) for t in temps]
  if config.extractor != 'oracle':
    named.append(('config.retry_temperature', config.retry_temperature))
  for name, t in named:          # SamplingParams' own range, before any model loads
    try:
      SamplingParams(t)
    except ValueError as err:
      raise ValueError(f'{name}: {err}') from None
  return strategies, temps


def make_extractor(config, target, target_params, draft, draft_params, tokenizer):
  """The extractor named by config.extractor (see configs/hydration.py).

  Raises:
    ValueError: config.shots more than the train split supplies, config.max_extract_tokens not
      below the extracting model's context (max_seq_len).
  """
  if config.extractor == 'oracle':
    return OracleExtractor()
  demos = []
  if config.shots:
    try:
      demos = list(tool_episodes(tokenizer, 1, config.shots, split='train', seed=config.seed,
                                 max_result_tokens=config.max_result_tokens)[0].turns)
    except ValueError as error:      # named the split's services, not the field
      raise ValueError(f'config.shots={config.shots}: {error}') from None
  model, params = (draft, draft_params) if config.extractor == 'draft' else (target,
                                                                             target_params)
  if config.max_extract_tokens >= model.max_seq_len:   # known once the model is loaded
    raise ValueError(f'config.max_extract_tokens={config.max_extract_tokens} leaves no room for '
                     f'a tool result in the {config.extractor} model\'s context of '
                     f'{model.max_seq_len} tokens')
  spec = {}
  if config.extractor_k:                        # extractor 'target' (validate): draft proposes
    spec = dict(draft=draft, draft_params=draft_params, k=config.extractor_k)
  return ModelExtractor(model, params, tokenizer, tokenizer.source,
                        max_new_tokens=config.max_extract_tokens, retries=config.retries,
                        retry_temperature=config.retry_temperature,
                        constrained=config.constrained, demos=demos, seed=config.seed, **spec)


def extract_all(config, extractor, episodes, warm=None) -> list:
  """[`hydrate`(episode, extractor)] for each episode, after one untimed call on the tool call
  `warm` if given (it compiles a `ModelExtractor`'s steps).

  Raises:
    ContextOverflowError (a ValueError): a prompt (demonstrations and a tool result) that
      config.max_extract_tokens leaves no room for in the extracting model's context, named
      with the field (the decoder's, per prompt, renamed).
    ValueError: what `hydrate` raises.
  """
  try:
    if warm is not None:
      extractor(warm)
    return [hydrate(ep, extractor) for ep in episodes]
  except ContextOverflowError as error:     # the decoder's, per prompt: name our field
    raise ContextOverflowError(
        f'config.max_extract_tokens={config.max_extract_tokens} (tool results up to '
        f'config.max_result_tokens={config.max_result_tokens}): {error}') from None


def _measure(session: ContextSession, tokens, repeats: int):
  """Prefill `tokens` `repeats` times from the same cache state (only the last one is committed
  to the prefix cache); the fastest TTFT."""
  costs = [session.prefill(tokens, commit=i == repeats - 1) for i in range(repeats)]
  return min(costs, key=lambda c: c.ttft_s)


def run(config, results) -> None:
  strategies, temps = validate(config)
  target, target_params, draft, draft_params, tokenizer = load_pair(config)
  episodes = tool_episodes(tokenizer, config.num_episodes, config.num_turns,
                           max_result_tokens=config.max_result_tokens, seed=config.seed)
  extractor = make_extractor(config, target, target_params, draft, draft_params, tokenizer)

  warm = None
  if isinstance(extractor, ModelExtractor):   # compile its steps before anything is timed
    warm = tool_episodes(tokenizer, 1, 1, split='val', seed=config.seed,
                         max_result_tokens=config.max_result_tokens)[0].turns[0]
  hydrated = extract_all(config, extractor, episodes, warm)
  # The big model only prefills: positions past its training length (max_seq_len) are allowed
  # here, since only context costs are measured, not its replies.
  # Both kinds of prompt: a hydrated one whose extractions fell back carries every raw tool
  # result and the state's headers, so it can be the longer.
  max_tokens = max(len(tokenizer.encode(prompt)) for turns, _ in hydrated for t in turns
                   for prompt in (t.stuffing_prompt, t.hydrated_prompt))
  big = dataclasses.replace(target, max_seq_len=max(target.max_seq_len, max_tokens))
  sessions = {s: ContextSession(big, target_params, max_tokens=max_tokens,
                                page_size=config.page_size, prefix_cache=s.endswith('cache'))
              for s in strategies}
  for session in sessions.values():
    session.warmup()

  per = {s: [] for s in strategies}
  for episode, (turns, store) in zip(episodes, hydrated):
    for t in turns:
      prompts = {'stuffing': tokenizer.encode(t.stuffing_prompt),
                 'hydration': tokenizer.encode(t.hydrated_prompt)}
      for name, session in sessions.items():
        cost = _measure(session, prompts[name.split('_prefix')[0]], config.ttft_repeats)
        record = dict(kind='turn', episode=episode.name, turn=t.turn, strategy=name,
                      context_tokens=cost.context_tokens, prefill_tokens=cost.prefill_tokens,
                      cached_tokens=cost.cached_tokens, ttft_s=cost.ttft_s,
                      kv_bytes=cost.kv_bytes)
        if name.startswith('hydration'):
          record.update(extraction_s=t.extraction.seconds, attempts=t.extraction.attempts,
                        extraction_tokens=t.extraction.new_tokens, fallback=t.fallback,
                        fidelity=t.fidelity, record_correct=t.record_correct,
                        fields_correct=t.fields_correct, fields_total=t.fields_total)
        per[name].append(record)
        results.write(record)
  for name in strategies:
    results.write(_summary(name, per[name], hydrated, config))
  if config.alpha_prompts and not isinstance(extractor, OracleExtractor):
    calls = [c for ep in episodes for c in ep.turns][:config.alpha_prompts]
    for temperature in temps:
      on, lengths = _alpha(config, target, target_params, draft, draft_params, tokenizer,
                           extractor, calls, temperature, None)
      off, _ = _alpha(config, target, target_params, draft, draft_params, tokenizer, extractor,
                      calls, temperature, lengths)
      results.write(on)
      results.write(off)


def _summary(name, records, hydrated, config) -> dict:
  last = [r for r in records if r['turn'] == config.num_turns]
  out = dict(kind='summary', strategy=name, extractor=config.extractor,
             episodes=len(hydrated), turns=config.num_turns,
             context_tokens_last_turn=float(np.mean([r['context_tokens'] for r in last])),
             ttft_s_last_turn=float(np.mean([r['ttft_s'] for r in last])),
             prefill_tokens_last_turn=float(np.mean([r['prefill_tokens'] for r in last])),
             context_tokens_total=sum(r['context_tokens'] for r in records),
             prefill_tokens_total=sum(r['prefill_tokens'] for r in records),
             ttft_s_total=sum(r['ttft_s'] for r in records),
             kv_bytes_peak=max(r['kv_bytes'] for r in records))
  if name.startswith('hydration'):
    turns = [t for ts, _ in hydrated for t in ts]
    out.update(
        fidelity=float(np.mean([t.fidelity for t in turns])),
        record_accuracy=float(np.mean([t.record_correct for t in turns])),
        field_accuracy=ratio(sum(t.fields_correct for t in turns),
                             sum(t.fields_total for t in turns)),
        fallbacks=sum(t.fallback for t in turns),
        retries_used=sum(t.extraction.attempts - 1 for t in turns),
        extraction_s_total=sum(t.extraction.seconds for t in turns),
        replay_matches=all(store.replay() == ts[-1].state for ts, store in hydrated))
  return out


def _alpha(config, target, target_params, draft, draft_params, tokenizer, extractor, calls,
           temperature, lengths):
  """α and β of speculative decoding (draft proposes K, target verifies) on the extraction
  prompts of `calls`: under each call's record schema when `lengths` is None, else without a
  constraint and without stopping, for exactly lengths[i] tokens (the constrained output's
  length, so both runs cover the same number of tokens after the same prompts). Each prompt is
  also decoded autoregressively by the target alone (same constraint, interleaved), for the
  speedup of the host-stepped speculative loop over the host-stepped autoregressive one.

  Returns (record, the number of tokens generated per prompt)."""
  constrained = lengths is None
  stats = dict(proposed=0, accepted=0, rejected=0, complete=0)
  path = tokenizer.source                 # the file load_pair chose (experiments.common)
  sampling = SamplingParams(temperature)
  spec = dict(draft=draft, draft_params=draft_params, k=config.alpha_k)

  def decode(i, call, **kw):
    constraint = None
    if constrained:
      constraint = TokenConstraint.json_schema(record_schema(call.value), path,
                                               vocab_size=target.vocab_size,
                                               eos_id=tokenizer.eos_id)
    return constrained_generate(
        target, target_params, extractor.prompt(call), constraint,
        max_new_tokens=config.max_extract_tokens if constrained else lengths[i],
        stop_token=tokenizer.eos_id if constrained else None, sampling=sampling,
        seed=config.seed + i, **kw)

  decode(0, calls[0], **spec)                    # compile both loops before timing
  decode(0, calls[0])
  out_lengths, timing = [], dict(spec_s=0.0, spec_tokens=0, ar_s=0.0, ar_tokens=0)
  for i, call in enumerate(calls):
    out = decode(i, call, **spec).check_draft(draft_label(config))
    ar = decode(i, call)
    for key in ('proposed', 'accepted', 'rejected'):
      stats[key] += getattr(out, key)
    stats['complete'] += int(out.finished)
    out_lengths.append(len(out.tokens))
    timing['spec_s'] += out.decode_s
    timing['spec_tokens'] += len(out.tokens) - 1
    timing['ar_s'] += ar.decode_s
    timing['ar_tokens'] += len(ar.tokens) - 1
  spec_tps = ratio(timing['spec_tokens'], timing['spec_s'])
  ar_tps = ratio(timing['ar_tokens'], timing['ar_s'])
  record = dict(kind='alpha', constrained=constrained, temperature=temperature,
                k=config.alpha_k, prompts=len(calls), tokens=sum(out_lengths),
                acceptance_rate=ratio(stats['accepted'], stats['proposed']),
                acceptance_per_position=ratio(stats['accepted'],
                                              stats['accepted'] + stats['rejected']),
                complete_outputs=stats['complete'] if constrained else None,
                tokens_per_s_speculative=spec_tps, tokens_per_s_autoregressive=ar_tps,
                speedup=ratio(spec_tps, ar_tps))
  return record, out_lengths


def plot_hydration(records: list[dict], out_dir) -> list:
  """Context tokens, tokens prefilled and TTFT per turn, a line per strategy (mean over
  episodes). Returns the PNG paths written (none without 'turn' records)."""
  import collections
  import pathlib
  from matplotlib.ticker import MaxNLocator
  from experiments.figures import plt, save_figure
  turns = [r for r in records if r.get('kind') == 'turn']
  if not turns:
    return []
  panels = [('context_tokens', 'tokens in the big model\'s context'),
            ('prefill_tokens', 'tokens prefilled'), ('ttft_s', 'TTFT (s)')]
  fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.8))
  for ax, (metric, label) in zip(axes, panels):
    for strategy in dict.fromkeys(r['strategy'] for r in turns):
      by_turn = collections.defaultdict(list)
      for r in turns:
        if r['strategy'] == strategy:
          by_turn[r['turn']].append(r[metric])
      xs = sorted(by_turn)
      ax.plot(xs, [np.mean(by_turn[x]) for x in xs], marker='o', label=strategy)
    ax.set_xlabel('turn')
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))     # turns are whole numbers
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize='small')
  return [save_figure(fig, pathlib.Path(out_dir) / 'hydration_per_turn.png')]
