"""Choosing the speculation length K of each decode round (host side, plain Python).

The engine asks its policy once per decode round for one K in {0, ..., K_max} for the whole batch
(each K is one compiled step, so the batch shares it) and a per-row cap <= K on how many of the
K proposals a row may accept; after the round it reports each row's outcome. Policies:

- `FixedK`: K = K_max every round (the engine's behaviour before adaptive K).
- `ScheduleK`: Hugging Face assisted generation's "heuristic" schedule, per request: K_i += 2
  after a round in which all K_i proposals were accepted, else K_i -= 1 (floor `min_k` >= 1). The
  batch K is max_i K_i and row i's acceptance is capped at K_i, so every request follows its own
  schedule exactly (the draft drafts max_i K_i for all rows; the extra proposals are not used;
  with prompt lookup a row that found fewer than K_i proposals counts as not all accepted).
- `GoodputK` (`jaxspec.engine.goodput`): SmartSpec (Liu et al. 2024, "Optimizing Speculative
  Decoding for Serving Large Language Models Using Goodput") / TurboSpec: K = argmax_K
  Σ_i E[tokens_i | α_i, β_i, K] / t(K), with E = 1 + α Σ_{j<K} Π_{m=2..j+1} β_m (Leviathan
  et al. 2023, Eq. 1, with the first proposal's acceptance α apart from the later ones' β,
  β_m = β times the global profile of position m), α_i, β_i each request's estimates
  (`AlphaTracker`) and t(K) the seconds of one decode round at K (the
  device step measured at start-up plus the host work per round measured online).

Acceptance observations (`observe`): (successes, trials) of one round for one row, so α is the
ratio of two EMAs (consistent, unlike an EMA of per-round ratios under the geometric stopping
of a round). A round at K_i >= 1 that accepted n gives (n, n + [n < K_i]): n accepted positions
and one rejected one unless all were accepted (a missing proposal counts as rejected, so for
prompt lookup α is "a proposal exists and is accepted"). A K = 0 round gives the drafter's own
estimate of one drafted token's acceptance: Σ min(p, q) for a draft model, [lookup proposal ==
emitted token] for prompt lookup (both with expectation α), so α keeps being estimated and the
policy can leave K = 0 again. `GoodputK` re-reads a round at K_i >= 1 from (K_i, n) as one
first-proposal trial and the later positions' trials
(`jaxspec.engine.acceptance.round_observation`).
"""

from __future__ import annotations

import abc
import math
from typing import Hashable, Mapping, Optional, Sequence

from jaxspec.checks import build_with_options, check_int, is_int_in


