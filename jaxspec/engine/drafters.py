"""Drafters: how the engine proposes up to K tokens per slot and verifies them, behind one
interface (`Drafter.decode`), so the scheduler, the K policy and the metrics do not care where
proposals come from.

- `ModelDrafter`: a draft model drafts K autoregressively on device, one target pass verifies
  (Leviathan et al. 2023; `spec_steps.model_step`).
- `NGramDrafter`: prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram`
  speculator): no model; on the host, the most recent earlier occurrence of the last n tokens of
  a request's context (prompt + output), n from `max_ngram` down to `min_ngram`, and the (up to)
  K tokens that followed it. Verified with one-hot q (`spec_steps.lookup_step`).

Every decode round returns a `Round` with static width K + 1; rows that propose fewer than K
(`num_proposed`) accept at most that many.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Optional, Sequence

import numpy as np

from jaxspec.checks import build_with_options, check_int, check_real
from jaxspec.engine import device, spec_steps


@dataclasses.dataclass
class Round:
  """What one decode round did, per slot (numpy, host side).

  Attributes:
    window: [B, K+1] int32, x_1..x_n then the correction/bonus token (K = 0: [B, 1]).
    num_accepted: [B] int32 n, proposals accepted by rejection sampling (before cuts).
    emitted: [B] int32 tokens to emit after stop-token / max-token cuts (0 for idle rows).
    num_proposed: [B] int32 proposals each row really had (<= its cap; 0 in K = 0 rounds).
    successes, trials: [B] float64, the round's acceptance observation per row for the K policy
      (see `jaxspec.engine.k_policy`); trials 0: nothing observed.
    token_p: [B] float32 p(token) of a K = 0 round's token under the target (None otherwise).
    max_p: [B, K+1] float32 the target's max softmax probability at each window position (its
      confidence where it drew that token: `plain_round`, [B, 1], and a draft model's K >= 1
      round for a lazy draft's policy that reads them there,
      `KPolicy.wants_spec_confidences`; None otherwise).
    draft_failed: [B] bool, a draft model's logits were NaN or +inf at some proposal, or in a
      K = 0 round at the position it scores (None: no draft model ran this round).
  """

  window: np.ndarray
  num_accepted: np.ndarray
  emitted: np.ndarray
  num_proposed: np.ndarray
  successes: np.ndarray
  trials: np.ndarray
  token_p: Optional[np.ndarray] = None
  draft_failed: Optional[np.ndarray] = None
  max_p: Optional[np.ndarray] = None


def plain_round(engine, caches, pending, room, stop, rng, sampling, meanwhile=None):
  """A K = 0 round of the target alone: `device.decode_round`; `meanwhile()` (if given) runs
  after the call is dispatched, before its results are read (host work that hides behind the
  device's). Returns (Round, [target cache]) (the engine keeps any cache it did not bind, e.g.
  a lazy draft's)."""
  window, emitted, token_p, max_p, target_cache = device.decode_round(
      engine.target, engine.target_params, caches[0], pending, room, stop, rng, sampling)
  if meanwhile is not None:
    meanwhile()
  b = pending.shape[0]
  zeros = np.zeros((b,), np.int32)
  window, emitted, token_p, max_p = device.fetch((window, emitted, token_p, max_p))
  return Round(window, zeros, emitted, zeros, np.zeros((b,)), np.zeros((b,)), token_p,
               max_p=max_p[:, None]), [target_cache]


def observation(n: np.ndarray, caps: np.ndarray, busy: np.ndarray):
  """(successes, trials) [B] float64 of a K >= 1 round: n accepted, and one rejected position
  unless n reached the row's cap (idle rows and rows capped at 0: no observation)."""
  n = n.astype(np.float64)
  trials = np.where(busy & (caps > 0), n + (n < caps), 0.0)
  return np.where(trials > 0, n, 0.0), trials


class Drafter(abc.ABC):
  """Interface: one decode round at a given K for every slot.

  Attributes:
    uses_draft_model: whether the engine must hold a draft model and its cache (prefilled with
      the target's, same page tables).
    uses_context: whether `decode` reads `contexts` (the engine builds them only then).
  """

  uses_draft_model = False
  uses_context = False

  @abc.abstractmethod
  def decode(self, engine, caches: list, *, k: int, pending: np.ndarray, room: np.ndarray,
             stop: np.ndarray, caps: np.ndarray, contexts: Sequence, rng, sampling):
    """One decode round.

    Args:
      engine: the `Engine` (models, params, sampling).
      caches: [target cache, (draft cache)] bound to this round's page tables and lengths
        (donated: use the returned ones); the target's alone in a K = 0 round of a lazy draft
        cache (`jaxspec.engine.draft_sync`).
      k: the round's K in [0, K_max] (static: one compile per value).
      pending: [B] int32 last committed token per slot; room: [B] int32 tokens a slot may still
        emit (0: idle); stop: [B, S] int32 stop ids, -1 padded.
      caps: [B] int32 in [0, K], proposals each row may accept at most.
      contexts: [B] token lists, prompt + output (pending last) of busy slots, None for idle.
      rng: PRNG key.
      sampling: `RowSampling`, each slot's request's parameters ([B] arrays; idle rows greedy).
    Returns:
      (Round, caches): the caches it was given, updated.
    """


class ModelDrafter(Drafter):
  """The draft model drafts K on device (`spec_steps.model_step`).

  K = 0 rounds: with a lazy draft cache (the default when the engine's K policy may choose
  K = 0), the target runs alone and the draft catches up later, in chunks, before the next round
  at K >= 1, and a few requests now and then (probes) to score it on what the target drew
  (`jaxspec.engine.draft_sync`): K = 0 then costs about what plain continuous batching costs. With
  `lazy=False` the draft runs on the pending token too (`spec_steps.model_sync_step`): its cache
  stays in sync and Σ min(p, q) is the round's acceptance observation (trials 1).

  Args:
    lazy: keep the draft cache lazily when the policy may choose K = 0 (ignored otherwise: at
      K >= 1 every round the draft is always in sync, and it is prefilled with the target).
    probe_every: K = 0 rounds between two probes at least (>= 1), after early probes at 1, 2,
      4, ... rounds from the last round at K >= 1; None: never probe.
    probe_rows: requests a probe catches up and scores (>= 1; the least behind first).
    probe_budget: the fraction of the K = 0 rounds' time that probes may take, in (0, 1]
      (estimated from the measured costs; None: probe every `probe_every` rounds regardless).
    observe_tokens: M, tokens per request a catch-up scores at most (its last M; >= 1).
    fill_prefill: prefill fills the lazy draft cache at K = 0 too while K >= 1 is within reach
      (`DraftSync.fills_prefill`, which asks the probes' state: needs probe_every; off: only
      while the engine speculates).
    overlap_choice: K = 0 rounds may run while the policy chooses (`DraftSync.overlaps`).
    probe_new: probes go to requests the draft has not scored yet, first and without asking
      the policy (`DraftSync.probe_new`; off by default, an experiment).
  Raises:
    ValueError: a value out of range, lazy, fill_prefill, overlap_choice or probe_new not a bool,
      fill_prefill without probes (probe_every None: it would never fill).
  """

  uses_draft_model = True
  # The options that act on the lazy draft cache only (`jaxspec.engine.draft_sync`): an engine
  # that keeps none (its policy never chooses K = 0, e.g. a fixed K >= 1 or 'schedule', or
  # lazy=False) would leave them unused, and refuses them set (`lazy_options_set`).
  LAZY_OPTIONS = ('probe_every', 'probe_rows', 'probe_budget', 'observe_tokens', 'fill_prefill',
                  'overlap_choice', 'probe_new')

  def __init__(self, lazy: bool = True, probe_every: Optional[int] = 8, probe_rows: int = 1,
               probe_budget: Optional[float] = 0.01, observe_tokens: int = 8,
               fill_prefill: bool = False, overlap_choice: bool = True, probe_new: bool = False):
    for name, flag in (('lazy', lazy), ('fill_prefill', fill_prefill),
                       ('overlap_choice', overlap_choice), ('probe_new', probe_new)):
      if not isinstance(flag, bool):
        raise ValueError(f'{name} must be a bool, got {flag!r}')
    if probe_every is not None:
      probe_every = check_int('probe_every', probe_every, 1)
    if fill_prefill and probe_every is None:
      raise ValueError('fill_prefill=True fills the draft at K = 0 only while probes may run; '
                       'with probe_every=None it never would')
    probe_rows = check_int('probe_rows', probe_rows, 1)
    observe_tokens = check_int('observe_tokens', observe_tokens, 1)
    if probe_budget is not None:
      probe_budget = check_real('probe_budget (or None)', probe_budget, 0, 1, low_open=True)
    self.lazy, self.probe_every, self.probe_rows = lazy, probe_every, probe_rows
    self.probe_budget, self.observe_tokens = probe_budget, observe_tokens
    self.fill_prefill, self.overlap_choice = fill_prefill, overlap_choice
    self.probe_new = probe_new

  def lazy_options_set(self) -> list:
    """The `LAZY_OPTIONS` whose values differ from the constructor's defaults (sorted names):
    an engine that keeps no lazy draft cache refuses a drafter with any
    (`jaxspec.engine.speculation.setup`)."""
    defaults = inspect.signature(type(self).__init__).parameters
    return sorted(name for name in self.LAZY_OPTIONS
                  if getattr(self, name) != defaults[name].default)

  def decode(self, engine, caches, *, k, pending, room, stop, caps, contexts, rng, sampling):
    busy = room > 0
    if k == 0 and engine.draft_sync is not None:
      return plain_round(engine, caches, pending, room, stop, rng, sampling)
    if k == 0:
      window, emitted, beta, failed, target_cache, draft_cache = spec_steps.model_sync_step(
          engine.target, engine.draft, engine.target_params, engine.draft_params, caches[0],
          caches[1], pending, room, stop, rng, sampling)
      b = pending.shape[0]
      zeros = np.zeros((b,), np.int32)
      beta = np.where(busy, np.asarray(beta, np.float64), 0.0)
      return Round(np.asarray(window), zeros, np.asarray(emitted), zeros, beta,
                   busy.astype(np.float64), draft_failed=np.asarray(failed) & busy), [
                       target_cache, draft_cache]
    window, n, emitted, failed, max_p, target_cache, draft_cache = spec_steps.model_step(
        engine.target, engine.draft, engine.target_params, engine.draft_params, caches[0],
        caches[1], pending, room, stop, caps, rng, sampling, k=k,
        confidence=engine.policy is not None and engine.policy.gets_confidences(
            engine.draft_sync is not None, speculating=True))
    window, n, emitted, failed, max_p = device.fetch((window, n, emitted, failed, max_p))
    successes, trials = observation(n, caps, busy)
    return Round(window, n, emitted, np.where(busy, caps, 0), successes, trials,
                 draft_failed=failed & busy, max_p=max_p), [target_cache, draft_cache]


def lookup(context: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list:
  """Prompt-lookup proposals: for n = max_ngram down to min_ngram, the most recent occurrence of
  the context's last n tokens that starts earlier than the suffix itself, and the (at most k)
  tokens that followed it; the first n with a match wins (longest match).

  Args:
    context: token ids (prompt + output); k >= 0.
  Returns:
    up to k token ids ([] when no n-gram of the allowed sizes recurs, or k = 0).
  Raises:
    ValueError: k, max_ngram or min_ngram not an int, min_ngram < 1 or > max_ngram.
  """
  k, max_ngram, min_ngram = (check_int(name, v) for name, v in
                              (('k', k), ('max_ngram', max_ngram), ('min_ngram', min_ngram)))
  if not 1 <= min_ngram <= max_ngram:
    raise ValueError(f'need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, '
                     f'max_ngram={max_ngram}')
  ctx = np.asarray(context, np.int64)
  size = len(ctx)
  if k <= 0:
    return []
  for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
    windows = np.lib.stride_tricks.sliding_window_view(ctx[:size - 1], n)   # starts 0..size-1-n
    hits = np.flatnonzero((windows == ctx[size - n:]).all(axis=1))
    if hits.size:
      start = int(hits[-1]) + n
      return ctx[start:start + k].tolist()
  return []


class NGramDrafter(Drafter):
  """Prompt lookup / n-gram drafting (Saxena 2023; vLLM `ngram` speculator), no draft model.

  Rows with fewer than K proposals verify at the same static width K + 1 and accept at most
  `num_proposed`; positions past it draw from p. K = 0 rounds look up one proposal per row and
  observe [proposal == emitted token] (0 without a proposal), an unbiased estimate of the
  probability that a proposed token is accepted.

  Args:
    max_ngram, min_ngram: n-gram sizes tried, longest first (1 <= min_ngram <= max_ngram).
  Raises:
    ValueError: bad n-gram sizes (the engine refuses a draft model beside this drafter).
  """

  def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
    max_ngram = check_int('max_ngram', max_ngram, 1)
    min_ngram = check_int('min_ngram', min_ngram, 1)
    if min_ngram > max_ngram:
      raise ValueError(f'min_ngram={min_ngram} exceeds max_ngram={max_ngram}')
    self.max_ngram, self.min_ngram = max_ngram, min_ngram

  uses_context = True

  def propose(self, contexts: Sequence, caps: np.ndarray, k: int):
    """(proposals [B, max(k, 1)] int32, num_proposed [B] int32 <= caps) for busy rows."""
    b = len(contexts)
    proposals = np.zeros((b, max(k, 1)), np.int32)
    num = np.zeros((b,), np.int32)
    for row, context in enumerate(contexts):
      if context is None or caps[row] <= 0:
        continue
      tokens = lookup(context, int(caps[row]), self.max_ngram, self.min_ngram)
      proposals[row, :len(tokens)] = tokens
      num[row] = len(tokens)
    return proposals, num

  def decode(self, engine, caches, *, k, pending, room, stop, caps, contexts, rng, sampling):
    busy = room > 0
    if k == 0:
      proposals, num = self.propose(contexts, np.where(busy, 1, 0), 1)
      result, caches = plain_round(engine, caches, pending, room, stop, rng, sampling)
      hit = (num > 0) & (proposals[:, 0] == result.window[:, 0])
      result.successes = np.where(busy, hit, 0).astype(np.float64)
      result.trials = (busy & (result.emitted > 0)).astype(np.float64)
      return result, caches
    proposals, num = self.propose(contexts, caps, k)
    window, n, emitted, target_cache = spec_steps.lookup_step(
        engine.target, engine.target_params, caches[0], pending, proposals, num, room, stop, rng,
        sampling)
    n = np.asarray(n)
    successes, trials = observation(n, caps, busy)
    return Round(np.asarray(window), n, np.asarray(emitted), num, successes, trials), \
        [target_cache]


DRAFTERS = {'model': ModelDrafter, 'ngram': NGramDrafter}


def make_drafter(drafter, has_draft_model: bool, **options):
  """The engine's drafter: None (a `ModelDrafter` when a draft model is given, else no
  speculation: returns None), 'model', 'ngram', or a `Drafter` instance; a name (or None with a
  draft model) is built with `options` as its constructor's keyword arguments (e.g.
  `make_drafter('model', True, probe_every=None)`).

  Raises:
    ValueError: naming the value: an unknown name or type, 'model' without a draft model,
      options with an instance or without a drafter, an option the drafter does not take (the
      known ones listed) or a value it refuses.
  """
  if drafter is None and has_draft_model:
    drafter = 'model'
  if drafter is None or isinstance(drafter, Drafter):
    if options:
      raise ValueError(f'drafter options {options} need a drafter name, not {drafter!r}')
    return drafter
  if isinstance(drafter, str) and drafter in DRAFTERS:
    if drafter == 'model' and not has_draft_model:
      raise ValueError("drafter='model' needs a draft model: pass draft= and draft_params=")
    return build_with_options('drafter', drafter, DRAFTERS, options)
  raise ValueError(f'unknown drafter {drafter!r}: expected None, one of {sorted(DRAFTERS)} or a '
                   f'Drafter instance')
