"""KV eviction under a budget (configs/eviction.py): quality against the full cache, KV bytes and
decode speed per policy and budget; and a long worker loop whose KV memory stays at the budget.

Quality: every held-out sequence (seq_len tokens) goes through the target one token at a time
(`jaxspec.decoding.evicting.score_tokens`), once with the full cache and once under the policy,
in the same process. perplexity = exp(mean negative log-likelihood of each next token);
agreement = fraction of positions where the top-1 prediction equals the full cache's.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import (check_fields, empty_cache, load_at_dtype, load_tokenizer,
                                parse_workloads)
from jaxspec.cache import init_eviction, make_policy
from jaxspec.checks import seed_key
from jaxspec.data import make_prompts
from jaxspec.data.workloads import MIN_RETRIEVAL_PROMPT
from jaxspec.decoding import SamplingParams, check_valid
from jaxspec.decoding.evicting import (decode_autoregressive_evicting, prefill_evicting,
                                       score_tokens)
from jaxspec.models import shipped

WORKER_PROMPT = 256          # tokens of worker mode's prompt
_FULL_REFERENCE: dict = {}   # full-cache scores per (model, workload, shapes): one per process


def budget_tokens(config) -> int:
  """The budget in tokens: round(budget_frac * seq_len), at least 1."""
  if not 0 < config.budget_frac <= 1:
    raise ValueError(f'budget_frac must be in (0, 1], got {config.budget_frac}')
  return max(1, round(config.budget_frac * config.seq_len))


def _score(model, params, policy, tokens, lengths, config):
  """Scores of every batch under `policy` (compiled once, then timed): dict of [N, T] arrays,
  decode tokens/s, peak live tokens and KV bytes per sequence. policy None = the model's default
  full-cache path (what eviction is compared against, for quality and speed)."""
  slots = config.seq_len if policy is None or policy.slots is None else policy.slots
  out = {'logprob': [], 'argmax': []}
  seconds, live_peak, compiled, kv_bytes = 0.0, 0, None, 0
  for start in range(0, len(tokens), config.batch_size):
    batch = jnp.asarray(tokens[start:start + config.batch_size], jnp.int32)
    batch_lengths = jnp.asarray(lengths[start:start + config.batch_size], jnp.int32)
    cache, kv_bytes = empty_cache(model, config.batch_size, slots, config.page_size)
    eviction = None if policy is None else init_eviction(policy, cache,
                                                         use_kernel=config.use_kernel)
    if compiled is None:
      compiled = score_tokens.lower(model, params, cache, eviction, batch,
                                    batch_lengths).compile()
    t0 = time.perf_counter()
    res = jax.block_until_ready(compiled(params, cache, eviction, batch, batch_lengths))
    seconds += time.perf_counter() - t0
    out['logprob'].append(np.asarray(res['logprob']))
    out['argmax'].append(np.asarray(res['argmax']))
    live_peak = max(live_peak, int(res['live'].max()))
  scores = {k: np.concatenate(v) for k, v in out.items()}
  return scores, int(np.sum(lengths)) / seconds, live_peak, kv_bytes


PASSAGE_TOKENS = 128        # retrieval: the scored passage


def _prompts(workload, tokenizer, config, prompt_len):
  """make_prompts for this run, its errors in the config's terms (num_sequences, seq_len)."""
  try:
    return make_prompts(workload, tokenizer, config.num_sequences, prompt_len, split='test',
                        seed=config.seed)
  except ValueError as e:
    raise ValueError(f'cannot draw config.num_sequences={config.num_sequences} {workload!r} '
                     f'sequences with config.seq_len={config.seq_len}: {e}') from None


