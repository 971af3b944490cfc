"""Host-side entry point: validate a batch of prompts, allocate pages, run prefill and a compiled
decode loop (autoregressive, or speculative when a draft is given), and time both phases."""

from __future__ import annotations

import dataclasses
import operator
import time
import warnings
from typing import Optional, Sequence

import jax
import numpy as np

from jaxspec.cache import PageAllocator, pages_needed
from jaxspec.checks import check_int, check_seed, counted, seed_key, token_ids
from jaxspec.decoding.output import NonFiniteLogitsError, check_valid, draft_failed_message
from jaxspec.decoding.sampling import SamplingParams, check_sampling
from jaxspec.decoding.speculative import check_pair
from jaxspec.decoding.steps import LOCAL_STEPS
from jaxspec.models import ModelConfig, check_params
from jaxspec.models.config import check_model_config

MAX_K = 16  # largest speculation length accepted by default


@dataclasses.dataclass
class GenerationResult:
  """Tokens and measurements of one `generate` call (sums over the batch).

  Attributes:
    tokens: per prompt, the emitted token ids (stop token included when hit).
    ttft_s: seconds from the start of prefill to the first token of every row: allocating and
      zeroing the KV pools, prefill (target, and the draft's) and the first sample (argument
      checks, page allocation and the host-to-device copy of the prompts come before it).
    decode_s: seconds of the compiled decode loop after the first token.
    prompt_tokens: prompt tokens of the batch; prefill_tokens: of those, the ones prefill
      computed (the rest came from the prefix cache: cached_tokens, promoted_tokens of them from
      its host tier).
    proposed, accepted, emitted, target_calls, rejected, draft_failed: speculative counters of
      the decode loop (zero for autoregressive decoding); see `SpecStats`. draft_failed > 0: the
      draft's logits were NaN or +inf in that many rounds (a warning says so; the tokens are
      still the target's, but α then measures a broken draft: `check_draft` refuses it).
  """

  tokens: list
  ttft_s: float
  decode_s: float
  prompt_tokens: int = 0
  prefill_tokens: int = 0
  cached_tokens: int = 0
  promoted_tokens: int = 0
  proposed: int = 0
  accepted: int = 0
  emitted: int = 0
  target_calls: int = 0
  rejected: int = 0
  draft_failed: int = 0

  def check_draft(self, what: str = 'the draft') -> 'GenerationResult':
    """This result, unless the draft's logits were NaN or +inf in some round (`draft_failed`):
    a measurement of α or speedup over it would measure a broken draft as a poor one.

    Raises:
      NonFiniteLogitsError: naming `what` and the rounds.
    """
    if self.draft_failed:
      raise NonFiniteLogitsError(draft_failed_message(self.draft_failed, self.target_calls, what))
    return self

  @property
  def num_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def decode_tokens_per_s(self) -> float:
    """Tokens emitted after the first ÷ decode seconds (batch total)."""
    return (self.num_tokens - len(self.tokens)) / max(self.decode_s, 1e-9)

  @property
  def acceptance_rate(self) -> float:
    """α = accepted draft tokens ÷ proposed draft tokens."""
    return self.accepted / self.proposed if self.proposed else float('nan')

  @property
  def mean_accepted_length(self) -> float:
    """τ = tokens emitted per target forward pass in the decode loop."""
    return self.emitted / self.target_calls if self.target_calls else float('nan')

  @property
  def acceptance_per_position(self) -> float:
    """β = accepted ÷ (accepted + rejections): the probability that a draft token that is
    reached gets accepted (the α of Leviathan et al.'s i.i.d. analysis; α above depends on K)."""
    seen = self.accepted + self.rejected
    return self.accepted / seen if seen else float('nan')


class ContextOverflowError(ValueError):
  """A prompt plus the tokens a request may decode (max_new_tokens and the decoding slack: 1, or
  K + 1 when speculating) exceeds a model's context (`ModelConfig.max_seq_len`, tokens); the
  message names the sizes and whose context. A `ValueError`, so callers that catch those keep
  working; a caller that sets max_new_tokens from its own field catches this one to name the
  field (e.g. `experiments.hydration.extract_all`)."""


