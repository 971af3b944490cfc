"""Acceptance estimates for adaptive K (host side): `AlphaTracker`, per-request and global
exponential moving estimates of the first proposal's acceptance α and each later one's β, a
global profile of how acceptance moves between the later positions j = 2, 3, ... (`profile`),
and `round_observation`, which splits a speculative round into the first and the later kinds
of trial. The goodput policy (`jaxspec.engine.goodput`) scores K from them.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from jaxspec.checks import check_real


class AlphaTracker:
  """Per-request acceptance estimates, each a ratio S / N of exponential moving sums of the
  request's (successes, trials) observations (decay per observed round), kept for two
  positions: the first proposal of a round (α: also what a K = 0 round's probe measures) and
  each later one given the ones before it were accepted (β). Measured draft/target pairs accept
  the first proposal more often (~0.75 against ~0.65 later, `experiments.batching` records at
  K = 1 against K = 2..8), so one α either prices large K too high (fitted on probes) or
  K = 1 too low (fitted on K = 8 rounds).

  A request with no observation yet uses the global estimate, the same ratio over every
  request's observations with `prior_trials` pseudo-trials of `prior` (β's of the global α);
  its sums decay by decay^(1/max(n, global_span)) per observation, n the requests tracked:
  about `decay` per round of n requests, so at a large batch it is not just the last few
  requests', and per `global_span` rounds at least, so at a small one it is not just the last
  few rounds' (at B = 1, where requests run one after another, one request's last rounds all
  rejected would otherwise start the next one far below the workload's α, where K = 0 wins,
  for a whole request). A request's own estimate mixes in `prior_trials` pseudo-trials of the
  global one.

  β's sums decay with every observation, also those that see no later proposal (a K = 0
  probe, a round at K = 1): otherwise β keeps what the last K >= 2 rounds measured for as long
  as the policy runs K = 1, and a low one keeps it there (K = 1 rounds never test β), as it did
  on retrieval at B = 1 (α 0.88, K = 1 in every round after a json stretch at K = 3, 0.66 of
  K = 8's tokens/s); fading, β drifts back to its prior (the global β, whose own prior is the
  global α) until a K >= 2 round measures it again.

  The later positions are not alike either (`scripts/acceptance_by_position.py`): a global
  profile (`observe_depth`, `profile`) keeps each position's acceptance relative to their mean,
  so a request's β at position j is β times the profile's j-th value; its sums fade like β's.

  Args:
    decay: in [0, 1), weight of the past per observed round (0.8: about the last 5 rounds).
    prior: α before any observation at all, in [0, 1].
    prior_trials: pseudo-trials of the global estimate mixed into each request's, and of the
      prior into the global one (so one unlucky first round pins neither near 0: with 4, one
      rejected first proposal moves the global α from 0.5 to 0.4, not to 0.25 as with 1).
    global_span: observations per `decay` of the global sums at least (>= 1).
    confidence_prior_tokens: N0 >= 0, how many tokens of the confidence level x_g a request's
      own confidence is shrunk toward (`confidence_weight`; 0: not shrunk).
  Raises:
    ValueError: a value out of range.
  """

  def __init__(self, decay: float = 0.8, prior: float = 0.5, prior_trials: float = 4.0,
               global_span: float = 8.0, confidence_prior_tokens: float = 3.0):
    decay = check_real('decay', decay, 0.0, 1.0, high_open=True)
    self.global_span = check_real('global_span', global_span, 1.0, math.inf, high_open=True)
    self.confidence_prior_tokens = check_real('confidence_prior_tokens', confidence_prior_tokens,
                                              0.0, math.inf, high_open=True)
    prior = check_real('prior', prior, 0.0, 1.0)
    prior_trials = check_real('prior_trials', prior_trials, 0.0, math.inf, high_open=True)
    self.decay, self.prior, self.prior_trials = decay, prior, prior_trials
    self._sums: dict = {}                 # {request: [S_α, N_α, S_β, N_β]}
    self._global = [0.0, 0.0, 0.0, 0.0]
    self._depth: list = []                # [[S_j, N_j]] for proposal j = 2, 3, ... (global)
    self._shape: dict = {}                # {request: [Σ profile of its later trials, N_β]}
    # Target confidence x (`confidence_shift`): [W, Σx] decayed as the global sums (the x level
    # the global α stands at), and [W, Σx, Σy, Σxx, Σxy] decayed `SLOPE_SPAN` x slower (the fit).
    self._level = [0.0, 0.0]
    self._fit = [0.0] * 5

  def _ratio(self, s: float, n: float, prior: float) -> float:
    w = self.prior_trials
    return (s + w * prior) / (n + w) if n + w > 0 else prior

  @property
  def global_alpha(self) -> float:
    """α (first proposal) over every request's observations, with `prior_trials`
    pseudo-trials of the prior."""
    return self._ratio(self._global[0], self._global[1], self.prior)

  @property
  def global_later(self) -> float:
    """β (a later proposal) over every request's observations, with `prior_trials`
    pseudo-trials of the global α."""
    return self._ratio(self._global[2], self._global[3], self.global_alpha)

  @property
  def global_trials(self) -> float:
    """The (decayed) first-proposal trials behind the global α, its prior's pseudo-trials
    included."""
    return self._global[1] + self.prior_trials

  def alpha(self, request_id, confidence: Optional[float] = None,
            tokens: Optional[float] = None) -> float:
    """The request's α estimate (first proposal) in [0, 1]; its prior, the global α, moved by
    `confidence_shift(confidence, tokens)`."""
    prior = _unit(self.global_alpha + self.confidence_shift(confidence, tokens))
    s = self._sums.get(request_id)
    return prior if s is None else self._ratio(s[0], s[1], prior)

  def later(self, request_id, confidence: Optional[float] = None,
            tokens: Optional[float] = None) -> float:
    """The request's β estimate (a later proposal, given the ones before it accepted); its
    prior, the global β, moved by `confidence_shift(confidence, tokens)`."""
    prior = _unit(self.global_later + self.confidence_shift(confidence, tokens))
    s = self._sums.get(request_id)
    return prior if s is None else self._ratio(s[2], s[3], prior)

  def estimates(self, request_ids, confidences, k_max: int, tokens=None) -> tuple:
    """(α [n], β [n, k_max], profile) float64 arrays and list for the goodput policy: each
    request's `alpha` and, for proposal j = 2..k_max + 1 (column j - 2), its `later` over its
    `shape` times the global `profile(k_max)` at j, at most 1; a request id None stands for a
    request with no observation (the global estimates). confidences: one per request (None:
    unknown), tokens: how many tokens each averages (None, or a None count: not weighed), as
    `confidence_shift` takes them (ignored for the id None).

    Raises:
      ValueError: confidences or tokens not one per request id.
    """
    counts = [None] * len(confidences) if tokens is None else tokens
    pairs = list(zip(confidences, counts, strict=True))
    if len(pairs) != len(request_ids):
      raise ValueError(f'need one confidence per request id, got {len(pairs)} for '
                       f'{len(request_ids)}')
    # `alpha`, `later` and `shape` of every request, their shared terms computed once (a
    # scoring's host time: the policy prices every few rounds).
    g_alpha, g_later, line = self.global_alpha, self.global_later, self._shift_line()
    alphas, later = np.empty(len(pairs)), np.empty(len(pairs))
    for i, (r, (x, n)) in enumerate(zip(request_ids, pairs)):
      if r is None:                 # the global estimates as they stand
        alphas[i], later[i] = g_alpha, g_later
        continue
      s, shift = self._sums.get(r), self._shift(line, x, n)
      alphas[i], later[i] = (_unit(g_alpha + shift), _unit(g_later + shift)) if s is None else \
          (self._ratio(s[0], s[1], _unit(g_alpha + shift)),
           self._ratio(s[2], s[3], _unit(g_later + shift)))
      if r in self._shape:          # `shape` is 1 for a request it does not hold
        later[i] /= self.shape(r)
    profile = self.profile(k_max)
    return alphas, np.minimum(later[:, None] * np.array(profile)[None], 1.0), profile

  def queue_estimates(self, confidences, profile, raise_by: float = 0.0,
                      tokens=None) -> tuple:
    """(α, β [len(profile)]) of a queued request: the global estimates moved by the running
    requests' confidence (`confidence_shift`; the requests of one set arrive together; with
    raise_by > 0, an optimistic pricing, only upward) and raised by `raise_by`, in [0, 1]; β at
    each later position times `profile`. With tokens (one count per confidence), the
    confidence is the token-weighted mean Σ n_i x_i / Σ n_i of the known ones, weighed as one
    of Σ n_i tokens; without (or with a None count), their plain mean, not weighed. Without
    confidences: min(global α + raise_by, 1) and min(global β x profile + raise_by, 1).

    Raises:
      ValueError: tokens not one per confidence.
    """
    counts = [None] * len(confidences) if tokens is None else list(tokens)
    known = [(x, n) for x, n in zip(confidences, counts, strict=True)
             if x is not None and math.isfinite(x)]
    shift = 0.0
    if known and all(n is not None for _, n in known) and sum(n for _, n in known) > 0:
      total = sum(n for _, n in known)
      shift = self.confidence_shift(sum(x * n for x, n in known) / total, total)
    elif known:
      shift = self.confidence_shift(sum(x for x, _ in known) / len(known))
    shift = max(shift, 0.0) if raise_by > 0 else shift
    later = (_unit(self.global_later + shift) * np.array(profile)) + raise_by
    return _unit(_unit(self.global_alpha + shift) + raise_by), np.clip(later, 0.0, 1.0)

  def confidence_shift(self, confidence: Optional[float],
                       tokens: Optional[float] = None) -> float:
    """How much higher than the global α a request's α is expected to be, from the target's
    confidence x on its recent tokens (its mean top probability max softmax(logits); None or
    not finite: 0): λ(n) b (x - x_g), λ(n) = `confidence_weight(tokens)` for x averaged over
    n = tokens, x_g the mean x of the observations behind the global α that came with one
    (their sums fade with the global ones, on every observation) and b >= 0 the slope of
    observed acceptance on x (weighted least squares over those observations, fading
    `SLOPE_SPAN` x slower, and only on observations with an x: without probes the fit keeps
    what it had; shrunk toward 0 by `prior_trials` pseudo-trials of x variance `SLOPE_VAR`). A
    target sure of its next token is one the draft matches more often: on the shipped pair's
    held-out prompts (greedy, 32 each) mean top probability 0.74 / 0.53 / 0.26 on json /
    retrieval / code went with α 0.80 / 0.69 / 0.61, correlation 0.69 over the requests
    (`scripts/confidence_vs_alpha.py`). It moves the estimate of a request with no observation
    of its own when the prompt set changes, where the global α, fed only by rare probes at
    K = 0, still stands at the last set's."""
    return self._shift(self._shift_line(), confidence, tokens)

  def _shift_line(self) -> Optional[tuple]:
    """(slope b, x_g) of `confidence_shift`, or None where it is 0 for every confidence (no
    observation with an x, or no spread of x to fit on and no shrinkage)."""
    w, sx = self._level
    if w <= 0.0:
      return None
    n, fx, fy, fxx, fxy = self._fit
    spread = max(fxx - fx * fx / n, 0.0) + self.prior_trials * self.SLOPE_VAR if n > 0 else 0.0
    if spread <= 1e-12 * max(n, 1.0):
      return None
    return min(max((fxy - fx * fy / n) / spread, 0.0), 1.0), sx / w

  def _shift(self, line: Optional[tuple], confidence, tokens) -> float:
    """`confidence_shift` on the terms `_shift_line` returned."""
    if line is None or confidence is None or not math.isfinite(confidence):
      return 0.0
    return self.confidence_weight(tokens) * line[0] * (confidence - line[1])

  def confidence_weight(self, tokens: Optional[float]) -> float:
    """λ(n) in [0, 1]: how far a confidence averaged over n tokens moves an estimate, against
    one over `CONFIDENCE_TOKENS` (what the fit's confidences mostly average): (n / (n + N0)) /
    (R / (R + N0)), N0 = `confidence_prior_tokens`, R = `CONFIDENCE_TOKENS`, at most 1 (1 with
    tokens None or not finite, or N0 = 0; a count below 0 counts as 0): the mean of few top
    probabilities says less about a request than the mean of many (errors in variables: a
    slope fitted on means of many over-moves a mean of few). The shipped pair
    (`scripts/confidence_vs_alpha.py --first 1,2,4,8,16`, teacher-forced, 96 held-out prompts)
    puts the first n tokens' slope at 0.57 / 0.66 / 0.83 / 0.95 of 16's for n = 1 / 2 / 4 / 8;
    the engine's own K = 2 rounds at B = 4 (a scratch run, 96 requests) at 0.27 / 0.50 / 0.68 /
    0.88; N0 = 3 gives 0.30 / 0.48 / 0.68 / 0.86 (docs/adaptive_k.md)."""
    n0 = self.confidence_prior_tokens
    if tokens is None or n0 <= 0.0 or not math.isfinite(tokens):
      return 1.0
    n, r = max(float(tokens), 0.0), float(self.CONFIDENCE_TOKENS)
    return min(1.0, n / (n + n0) * (r + n0) / r)

  SLOPE_VAR = 0.01    # variance of x of a pseudo-trial of slope 0 (`confidence_shift`)
  SLOPE_SPAN = 4.0    # the fit's sums fade this many times slower than the global ones
  FIT_TOKENS = 4      # tokens a confidence averages at least to be fitted (fewer: too noisy)
  # Tokens the policy's confidences average at most (`confidence_weight`,
  # `jaxspec.engine.speculation.known_max_p`).
  CONFIDENCE_TOKENS = 16

  def observe(self, request_id, successes: float, trials: float, later_successes: float = 0.0,
              later_trials: float = 0.0, later_weight: Optional[float] = None,
              confidence: Optional[float] = None) -> None:
    """Add one round's first-proposal (successes, trials) of a request and its later-proposal
    ones; nothing when both trial counts are 0. Decays the request's sums by `decay` and the
    global ones by decay^(1/max(n, global_span)) first (n requests tracked): the first
    proposal's when observed, the later ones' always. `later_weight`: the sum of `profile`'s
    values at the positions of the later trials (None: 1 each), kept alike for `shape`.
    `confidence`: the target's mean max softmax probability on the request's recent tokens
    (None or not finite: unknown), for `confidence_shift`.

    Raises:
      ValueError: a count that is not a finite number (one NaN would stay in the global sums
        every request's estimate shares), or successes outside [0, trials] (an α above 1 or
        below 0 would be shared the same way)."""
    counts = (successes, trials, later_successes, later_trials)
    if not all(math.isfinite(x) for x in counts) or (
        later_weight is not None and not math.isfinite(later_weight)):
      raise ValueError(f'acceptance counts must be finite numbers, got successes={successes}, '
                       f'trials={trials}, later_successes={later_successes}, '
                       f'later_trials={later_trials}, later_weight={later_weight}')
    for wins, tries, name in ((successes, trials, ''), (later_successes, later_trials, 'later_')):
      # Σ min(p, q) of a K = 0 round, a float32 sum over the vocabulary, may round past its
      # one trial (a self-draft's p = q: 1 + a few 1e-6).
      if wins < 0 or tries < 0 or wins > tries * (1 + 1e-3):
        raise ValueError(f'acceptance counts must satisfy 0 <= {name}successes <= '
                         f'{name}trials, got {name}successes={wins}, {name}trials={tries}')
    if trials <= 0 and later_trials <= 0:
      return
    old = self._sums.get(request_id, [0.0, 0.0, 0.0, 0.0])
    self._sums[request_id] = _decayed(old, self.decay, successes, trials, later_successes,
                                      later_trials)
    weight, n = self._shape.get(request_id, (0.0, 0.0))
    self._shape[request_id] = [
        self.decay * weight + (later_trials if later_weight is None else later_weight),
        self.decay * n + later_trials]
    span = max(len(self._sums), self.global_span)
    self._global = _decayed(self._global, self.decay ** (1.0 / span), successes,
                            trials, later_successes, later_trials)
    if trials > 0:
      self._observe_confidence(self.decay ** (1.0 / span), successes, trials, confidence)

  def _observe_confidence(self, decay: float, successes: float, trials: float,
                          confidence: Optional[float]) -> None:
    """Fade the confidence sums with the global ones and add one observation that has an x."""
    x = confidence if confidence is not None and math.isfinite(confidence) else None
    w = trials if x is not None else 0.0
    self._level = [decay * self._level[0] + w, decay * self._level[1] + w * (x or 0.0)]
    if x is None:
      return
    slow = decay ** (1.0 / self.SLOPE_SPAN)
    y = successes / trials
    self._fit = [slow * f + v for f, v in zip(self._fit, (w, w * x, w * y, w * x * x,
                                                           w * x * y))]

  def observe_depth(self, cap: int, accepted: int) -> None:
    """Decay the global position sums (`profile`) as the global ones decay per observed round,
    and add one round's trials at each proposal position j >= 2: a round at cap K that
    accepted n proposals tried position j iff the ones before it were accepted (j <= n + 1,
    j <= K) and accepted it iff j <= n (none at K <= 1: those rounds, and K = 0 probes, only
    fade the sums, as `observe` fades β, so a position measured low does not keep K low for
    good)."""
    n = max(0, min(int(accepted), int(cap)))
    last = min(n + 1, int(cap))
    while len(self._depth) < last - 1:
      self._depth.append([0.0, 0.0])
    decay = self.decay ** (1.0 / max(len(self._sums), self.global_span))
    for j, sums in enumerate(self._depth, start=2):
      sums[0] *= decay
      sums[1] *= decay
      if j <= last:
        sums[0] += float(j <= n)
        sums[1] += 1.0

  def profile(self, k_max: int) -> list:
    """[k_max] floats: for proposal j = 2..k_max + 1, the global acceptance at position j
    (given the ones before it accepted) over the mean over positions of the same sums, each
    with `prior_trials` pseudo-trials of that mean (1 where nothing was observed, or nothing
    accepted). A request's β at position j is its β times this (capped at
    1): the profile moves acceptance between positions and leaves its level to β. Measured
    pairs do not accept every later position alike (the shipped pair at K = 8: retrieval 0.41
    at j = 2 and ~0.7 past it, code 0.53 then 0.50, json 0.71 then ~0.8,
    `scripts/acceptance_by_position.py`), and one β priced K = 2 on retrieval and K >= 3 on
    code too high."""
    w = self.prior_trials
    total_s = sum(s for s, _ in self._depth)
    total_n = sum(n for _, n in self._depth)
    if total_s <= 0.0 or total_n <= 0.0:
      return [1.0] * k_max
    mean = total_s / total_n
    out = []
    for j in range(k_max):
      s, n = self._depth[j] if j < len(self._depth) else (0.0, 0.0)
      out.append((s + w * mean) / (n + w) / mean if n + w > 0 else 1.0)
    return out

  def shape(self, request_id) -> float:
    """The mean `profile` value over the positions behind the request's β (its decayed later
    trials, with `prior_trials` pseudo-trials at 1, the global β's mix): a request's β at
    position j is β / shape times the profile's j-th value. A request that ran K = 2 has a β of
    position 2 alone, and multiplying it by position 2's profile value again would count the
    profile twice."""
    weight, n = self._shape.get(request_id, (0.0, 0.0))
    w = self.prior_trials
    return (weight + w) / (n + w) if n + w > 0 else 1.0

  def forget(self, request_id) -> None:
    """Drop a finished request's sums (the global estimate keeps its observations)."""
    self._sums.pop(request_id, None)
    self._shape.pop(request_id, None)


def _unit(value: float) -> float:
  return min(max(value, 0.0), 1.0)


def _decayed(sums, decay: float, s1: float, n1: float, s2: float, n2: float) -> list:
  """[S_α, N_α, S_β, N_β] after one observation: α's pair decays and adds its trials when it
  has some; β's pair decays always (it fades while unobserved) and adds its own."""
  out = list(sums)
  for i, (s, n) in enumerate(((s1, n1), (s2, n2))):
    if n > 0 or i == 1:
      out[2 * i] = decay * out[2 * i] + s
      out[2 * i + 1] = decay * out[2 * i + 1] + n
  return out


def round_observation(cap: int, accepted: int) -> tuple:
  """(first successes, first trials, later successes, later trials) of a round at cap >= 1 that
  accepted n = `accepted` proposals: the first proposal is one trial, accepted iff n >= 1; the
  later ones (only after an accepted first) give n - 1 successes and one more trial for the
  rejected one unless n reached the cap."""
  n = max(0, min(int(accepted), int(cap)))
  if n == 0:
    return 0.0, 1.0, 0.0, 0.0
  return 1.0, 1.0, float(n - 1), float(n - 1 + (n < cap))