def _sequences(workload, tokenizer, config):
  """tokens [N, seq_len] (right-padded), lengths [N] and the scored positions [N, seq_len] bool
  (position t scores the prediction of token t+1). code / json: windows of seq_len tokens, every
  prediction scored. retrieval: a document, an instruction to quote a passage of it and the
  passage's first tokens (<= seq_len - 128 tokens), then the real passage (<= 128 tokens); only
  the passage's tokens are scored, so the score measures copying from far back in the context."""
  if workload != 'retrieval':
    prompts = _prompts(workload, tokenizer, config, config.seq_len)
    tokens = np.array([p.tokens for p in prompts], np.int32)
    lengths = np.full((len(tokens),), config.seq_len, np.int32)
    scored = np.ones(tokens.shape, bool)
    scored[:, -1] = False
    return tokens, lengths, scored
  prompts = _prompts('retrieval', tokenizer, config, config.seq_len - PASSAGE_TOKENS)
  tokens = np.zeros((len(prompts), config.seq_len), np.int32)
  lengths = np.zeros((len(prompts),), np.int32)
  scored = np.zeros(tokens.shape, bool)
  for i, p in enumerate(prompts):
    seq = list(p.tokens) + list(p.reference[:PASSAGE_TOKENS])
    tokens[i, :len(seq)], lengths[i] = seq, len(seq)
    scored[i, len(p.tokens) - 1:len(seq) - 1] = True
  return tokens, lengths, scored


def _perplexity(logprob, scored) -> float:
  return math.exp(-float(logprob[scored].mean()))


def run_quality(config, results, model, params, tokenizer) -> None:
  budget = budget_tokens(config)
  policy = make_policy(config.policy, None if config.policy == 'full' else budget)
  for workload in parse_workloads(config):
    tokens, lengths, scored = _sequences(workload, tokenizer, config)
    key = (config.target, workload, config.seq_len, config.num_sequences, config.batch_size,
           config.page_size, config.seed, config.use_kernel)
    if key not in _FULL_REFERENCE:
      _FULL_REFERENCE[key] = _score(model, params, None, tokens, lengths, config)
    full, full_tps, _, full_bytes = _FULL_REFERENCE[key]
    got, tps, live_peak, kv_bytes = _score(model, params, policy, tokens, lengths, config)
    ppl, ppl_full = _perplexity(got['logprob'], scored), _perplexity(full['logprob'], scored)
    truth = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    full_cache = config.policy == 'full'      # keeps every token: the budget is the sequence
    results.write(dict(
        workload=workload, policy=config.policy,
        budget_frac=1.0 if full_cache else float(config.budget_frac),
        budget_tokens=int(config.seq_len) if full_cache else budget, seq_len=int(config.seq_len),
        tokens_scored=int(scored.sum()),
        perplexity=ppl, perplexity_full=ppl_full,
        perplexity_increase_pct=100.0 * (ppl / ppl_full - 1.0),
        agreement=float((got['argmax'] == full['argmax'])[scored].mean()),
        top1_accuracy=float((got['argmax'] == truth)[scored].mean()),
        top1_accuracy_full=float((full['argmax'] == truth)[scored].mean()),
        live_tokens_peak=live_peak, kv_bytes_peak=int(kv_bytes) * config.batch_size,
        kv_bytes_full=int(full_bytes) * config.batch_size,
        tokens_per_s=tps, tokens_per_s_full=full_tps, speed_vs_full=tps / full_tps))