def _check_prompts(prompts, configs, max_new_tokens, slack, max_tokens_name='max_new_tokens',
                   one_request=False):
  if not isinstance(prompts, (list, tuple, np.ndarray, jax.Array)):
    raise ValueError(f'prompts must be a list of token-id sequences (or a [B, T] int array), '
                     f'got {type(prompts).__name__}')
  if len(prompts) == 0:
    raise ValueError('no prompts given')
  for i, prompt in enumerate(prompts):
    label = 'prompt' if one_request else f'prompt {i}'
    ids = token_ids(prompt, label, min(c.vocab_size for c in configs))
    if not ids:
      raise ValueError(f'{label} is empty')
    check_context(label, len(prompt), configs, max_new_tokens, slack, max_tokens_name)


def check_context(label: str, prompt_len: int, configs, max_new_tokens: int, slack: int,
                  max_tokens_name: str = 'max_new_tokens') -> None:
  """Raise unless a prompt of `prompt_len` tokens, `max_new_tokens` and `slack` decoding slack
  (1, or K + 1 when speculating) fit every model's context (configs: the target, then the
  draft; `ModelConfig.max_seq_len`, tokens).

  Raises:
    ContextOverflowError: naming `label`, the sizes and whose context.
  """
  need = prompt_len + max_new_tokens + slack
  for c, config in enumerate(configs):
    if need > config.max_seq_len:
      whose = 'the' if c == 0 else "the draft's"
      raise ContextOverflowError(
          f'{label} of {counted(prompt_len, "token")} + {max_tokens_name}={max_new_tokens} + '
          f'{counted(slack, "token")} of decoding slack = {need} exceeds {whose} '
          f'context of {config.max_seq_len}')


def check_request(target: ModelConfig, prompts, *, max_new_tokens, stop_tokens=(), draft=None,
                  draft_params=None, k=None, max_k: int = MAX_K,
                  max_tokens_name: str = 'max_new_tokens', one_request: bool = False,
                  min_slack: int = 1):
  """Validate a generation request (shared by `generate`, `PrefixCachedGenerator` and the
  engine; `max_tokens_name` and `one_request` only word the errors for the caller's API;
  `min_slack`: the caller's own decoding slack, e.g. K + 1 of prompt lookup, which has no draft
  model).

  Returns:
    (configs: the models involved, slack: tokens of decoding slack past max_new_tokens (1, or
    K + 1 when speculating; at least min_slack), stop: [S] int32 sorted stop ids).
  Raises:
    TypeError: target or draft not a `ModelConfig` (e.g. a `Transformer` module).
    ValueError: naming the bad value (see `generate`); `ContextOverflowError` for a prompt that
      does not fit.
  """
  check_model_config(target, 'target')
  if draft is not None:
    check_model_config(draft, 'draft')
  max_new_tokens = check_int(max_tokens_name, max_new_tokens, 1)
  max_k = check_int('max_k', max_k, 1)
  if draft is None and (k is not None or draft_params is not None):
    raise ValueError(f'k={k} / draft_params given without a draft model')
  if draft is not None and draft_params is None:
    raise ValueError('a draft model needs draft_params, got None')
  configs = [target]
  slack = max(1, min_slack)
  if draft is not None:
    if draft.vocab_size != target.vocab_size:
      raise ValueError(f'draft vocabulary ({draft.vocab_size}) differs from the target '
                       f'vocabulary ({target.vocab_size})')
    try:
      valid = 1 <= check_int('k', k) <= max_k
    except ValueError:
      valid = False
    if not valid:
      raise ValueError(f'speculation length K must be an int in [1, {max_k}], got {k!r}')
    check_pair(target, draft, k)         # the jitted loop's own checks, before any work
    configs.append(draft)
    slack = max(slack, k + 1)
  _check_prompts(prompts, configs, max_new_tokens, slack, max_tokens_name, one_request)
  stop = np.asarray(sorted(set(stop_ids(stop_tokens, target.vocab_size))), np.int32)
  return configs, slack, stop