class KPolicy(abc.ABC):
  """Interface of a K policy. The engine calls `setup` once, `choose` before and `observe` after
  each decode round, `forget` when a request finishes.

  Attributes:
    k_max: K_max (set by `setup`).
    needs_costs: whether `set_costs` must still be called before `choose` (the engine measures
      the cost table at `warm_up`, or before its first decode round).
    sync_s: seconds the engine must spend before a round at K >= 1 to bring a lazily kept draft
      cache up to date (`jaxspec.engine.draft_sync`), set before each `choose`; 0 when the
      draft is in sync or there is none.
    rooms: tokens each request of the coming `choose` may still emit (aligned with its
      request_ids; set by the engine before each `choose`, None when unknown): a round emits at
      most that many, and a lazy draft's catch-up serves the rounds that emit them.
    split_s, split_tokens: the extra prefill seconds a round at K >= 1 costs by breaking the
      lock-step of requests that would finish together at K = 0 (their successors are then
      prefilled one by one instead of in one call: `jaxspec.engine.speculation.split_cost`),
      and the tokens those successors will emit; set before each `choose` (0 when the finishes
      are already apart or nothing waits).
    queued: requests waiting for a slot or still prefilling (set before each `choose`; None
      when unknown).
    queue_rooms: the decode tokens (room after the prefill's token) of those requests, still
      prefilling first, then waiting in admission order (set before each `choose`; None when
      unknown); slots: the engine's batch slots (None when unknown).
    rows: the row count of the coming round's device call (the engine's decode row bucket
      holding the busy requests; set before each `choose`, None when unknown: the full batch).
    confidences: per request of the coming `choose`, the target's mean top probability (max
      softmax) over its recent tokens (`speculation.confidence`: drawn by prefill, by K = 0
      rounds and, if `wants_spec_confidences`, by the draft model's K >= 1 rounds; None where
      unknown, and None without a lazy draft cache, which alone records it, or unless
      `wants_confidences`: gathering them costs host time).
    confidence_tokens: per request, how many tokens its confidence averages (set with
      `confidences`; 1 for a new request's, its first token's from prefill).
    wants_confidences: whether the policy reads `confidences` (default False).
    wants_spec_confidences: whether those take the tokens of rounds at K >= 1 too (default
      False; the draft model's verify pass then computes them, `spec_steps.model_step`).
  """

  needs_costs = False
  sync_s = 0.0
  split_s = 0.0
  split_tokens = 0
  rooms: Optional[Sequence[int]] = None
  rows: Optional[int] = None
  queued: Optional[int] = None
  queue_rooms: Optional[Sequence[int]] = None
  slots: Optional[int] = None
  confidences: Optional[Sequence[Optional[float]]] = None
  confidence_tokens: Optional[Sequence[int]] = None
  wants_confidences = False
  wants_spec_confidences = False

  def __init__(self):
    self.k_max: Optional[int] = None

  def setup(self, k_max: int) -> None:
    """Bind K_max (>= 1). Raises ValueError for a bad K_max or a policy already bound to
    another one (one policy instance per engine)."""
    k_max = check_int(f'{type(self).__name__} K_max', k_max, 1)
    if self.k_max is not None:
      raise ValueError(f'{type(self).__name__} is already bound to an engine (K_max='
                       f'{self.k_max}): a policy keeps per-request state, give each engine its '
                       f'own instance')
    self.k_max = k_max

  def release(self) -> None:
    """Unbind K_max: an engine that failed to build gives its policy back (it ran no request,
    so there is no per-request state to drop) and the instance can serve a corrected one."""
    self.k_max = None

  @property
  def candidates(self) -> tuple:
    """Every K this policy may choose (the engine compiles and times these at warm_up)."""
    return tuple(range(self.k_max + 1))

  def set_costs(self, costs: Mapping[int, float],
                by_rows: Optional[Mapping[int, Mapping[int, float]]] = None) -> None:
    """The cost table t(K) in seconds per decode round over the full batch, and optionally one
    per row bucket {rows: {K: seconds}} (ignored unless `needs_costs`)."""

  @abc.abstractmethod
  def choose(self, request_ids: Sequence[Hashable]) -> tuple:
    """(K: int in `candidates`, caps: list of int, each in [0, K], one per request)."""

  def repeat(self, request_ids: Sequence[Hashable], rows: Optional[int],
             queued: Optional[int], rooms: Optional[Sequence[int]] = None) -> Optional[tuple]:
    """A choice the policy keeps for this round without being told the round's rooms, queue,
    catch-up and split seconds (which cost host time to gather), as `choose` returns it, or
    None to be asked `choose` with all of them (default). rows: the round's row bucket; queued:
    requests waiting or prefilling; rooms: the decoding requests' rooms (None: not known). Only
    asked when no probe is due."""
    return None

  def gets_confidences(self, lazy_draft: bool, speculating: bool = False) -> bool:
    """Whether the engine gathers `confidences` for this policy (and, speculating, has its K >=
    1 rounds compute them): only with a lazy draft cache (which alone records them), only if
    `wants_confidences`, and from rounds at K >= 1 only if `wants_spec_confidences` too."""
    return bool(lazy_draft and self.wants_confidences and
                (not speculating or self.wants_spec_confidences))

  def observe(self, request_id: Hashable, k: int, accepted: int, successes: float,
              trials: float) -> None:
    """Outcome of one round for one request: its cap k (0 in a K = 0 round), proposals it
    accepted, and the acceptance observation (successes, trials) described in the module doc
    (trials 0: nothing observed)."""

  def observe_probe(self, request_id: Hashable, successes: float, trials: float,
                    later_successes: float, later_trials: float,
                    confidence: Optional[float] = None) -> None:
    """A lazy draft's probe (`jaxspec.engine.draft_sync`) scored tokens the target drew at
    K = 0: first-proposal (successes, trials) as `observe` of a K = 0 round, and over the pairs
    of consecutive scored tokens later_trials Σ s_j (the first accepted) and later_successes
    Σ s_j s_{j+1} (the next accepted too), evidence of the later proposals' acceptance β that
    K = 0 rounds give no other way (`spec_steps.draft_catch_up`); confidence: the target's mean
    top probability over the scored tokens (None over fewer than `AlphaTracker.FIT_TOKENS`: too
    noisy to fit acceptance on). Default: `observe` of the first-proposal counts alone."""
    self.observe(request_id, 0, 0, successes, trials)

  def forget(self, request_id: Hashable) -> None:
    """The request finished: drop its state."""

  def worth_probing(self, request_ids: Sequence[Hashable]) -> bool:
    """Whether a better α estimate of these requests could change the choice (a lazy draft
    cache probes only then; default True)."""
    return True

  @property
  def cold(self) -> bool:
    """Whether the policy's acceptance estimates still rest on too few observations to be
    trusted (a lazy draft cache then probes outside its time budget,
    `jaxspec.engine.draft_sync`; default False): a fresh engine's first probes score a token or
    two each, and a low estimate from them held a first B = 2 json pass at K = 0 for 106 of its
    116 rounds, probes past the early ones being budgeted ~40 rounds apart."""
    return False

  def round_outcome(self, tokens: int, catch_up_s: float) -> None:
    """What the decode round just run emitted, told before its `round_timing`: `tokens`, over
    all rows, after stop-token and max-token cuts (a failed row's up to its failure), and
    `catch_up_s`, the seconds a lazy draft cache's catch-up took right before the round (0
    without one; a probe's are not in it; neither is in the round's host seconds). Default:
    ignored."""

  def round_timing(self, k: int, device_s: float, host_s: float) -> None:
    """Wall seconds of the decode round just run at K = k: the device call (`device_s`:
    dispatch, step, reading back; with a choice made while a K = 0 round runs,
    `jaxspec.engine.draft_sync.DraftSync.overlaps`, also what of it the call did not hide) and
    the host work around it (`host_s`: scheduling, tables, proposals, emitting)."""