def run_worker(config, results, model, params, tokenizer) -> None:
  """Generate worker_tokens tokens greedily in chunks under H2O (or config.policy) at
  worker_budget tokens; one record per chunk (cached tokens, KV bytes, tokens/s)."""
  policy = make_policy(config.policy, None if config.policy == 'full' else
                       int(config.worker_budget))
  prompt = make_prompts('code', tokenizer, 1, WORKER_PROMPT, split='test',
                        seed=config.seed)[0].tokens
  chunks = -(-config.worker_tokens // config.worker_chunk)
  # 'full' keeps every token: the prompt and every chunk's (each call caches worker_chunk).
  slots = (len(prompt) + chunks * config.worker_chunk if policy.slots is None
           else policy.slots)
  cache, kv_bytes = empty_cache(model, 1, slots, config.page_size)
  eviction = init_eviction(policy, cache, use_kernel=config.use_kernel)
  greedy = SamplingParams(temperature=0.0)
  token, cache, eviction = prefill_evicting(model, params, cache, eviction,
                                            jnp.asarray([prompt], jnp.int32),
                                            jnp.asarray([len(prompt)], jnp.int32),
                                            seed_key(config.seed), sampling=greedy)
  no_stop = jnp.zeros((0,), jnp.int32)        # a worker loop does not stop
  generated = 0
  run = lambda cache, eviction, token: decode_autoregressive_evicting(
      model, params, cache, eviction, token, jax.random.PRNGKey(0), no_stop, sampling=greedy,
      max_new_tokens=config.worker_chunk + 1)
  compiled = jax.jit(run, donate_argnums=(0, 1)).lower(cache, eviction, token).compile()
  while generated < config.worker_tokens:
    t0 = time.perf_counter()
    out, cache, eviction = jax.block_until_ready(compiled(cache, eviction, token))
    seconds = time.perf_counter() - t0
    n = int(out.num_tokens[0]) - 1                           # the first is the pending token
    check_valid([np.asarray(out.tokens[0, :n + 1]).tolist()])
    token = out.tokens[:, n]
    generated += n
    results.write(dict(
        mode='worker', policy=config.policy,   # 'full' keeps every token: its budget is all
        budget_tokens=slots if policy.budget is None else policy.budget,
        tokens_generated=generated, context_tokens=len(prompt) + generated,
        live_tokens=int(eviction.num_live.max()), kv_bytes=int(kv_bytes),
        kv_bytes_full_cache=int(model.kv_bytes_per_token(cache.k_pages.dtype.itemsize)
                                * (len(prompt) + generated)),
        tokens_per_s=n / seconds))


def validate(config) -> None:
  """Check an eviction config before any model loads (`experiments.common.validate`).

  Raises:
    ValueError: an unknown mode or policy, a budget the policy refuses, page_size < 1, bad
      sizes for the mode
      (quality: batch_size, num_sequences a multiple of it, seq_len >= 2; worker: worker_tokens a
      multiple of worker_chunk, a worker_budget that evicts nothing).
  """
  if config.mode not in ('quality', 'worker'):
    raise ValueError(f"config.mode must be 'quality' or 'worker', got {config.mode!r}")
  check_fields(config, ('page_size',))
  if config.mode == 'quality':     # the worker mode's budget is worker_budget, not budget_frac
    make_policy(config.policy, None if config.policy == 'full' else budget_tokens(config))
    workloads = parse_workloads(config)
    check_fields(config, ('batch_size', 'num_sequences'))
    check_fields(config, ('seq_len',), minimum=2)     # 1 token has no next token to score
    if config.num_sequences % config.batch_size:
      raise ValueError(f'config.num_sequences ({config.num_sequences}) must be a multiple of '
                       f'config.batch_size ({config.batch_size})')
    least = PASSAGE_TOKENS + MIN_RETRIEVAL_PROMPT
    if 'retrieval' in workloads and config.seq_len < least:
      raise ValueError(f'config.seq_len must be >= {least} with the retrieval workload (a '
                       f'prompt of >= {MIN_RETRIEVAL_PROMPT} tokens, then the {PASSAGE_TOKENS}-'
                       f'token passage scored), got {config.seq_len}')
  else:   # a chunk of 0 tokens never ends the run
    check_fields(config, ('worker_tokens', 'worker_chunk'))
    if config.worker_tokens % config.worker_chunk:    # the last chunk ran past the end
      raise ValueError(f'config.worker_tokens={config.worker_tokens} must be a multiple of '
                       f'config.worker_chunk={config.worker_chunk} (each chunk is one compiled '
                       f'call of that many tokens)')
    if config.policy != 'full':
      try:
        make_policy(config.policy, config.worker_budget)
      except ValueError as error:
        raise ValueError(f'config.worker_budget={config.worker_budget}: {error}') from None
    context = WORKER_PROMPT + config.worker_tokens
    if config.policy != 'full' and config.worker_budget >= context:  # its pool outgrew the full
      raise ValueError(f'config.worker_budget={config.worker_budget} keeps every token of the '
                       f'run ({WORKER_PROMPT} prompt + worker_tokens={config.worker_tokens}): '
                       f'below {context} it evicts (policy=full measures the full cache)')


def run(config, results) -> None:
  """Quality (one record per workload) or worker mode (one record per chunk)."""
  validate(config)
  tokenizer = load_tokenizer(config.tokenizer, config.target or shipped('target'))
  model, params = load_at_dtype(config.target or shipped('target'), config)
  if config.mode == 'quality' and config.seq_len > model.max_seq_len:   # worker: past it by design
    raise ValueError(f'config.seq_len={config.seq_len} exceeds the context of the target '
                     f'({model.max_seq_len} tokens): the full-cache baseline would run past it')
  (run_quality if config.mode == 'quality' else run_worker)(config, results, model, params,
                                                            tokenizer)
