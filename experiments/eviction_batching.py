"""Eviction against batching (configs/eviction_batching.py): at the same KV memory, the plain
continuous-batching engine against the evicting engine per policy and budget.

Every setting serves the same requests (held-out prompts, greedy, no stop token, all submitted at
once) from a pool of the same num_pages; settings run interleaved `repeats` times in this one
process, so each throughput ratio compares runs taken side by side. One record per setting:

* tokens_per_s: tokens emitted ÷ wall seconds of serving them (prefill, decode and the host-side
  scheduler; compilation excluded by `warm_up`); throughput_vs_plain: mean over repeats of the
  ratio to the plain engine's run of the same repeat (min / max beside it).
* decode_tokens_per_s: tokens emitted by steps with a decode round and no prefill chunk ÷ those
  steps' wall seconds (the batching effect without prefill); decode_vs_plain: its ratio.
* mean_running / max_running: requests admitted (prefilling or decoding) per step, read right
  after each step is scheduled; mean_decoding: requests in each step's decode round.
* ttft_s_mean / ttft_s_median (arrival to first token: queueing + prefill), tpot_s_mean.
* kv_bytes_peak: most pages held at once × bytes per page (K and V, every layer); kv_bytes_pool:
  the whole pool (the same for every setting).
* quality against the plain engine's outputs on the same requests (its first repeat):
  exact_match (fraction of requests with identical output), prefix_match (mean fraction of each
  reference output matched before the first differing token); with score_reference,
  teacher-forced (prompt + reference fed one token at a time with the cache under the policy,
  `score_tokens`): ref_logprob, the mean log-prob per reference token (nats), and ref_top1, the
  fraction of reference tokens that are the model's top-1 prediction, beside the full cache's
  (ref_logprob_full, ref_top1_full; the reference is the full cache's own greedy output, so
  ref_top1_full is 1 up to floating-point near-ties).
* control: the setting's budget covers a whole request (nothing is ever evicted).
* k: 0, or the prompt-lookup K of a `+ngramK` setting (config.lookup_k), with proposed /
  accepted (proposals and accepted tokens over the first repeat's requests) and
  mean_accepted_length (tokens emitted per decode round of a request, mean over rounds).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from experiments.common import (check_fields, comma_list, empty_cache, load_at_dtype,
                                load_tokenizer, parse_workloads)
from jaxspec.cache import init_eviction, make_policy, pages_needed
from jaxspec.data import make_prompts
from jaxspec.decoding.evicting import score_tokens
from jaxspec.decoding.generate import MAX_K
from jaxspec.engine import Engine, EvictingEngine, check_outputs
from jaxspec.models import shipped


def _ints(config, name: str) -> list[int]:
  values = comma_list(config, name, convert=int, what='int')
  if min(values) < 1:
    raise ValueError(f'config.{name} must list ints >= 1, got {config[name]!r}')
  return values


def memory(config) -> dict:
  """The shared pool and each engine's slot count.

  Returns:
    dict: span (tokens a request spans at K = 0), num_pages, plain_slots, max_seq_len (span +
    lookup_k rounded up to a page: every engine's position bound).
  Raises:
    ValueError: a size < 1, plain_slots < 0.
  """
  check_fields(config, ('num_requests', 'prompt_len', 'max_tokens', 'memory_requests',
                        'page_size', 'chunk_size', 'repeats'))
  if config.plain_slots < 0:
    raise ValueError(f'config.plain_slots must be >= 0 (0: as many as the memory holds), got '
                     f'{config.plain_slots}')
  span = config.prompt_len + config.max_tokens + 1
  # A prompt-lookup twin's requests also need K slots past the span (`Engine.window`): the pool
  # holds memory_requests of those, or with memory_requests = 1 the twin could never admit one.
  lookup = max(0, int(config.lookup_k))
  per_request = pages_needed(span + lookup, config.page_size)
  num_pages = config.memory_requests * per_request + 1
  plain_slots = config.plain_slots or (num_pages - 1) // pages_needed(config.prompt_len + 1,
                                                                      config.page_size)
  return dict(span=span, num_pages=num_pages,
              plain_slots=max(1, min(config.num_requests, plain_slots)),
              max_seq_len=pages_needed(span + lookup, config.page_size) * config.page_size)


def _lookup_k(config) -> int:
  k = int(config.lookup_k)
  if not 0 <= k <= MAX_K:
    raise ValueError(f'config.lookup_k must be in [0, {MAX_K}], got {config.lookup_k}')
  return k


def _cases(config, mem) -> list:
  """[(name, policy, slots, prompt-lookup engine kwargs)] of the evicting settings: each policy x
  budget (+ the control window), each followed by its `+ngramK` twin when lookup_k = K > 0. Needs
  no model, so `validate` runs it before one loads.

  Raises:
    ValueError: lookup_k outside [0, MAX_K], 'full' among the policies, a bad policy or budget, a
      budget needing more pages than the pool.
  """
  k = _lookup_k(config)
  lookup = dict(k=k, drafter='ngram')
  kinds = comma_list(config, 'policies', what='policy')
  if 'full' in kinds:
    raise ValueError("config.policies names 'full': the full cache is the 'plain' setting (the "
                     'plain Engine), which every run measures as the baseline')
  pairs = [(kind, b) for kind in kinds for b in _ints(config, 'budgets')]
  if config.control and ('window', mem['span']) not in pairs:   # given already: measured once
    pairs.append(('window', mem['span']))
  cases = []
  for kind, budget in pairs:
    for delay, extra, suffix in [(0, {}, '')] + ([(k + 1, lookup, f'+ngram{k}')] if k else []):
      policy = make_policy(kind, budget, reuse_delay=delay)
      slots = (mem['num_pages'] - 1) // pages_needed(policy.slots, config.page_size)
      if slots < 1:
        raise ValueError(f'budget {budget} (+ reuse_delay {delay}) needs '
                         f'{pages_needed(policy.slots, config.page_size)} pages a request, more '
                         f'than the pool has ({mem["num_pages"] - 1} usable of num_pages='
                         f'{mem["num_pages"]}: page 0 is the null page)')
      cases.append((f'{kind}@{budget}{suffix}', policy, min(config.num_requests, slots), extra))
  return cases


def _settings(config, mem, model, params):
  """[(name, policy or None, engine)] with every engine compiled (`warm_up`); with lookup_k =
  K > 0 each is followed by its prompt-lookup twin `NAME+ngramK`.

  Raises:
    ValueError: as `_cases`; a request span beyond the model's context.
  """
  k = _lookup_k(config)
  cases = _cases(config, mem)
  need = mem['span'] + k
  if need > model.max_seq_len:                    # named here, not as the engine's max_seq_len
    raise ValueError(f'config.prompt_len={config.prompt_len} + config.max_tokens='
                     f'{config.max_tokens} + 1{f" + lookup_k={k}" if k else ""} = {need} tokens '
                     f'exceeds the model\'s context of {model.max_seq_len}: lower prompt_len or '
                     f'max_tokens')
  mem = dict(mem, max_seq_len=min(mem['max_seq_len'], model.max_seq_len))
  shared = dict(num_pages=mem['num_pages'], page_size=config.page_size,
                chunk_size=config.chunk_size, max_seq_len=mem['max_seq_len'], seed=config.seed)
  settings = [('plain', None, Engine(model, params, num_slots=mem['plain_slots'],
                                     prefix_caching=False, **shared))]
  if k:
    settings.append((f'plain+ngram{k}', None, Engine(
        model, params, num_slots=mem['plain_slots'], prefix_caching=False, **shared, k=k,
        drafter='ngram')))
  for name, policy, slots, extra in cases:
    settings.append((name, policy, EvictingEngine(
        model, params, policy=policy, num_slots=slots, prefill_group=config.prefill_group,
        **shared, **extra)))
  for _, _, engine in settings:
    engine.warm_up()
  return settings


def serve(engine, prompts, max_tokens: int) -> dict:
  """Submit every prompt at once, step until idle; outputs and measurements of this run."""
  trace = []
  schedule = engine.scheduler.schedule

  def traced(window):
    prefills, decodes = schedule(window)
    trace.append((len(engine.scheduler.running), len(decodes), engine.prefix.num_held,
                  len(prefills)))
    return prefills, decodes

  engine.scheduler.schedule = traced
  step_seconds = []
  try:
    start = time.perf_counter()
    ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
    while engine.has_unfinished():
      t0 = time.perf_counter()
      engine.step()
      step_seconds.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - start
  finally:
    del engine.scheduler.schedule          # back to the class's method
  outs = check_outputs(engine.outputs.pop(i) for i in ids)
  running, decoding, held, prefilling = (np.array(x, float) for x in zip(*trace))
  decode_only = prefilling == 0                  # steps with a decode round and no prefill
  decode_seconds = float(np.sum(np.array(step_seconds)[decode_only]))
  return dict(
      tokens=[o.tokens for o in outs], seconds=seconds,
      tokens_per_s=sum(len(o.tokens) for o in outs) / seconds,
      mean_running=float(running.mean()), max_running=int(running.max()),
      mean_decoding=float(decoding.mean()), peak_pages=int(held.max()), steps=len(trace),
      decode_tokens_per_s=(float(decoding[decode_only].sum()) / decode_seconds
                           if decode_seconds else float('nan')),
      ttft=[o.metrics.ttft_s for o in outs], tpot=[o.metrics.tpot_s for o in outs],
      preemptions=sum(o.metrics.preemptions for o in outs),
      proposed=sum(o.metrics.proposed for o in outs),
      accepted=sum(o.metrics.accepted for o in outs),
      accepted_lengths=[e for o in outs for e in o.metrics.accepted_lengths])


def match(tokens: list, reference: list) -> tuple[float, float]:
  """(exact-match rate, mean fraction of each reference matched up to the first difference)."""
  exact, prefix = [], []
  for got, ref in zip(tokens, reference):
    n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    exact.append(got == ref)
    prefix.append(n / len(ref))
  return float(np.mean(exact)), float(np.mean(prefix))


def score_reference(model, params, policy, prompts, reference, page_size) -> tuple[float, float]:
  """Teacher-forced quality of the reference outputs with the cache under `policy` (None: the
  full cache), all requests in one batch, one token at a time (`score_tokens`).

  Returns:
    (mean log p(reference token | prompt + earlier reference tokens) in nats, fraction of
    reference tokens that are the model's top-1 prediction there).
  """
  seqs = [list(p) + list(r) for p, r in zip(prompts, reference)]
  width = max(map(len, seqs))
  tokens = np.zeros((len(seqs), width), np.int32)
  scored = np.zeros((len(seqs), width), bool)
  for i, (p, seq) in enumerate(zip(prompts, seqs)):
    tokens[i, :len(seq)] = seq
    scored[i, len(p) - 1:len(seq) - 1] = True        # position t predicts token t + 1
  lengths = np.array([len(s) for s in seqs], np.int32)
  slots = width if policy is None else policy.slots
  cache, _ = empty_cache(model, len(seqs), slots, page_size)
  eviction = None if policy is None else init_eviction(policy, cache)
  out = score_tokens(model, params, cache, eviction, tokens, lengths)
  nxt = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
  return (float(np.asarray(out['logprob'])[scored].mean()),
          float((np.asarray(out['argmax']) == nxt)[scored].mean()))


def validate(config) -> None:
  """Check an eviction_batching config before any model loads (`experiments.common.validate`).

  Raises:
    ValueError: a size < 1, plain_slots < 0, an unknown workload, a prefill_group that does
      not divide chunk_size; as `_cases` (lookup_k, policies, budgets).
  """
  mem = memory(config)
  parse_workloads(config)
  check_fields(config, ('prefill_group',))
  if config.chunk_size % config.prefill_group:    # the evicting engines refused it after loading
    raise ValueError(f'config.prefill_group={config.prefill_group} must divide '
                     f'config.chunk_size={config.chunk_size} (tokens per model call inside a '
                     f'prefill chunk)')
  _cases(config, mem)


def run(config, results) -> None:
  """Serve the requests with every setting, interleaved `repeats` times; one record each."""
  validate(config)
  mem = memory(config)
  workloads = parse_workloads(config)
  tokenizer = load_tokenizer(config.tokenizer, config.target or shipped('target'))
  model, params = load_at_dtype(config.target or shipped('target'), config)
  prompts = []
  for i, workload in enumerate(workloads):
    n = config.num_requests // len(workloads) + (i < config.num_requests % len(workloads))
    if n:
      prompts += [p.tokens for p in make_prompts(workload, tokenizer, n, config.prompt_len,
                                                 split='test', seed=config.seed)]
  settings = _settings(config, mem, model, params)
  runs = {name: [] for name, _, _ in settings}
  for _ in range(config.repeats):
    for name, _, engine in settings:
      runs[name].append(serve(engine, prompts, config.max_tokens))
  reference = runs['plain'][0]['tokens']
  page_bytes = config.page_size * model.kv_bytes_per_token(
      settings[0][2].caches[0].k_pages.dtype.itemsize)
  full = (score_reference(model, params, None, prompts, reference, config.page_size)
          if config.score_reference else None)
  for name, policy, engine in settings:
    rs = runs[name]
    ratios = [r['tokens_per_s'] / p['tokens_per_s'] for r, p in zip(rs, runs['plain'])]
    exact, prefix = match(rs[0]['tokens'], reference)
    record = dict(
        setting=name, policy=policy.kind if policy else 'plain',
        control=bool(policy and policy.budget >= mem['span']),
        budget=policy.budget if policy else None, num_slots=engine.num_slots,
        num_pages=mem['num_pages'], pages_per_request=(
            engine.request_pages if policy else
            pages_needed(mem['span'] + engine.window - 1, config.page_size)),
        num_requests=len(prompts), prompt_len=config.prompt_len, max_tokens=config.max_tokens,
        tokens_per_s=statistics.mean(r['tokens_per_s'] for r in rs),
        throughput_vs_plain=statistics.mean(ratios), throughput_vs_plain_min=min(ratios),
        throughput_vs_plain_max=max(ratios),
        decode_tokens_per_s=statistics.mean(r['decode_tokens_per_s'] for r in rs),
        decode_vs_plain=statistics.mean(r['decode_tokens_per_s'] / p['decode_tokens_per_s']
                                        for r, p in zip(rs, runs['plain'])),
        mean_running=statistics.mean(r['mean_running'] for r in rs),
        max_running=max(r['max_running'] for r in rs),
        mean_decoding=statistics.mean(r['mean_decoding'] for r in rs),
        ttft_s_mean=statistics.mean(float(np.mean(r['ttft'])) for r in rs),
        ttft_s_median=statistics.mean(float(np.median(r['ttft'])) for r in rs),
        tpot_s_mean=statistics.mean(float(np.nanmean(r['tpot'])) for r in rs),
        kv_bytes_peak=max(r['peak_pages'] for r in rs) * page_bytes,
        kv_bytes_pool=(mem['num_pages'] - 1) * page_bytes,
        preemptions=rs[0]['preemptions'], steps=rs[0]['steps'],
        seconds=statistics.mean(r['seconds'] for r in rs),
        repeats_identical=all(r['tokens'] == rs[0]['tokens'] for r in rs),
        exact_match=exact, prefix_match=prefix, k=engine.k, proposed=rs[0]['proposed'],
        accepted=rs[0]['accepted'],
        mean_accepted_length=(float(np.mean(rs[0]['accepted_lengths']))
                              if rs[0]['accepted_lengths'] else float('nan')))
    if config.score_reference:
      got = full if policy is None else score_reference(model, params, policy, prompts,
                                                        reference, config.page_size)
      record.update(ref_logprob=got[0], ref_logprob_full=full[0], ref_top1=got[1],
                    ref_top1_full=full[1])
    results.write(record)


def _line(record: dict) -> str:
  """A plot line's label: the policy, with `+ngramK` for a prompt-lookup setting."""
  return record['policy'] + (f"+ngram{record['k']}" if record.get('k') else '')


_PANELS = [('throughput_vs_plain', 'throughput ÷ plain engine (×)'),
           ('mean_running', 'mean requests running'),
           ('prefix_match', 'fraction of plain output matched\nbefore the first difference')]


def plot_eviction_batching(records: list[dict], out_dir) -> list:
  """eviction_vs_batching.png: throughput ratio, concurrency and quality vs budget, a line per
  policy, the plain engine as a dashed line (registered in experiments.report.PLOTS).
  Returns the PNG paths written (none without evicting records)."""
  import pathlib   # pylint: disable=g-import-not-at-top
  from experiments.figures import plt, save_figure  # pylint: disable=g-import-not-at-top
  evicting = [r for r in records if r.get('budget') is not None and r.get('policy')]
  plain = {}                             # the first record of each plain setting, K = 0 first
  for r in sorted(records, key=lambda r: r.get('k') or 0):
    if r.get('policy') == 'plain':
      plain.setdefault(r['setting'], r)
  if not evicting:
    return []
  fig, axes = plt.subplots(1, len(_PANELS), figsize=(4.6 * len(_PANELS), 3.6))
  for ax, (metric, label) in zip(axes, _PANELS):
    for line in dict.fromkeys(_line(r) for r in evicting):
      pts = sorted((r['budget'], r[metric]) for r in evicting if _line(r) == line)
      ax.plot([b for b, _ in pts], [v for _, v in pts], marker='o', label=line)
    for style, record in zip(('--', ':'), plain.values()):
      ax.axhline(record[metric], color='gray', linestyle=style, linewidth=0.8,
                 label=record['setting'])
    ax.set_xscale('log', base=2)
    budgets = sorted({r['budget'] for r in evicting})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel('budget (tokens per request and layer)')
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[-1].legend(fontsize='small')
  fig.suptitle(f"same KV memory ({evicting[0]['num_pages'] - 1} pages): "
               f"{evicting[0]['num_requests']} requests of {evicting[0]['prompt_len']} + "
               f"{evicting[0]['max_tokens']} tokens", fontsize='medium')
  return [save_figure(fig, pathlib.Path(out_dir) / 'eviction_vs_batching.png')]