def stop_ids(stop_tokens, vocab_size: int) -> list:
  """The stop ids as Python ints, checked: a sequence of integer ids in [0, vocab_size).

  Raises:
    ValueError: a string, a non-sequence, an id that is not an integer (bool and 2.0 included)
      or outside the vocabulary, named.
  """
  if isinstance(stop_tokens, (str, bytes)):
    raise ValueError(f'stop_tokens must be token ids, got the string {stop_tokens!r}')
  try:
    listed = tuple(stop_tokens)   # read once: a generator would be empty the second time
  except TypeError:
    raise ValueError(f'stop_tokens must be a sequence of token ids, got {stop_tokens!r}') from None
  ids = []
  for t in listed:
    try:           # int() would turn 2.7 into 2, '5' into 5; index() takes only integers
      if isinstance(t, (bool, np.bool_)):
        raise TypeError
      ids.append(operator.index(t))
    except TypeError:
      raise ValueError(f'stop token ids must be ints, got {t!r}') from None
    if not 0 <= ids[-1] < vocab_size:
      raise ValueError(f'stop token id {ids[-1]} outside the vocabulary [0, {vocab_size})')
  return ids


def decode(target, target_params, cache, first, rng, stop, *, sampling, max_new_tokens,
           draft=None, draft_params=None, draft_cache=None, k=None, steps=LOCAL_STEPS):
  """The compiled decode loop after prefill: autoregressive, or speculative with a draft, run
  through `steps` (the default device, or a `jaxspec.parallel.ShardedSteps` mesh placement).

  Args:
    cache, draft_cache: prefilled PagedKVCaches (donated); first: [B] int32 first tokens from
      prefill; rng: PRNG key; stop: [S] int32 stop ids; max_new_tokens: static, counts `first`;
      k: speculation length K (with a draft).

  Returns:
    (Output, counters: dict of the SpecStats sums (empty for autoregressive), cache, draft_cache).
  """
  if draft is None:
    out, cache = steps.decode_autoregressive(target, target_params, cache, first, rng, stop,
                                             sampling=sampling, max_new_tokens=max_new_tokens)
    return out, {}, cache, None
  out, stats, cache, draft_cache = steps.decode_speculative(
      target, draft, target_params, draft_params, cache, draft_cache, first, rng, stop,
      k=k, sampling=sampling, max_new_tokens=max_new_tokens)
  counters = {f: int(getattr(stats, f).sum()) for f in
              ('proposed', 'accepted', 'emitted', 'target_calls', 'rejected', 'draft_failed')}
  if counters['draft_failed']:
    warnings.warn(draft_failed_message(counters['draft_failed'], counters['target_calls']),
                  stacklevel=3)
  return out, counters, cache, draft_cache