class FixedK(KPolicy):
  """K = K_max every round, every row capped at K_max."""

  @property
  def candidates(self) -> tuple:
    return (self.k_max,)

  def choose(self, request_ids):
    return self.k_max, [self.k_max] * len(request_ids)

  def repeat(self, request_ids, rows, queued, rooms=None):
    """Always the same choice: the engine need not gather the horizon for it."""
    return self.choose(request_ids)


class ScheduleK(KPolicy):
  """Per request K_i: start at `initial` (default K_max), +2 after a round that accepted all K_i,
  -1 otherwise, kept in [min_k, K_max] (Hugging Face transformers, assisted generation,
  `num_assistant_tokens_schedule='heuristic'`). Batch K = max_i K_i; row i capped at K_i.

  Raises:
    ValueError: min_k < 1 (a K_i of 0 would count as "all accepted" and bounce back) or
      initial outside [min_k, K_max].
  """

  def __init__(self, initial: Optional[int] = None, min_k: int = 1):
    super().__init__()
    min_k = check_int('ScheduleK min_k', min_k, 1)
    if initial is not None:
      if not is_int_in(initial, -math.inf, math.inf):
        raise ValueError(f'ScheduleK initial must be an int (or None), got {initial!r}')
      initial = int(initial)
    self.initial, self.min_k = initial, min_k
    self.k_of: dict = {}

  def setup(self, k_max: int) -> None:
    super().setup(k_max)
    if self.min_k > k_max:
      raise ValueError(f'ScheduleK min_k={self.min_k} exceeds K_max={k_max}')
    if self.initial is not None and not self.min_k <= self.initial <= k_max:
      raise ValueError(f'ScheduleK initial={self.initial!r} outside [{self.min_k}, {k_max}]')

  @property
  def candidates(self) -> tuple:
    return tuple(range(self.min_k, self.k_max + 1))

  def k_for(self, request_id) -> int:
    """The request's current K_i."""
    return self.k_of.get(request_id, self.k_max if self.initial is None else self.initial)

  def choose(self, request_ids):
    caps = [self.k_for(r) for r in request_ids]
    return (max(caps) if caps else self.k_max), caps

  def observe(self, request_id, k, accepted, successes, trials):
    if k < 1:
      return
    step = 2 if accepted >= k else -1
    self.k_of[request_id] = min(self.k_max, max(self.min_k, k + step))

  def forget(self, request_id):
    self.k_of.pop(request_id, None)


def make_policy(policy, **options) -> KPolicy:
  """A policy from its name ('fixed', 'schedule', 'goodput': `jaxspec.engine.goodput.GoodputK`)
  built with `options` as its constructor's keyword arguments (e.g. `make_policy('goodput',
  spec_confidence=True)`), or a `KPolicy` instance (returned as is, without options).

  Raises:
    ValueError: naming the value: an unknown policy, an option the policy's constructor does not
      take (the known ones listed), options with an instance, or a value the constructor
      refuses.
  """
  from jaxspec.engine.goodput import GoodputK    # goodput.py builds on this module
  policies = {'fixed': FixedK, 'schedule': ScheduleK, 'goodput': GoodputK}
  if isinstance(policy, KPolicy):
    if options:
      raise ValueError(f'k_policy options {options} need a policy name, not the instance '
                       f'{policy!r} (build it with them instead)')
    return policy
  if not (isinstance(policy, str) and policy in policies):
    raise ValueError(f'unknown k_policy {policy!r}: expected one of {sorted(policies)} or a '
                     f'KPolicy instance')
  return build_with_options('k_policy', policy, policies, options)