def generate(target: ModelConfig, target_params, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_tokens: Sequence[int] = (), seed: int = 0,
             draft: Optional[ModelConfig] = None, draft_params=None, k: Optional[int] = None,
             max_k: int = MAX_K, page_size: int = 16, prompt_bucket: int = 64,
             steps=LOCAL_STEPS) -> GenerationResult:
  """Generate continuations of a batch of prompts.

  Autoregressive when `draft` is None, speculative (draft K, verify in one target pass) otherwise.
  Prompts are right-padded to a multiple of `prompt_bucket` so similar batches reuse one compile
  (at most to what the context leaves beside max_new_tokens and the slack).

  Args:
    target, target_params: the target model.
    prompts: B token-id sequences of any lengths >= 1 (a list or tuple, or a [B, T] int array).
    max_new_tokens: tokens to emit per prompt at most (>= 1), the first included.
    sampling: temperature / top-k / top-p, applied to target and draft alike.
    stop_tokens: ids that end a row (the stop token is emitted).
    seed: PRNG seed.
    draft, draft_params, k: the draft model and speculation length K in [1, max_k].
    page_size: tokens per KV page (L).
    steps: where the device-side calls run: `LOCAL_STEPS` (default device) or a
      `jaxspec.parallel.ShardedSteps` (target sharded over a mesh, draft replicated).
  Returns:
    GenerationResult.
  Raises:
    ValueError: empty prompts, K out of range, draft and target vocabularies that differ, bad
      token ids (a prompt token or stop id outside the vocabulary, a bool prompt token, a stop
      id that is not an integer), a seed that is not a 64-bit int, sampling that is not a
      SamplingParams.
    ContextOverflowError: a prompt that does not fit a model's context with max_new_tokens and
      the slack (1, or K + 1 when speculating; a ValueError).
    NonFiniteLogitsError: the target's logits were NaN or +inf for some prompt (its row ended
      with INVALID_TOKEN; e.g. a float16 model that overflows).
    TypeError: target or draft not a `ModelConfig` (e.g. a `Transformer` module).
    CheckpointError: target_params (or draft_params) that are not the config's params (a
      tensor missing, extra, of another shape or of a dtype that is not a float, named).
  """
  check_sampling(sampling)
  seed = check_seed(seed)
  configs, slack, stop = check_request(target, prompts, max_new_tokens=max_new_tokens,
                                       stop_tokens=stop_tokens, draft=draft,
                                       draft_params=draft_params, k=k, max_k=max_k)
  max_new_tokens = int(max_new_tokens)
  k = int(k) if draft is not None else k         # checked: numpy integers and 0-d arrays too
  page_size = check_int('page_size', page_size, 1)
  prompt_bucket = check_int('prompt_bucket', prompt_bucket, 1)
  check_params(target, target_params, 'target_params')
  if draft is not None:
    check_params(draft, draft_params, 'draft_params')

  b = len(prompts)
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = -(-int(lengths.max()) // prompt_bucket) * prompt_bucket
  # The padding never outgrows the context (checked: the longest prompt + max_new_tokens + slack
  # fits it): a bucket of 100000 sized a 320 GB pool for a 256-token model.
  width = min(width, min(c.max_seq_len for c in configs) - int(max_new_tokens) - slack)
  tokens = np.zeros((b, width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  per_seq = pages_needed(width + max_new_tokens + slack, page_size)
  allocator = PageAllocator(b * per_seq + 1)
  page_table = np.array([allocator.allocate(per_seq) for _ in range(b)], np.int32)

  rng_prefill, rng_decode = jax.random.split(seed_key(seed))
  tokens, lengths = steps.put_batch(tokens), steps.put_batch(lengths)
  rng_prefill, rng_decode, stop = map(steps.put_replicated, (rng_prefill, rng_decode, stop))
  start = time.perf_counter()
  cache = steps.new_cache(target, page_table, allocator.num_pages, page_size)
  first, cache = steps.prefill(target, target_params, cache, tokens, lengths, rng_prefill,
                               sampling=sampling)
  draft_cache = None
  if draft is not None:
    draft_cache = steps.new_cache(draft, page_table, allocator.num_pages, page_size, draft=True)
    _, draft_cache = steps.prefill(draft, draft_params, draft_cache, tokens, lengths,
                                   rng_prefill, sampling=sampling)
    jax.block_until_ready(draft_cache)
  first = jax.block_until_ready(first)
  ttft = time.perf_counter() - start

  start = time.perf_counter()
  out, counters, _, _ = decode(target, target_params, cache, first, rng_decode, stop,
                              sampling=sampling, max_new_tokens=max_new_tokens, draft=draft,
                              draft_params=draft_params, draft_cache=draft_cache, k=k,
                              steps=steps)
  out = jax.block_until_ready(out)
  decode_s = time.perf_counter() - start
  toks, nums = np.asarray(out.tokens), np.asarray(out.num_tokens)
  rows = [toks[i, :nums[i]].tolist() for i in range(b)]
  check_valid(rows)
  return GenerationResult(tokens=rows, ttft_s=ttft,
                          decode_s=decode_s, prompt_tokens=int(lengths.sum()),
                          prefill_tokens=int(lengths.sum()), **counters)
