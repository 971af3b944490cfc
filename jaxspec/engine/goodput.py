"""The goodput K policy (SmartSpec, Liu et al. 2024; TurboSpec; its α and β estimates in
`acceptance.py`): K per round maximising the expected tokens per second of the batch, from
per-request α estimates and measured round costs (host side, numpy). The interface it implements is
`jaxspec.engine.k_policy.KPolicy`.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np

from jaxspec.checks import check_int, check_real, is_int_in
from jaxspec.engine import holds, makespan
from jaxspec.engine.acceptance import AlphaTracker, round_observation
from jaxspec.engine.calibration import Calibration
from jaxspec.engine.makespan import round_tokens
from jaxspec.engine.k_policy import KPolicy
from jaxspec.engine.live_costs import LiveCosts, checked_table


class GoodputK(KPolicy):
  """K = argmax_K Σ_i E[tokens_i | α_i, β_i, K] / t(K) over `candidates` (SmartSpec, Liu et al.
  2024; TurboSpec), every row capped at K; α_i, β_i the request's first- and later-proposal
  acceptance estimates (`AlphaTracker`), β_i spread over the positions j = 2..K_max + 1 by
  the global `AlphaTracker.profile` (retrieval accepts the second proposal far less often than
  the ones past it, code the ones past the second less often: one β misprices K = 2 against
  K = 1 on the first and K >= 3 on the second).

  t(K) = d(K) + h(K), plus at K >= 1 one-time costs spread over the rounds they serve (see
  `goodput`): a lazy draft cache's catch-up and, after K = 0 rounds, the slower first rounds of
  a K >= 1 stretch (`once_s`), and the extra prefill calls that breaking the lock-step of
  requests that would finish together costs (`split_s`, `speculation.split_cost`). Rows with
  room 0 (finished) are left out. d(K) is the wall time of the device call of one
  decode round at K for the round's row bucket (`KPolicy.rows`; the call computes all its rows,
  idle ones included, so d depends on K and the bucket, not on how many rows are busy; the
  batch enters through Σ_i: more rows gain more tokens from the same round), h(K) the host
  seconds per round around it (scheduling, tables, proposals, emitting): both kept by
  `LiveCosts` (`live`) from the start-up tables and the live rounds (`round_timing`). Without h
  a K > 0 round looks relatively dearer than it is when host work is a large part of a round;
  a K >= 1 round's host work is the larger (it scores K more often, observes every row, emits
  more tokens). E_i is capped by what request i may still emit (`KPolicy.rooms`).

  Once nothing waits (`KPolicy.queued` 0, with rooms known), a slot freed early stays empty and
  the batch's remaining time is its slowest request's: K is then chosen by
  Σ_i room_i / (rounds(K) t(K) + [K >= 1] once_s), rounds(K) the expected rounds until every
  request has finished (`jaxspec.engine.makespan.rounds_to_finish`). While requests wait and
  the engine gives their decode tokens (`KPolicy.queue_rooms`, `KPolicy.slots`), the horizon
  takes them in too: (Σ_i room_i + Σ_q room_q) / (rounds(K) t(K) + [K >= 1] (once_s +
  split_s)), rounds(K) from `makespan.rounds_with_queue` (a freed slot idles one round per
  admission unless the batch finishes together, as at K = 0; the last wave's tail), t(K) the
  full batch's; each of the W = (queued - q) / slots waves queued past the listed q requests
  adds the listed wave's tokens, its share of the time and, at K >= 1, split_s again (finishes
  apart stay apart, so every later admission is prefilled alone); a per-round score overrates
  K >= 1 at large B (docs/adaptive_k.md). With one slot the queue is left out: each queued
  request gets its own K when it runs (`pricing` says which of the three a scoring used).

  A choice of K = 0 is held (its scoring skipped) for up to `HOLD_ROUNDS` rounds (4x as many
  when it led the best K >= 1 by more than `CLEAR_LEAD`, 10 %) while no new observation came and
  the requests, row bucket, queue, cost ratios (K >= 1 / K = 0 within ~10 %, their level within
  ~35 %) and host time (up by < 5 % of a round) stand; the requests' confidences move every
  K = 0 round and are read again when the hold ends. A choice of K >= 1 is held for up to
  `SPEC_HOLD_ROUNDS` rounds (`ONE_SLOT_HOLD_ROUNDS` with one slot) of the same batch, queue and
  costs while no room falls below K + 2, and `repeat` keeps it through finishes, admissions
  from the queue (more than one slot), rooms below K + 2 while one stays above, and equal rooms
  when the choice priced a split (`_repeat_spec`). A scoring costs 0.1-0.6 ms of host time on
  the development CPU, 3-15 % of a 4-8 ms round at B = 1-4 if it ran every round.

  Args:
    tracker: the `AlphaTracker` (default: a new one).
    margin: a larger K must beat the smallest near-best K by more than this fraction of goodput
      (ties and noise-level gains go to the smaller, cheaper K).
    candidates: the K values considered (default 0..K_max; each is one compiled step).
    costs: the cost table d(K) {K: seconds} of a full round, if known (else the engine measures
      it, per row bucket too); a known table serves every bucket.
    window: live rounds per group (K = 0; K >= 1) whose medians scale d(K) and give h(K)
      (>= 1; `LiveCosts`: pseudo-rounds while a group has few, staleness after long at K = 0).
    probe_margin: in [0, 1]; while it chooses K = 0, a lazy draft cache probes (scores the
      draft on what the target drew) only if α and β estimates higher by this much plus two
      standard errors of the global α would choose K >= 1 (`worth_probing`): far from the
      threshold, or once probes have pinned α down, a probe could not change the choice.
    stay_margin: after a round at K >= 1 (the draft cache in sync), K = 0 must beat the best
      K >= 1 by more than this fraction of goodput: a request's α estimate swings with a few
      rounds, and each return to K >= 1 after K = 0 rounds pays a catch-up.
    spec_margin: every K >= 1 must beat K = 0 by more than this fraction of goodput (its score
      is divided by 1 + spec_margin before `margin` and `stay_margin` apply): speculating costs
      what the model leaves out (lone admissions' prefills, idle rows at a wave's end,
      catch-ups, more scorings) and measured speedups sit below the model's
      (`experiments.batching_report`), so near the threshold K = 0 cannot lose much.
    cold_rounds: the engine's first live rounds of each group left out of d(K) and h(K)
      (`LiveCosts`; priced in, the cold first K >= 1 round kept K >= 1 out, probes too, at B = 1).
    switch_rounds: the first rounds of each K >= 1 stretch after K = 0 rounds left out of d(K)
      and h(K) (`LiveCosts`: slower than the later ones; `once_s` prices their excess once).
    use_confidence: move a request's α and β priors, and the queue's, by the target's
      confidence on its recent tokens, weighed by how many (`AlphaTracker.confidence_shift`,
      `confidence_weight`; `KPolicy.confidences`, `KPolicy.confidence_tokens`).
    spec_confidence: count the tokens of rounds at K >= 1 in those confidences too
      (`KPolicy.wants_spec_confidences`; off: it cost json 3-6 % at B = 2, docs/adaptive_k.md).
    calibrate: multiply every K >= 1's score, in choices and in `worth_probing`'s what-ifs, by
      `calibration.factor`, the K >= 1 rounds' realized over predicted tokens per second so far
      (`jaxspec.engine.calibration`; an experiment, off: no gain in the batching study,
      docs/adaptive_k.md, *Calibration*).
  Raises:
    ValueError: a candidate outside [0, K_max], a cost table that is not a mapping, misses a
      candidate or has a non-positive time, a tracker that is not an `AlphaTracker`, margin,
      stay_margin or spec_margin < 0, window < 1, cold_rounds or switch_rounds not an int >= 0;
      in a choice, sync_s or split_s not a finite number >= 0, slots not an int >= 1 (or
      None), or a score not finite and >= 0.
  """

  def __init__(self, tracker: Optional[AlphaTracker] = None, margin: float = 0.01,
               candidates: Optional[Sequence[int]] = None,
               costs: Optional[Mapping[int, float]] = None, window: int = 16,
               probe_margin: float = 0.05, stay_margin: float = 0.05,
               spec_margin: float = 0.05, cold_rounds: int = 1, switch_rounds: int = 2,
               use_confidence: bool = True, spec_confidence: bool = False,
               calibrate: bool = False):
    super().__init__()
    margin = check_real('margin', margin, 0.0, math.inf, high_open=True)
    self.probe_margin = check_real('probe_margin', probe_margin, 0.0, 1.0)
    window = check_int('window', window, 1)
    cold_rounds = check_int('cold_rounds', cold_rounds, 0)
    switch_rounds = check_int('switch_rounds', switch_rounds, 0)
    if tracker is not None and not isinstance(tracker, AlphaTracker):
      raise ValueError(f'tracker must be an AlphaTracker, got {tracker!r}')
    if costs is not None and not isinstance(costs, Mapping):
      raise ValueError(f'costs must be a {{K: seconds}} mapping, got {costs!r}')
    self.live = LiveCosts(window, cold_rounds, switch_rounds)   # d(K) and h(K)
    self.tracker = AlphaTracker() if tracker is None else tracker
    self.margin = margin
    self._candidates = None if candidates is None else tuple(sorted(set(candidates)))
    self._pending_costs = costs
    self._version = 0                       # bumped by every new observation or cost table
    self._held = None                       # the `holds.Hold` of a K = 0 choice still valid
    self._spec_held = None                  # the `holds.Hold` of a K >= 1 choice
    self._last_k = 0                        # the previous choice
    self._profile = None                    # `AlphaTracker.profile` as `_alphas` last read it
    self._x, self._fit_x = {}, {}           # {id: (x, tokens)} priced, {id: x} fitted (`_alphas`)
    self._use_confidence, self._spec_confidence = bool(use_confidence), bool(spec_confidence)
    self.stay_margin = check_real('stay_margin', stay_margin, 0.0, math.inf, high_open=True)
    self.spec_margin = check_real('spec_margin', spec_margin, 0.0, math.inf, high_open=True)
    self.calibration = Calibration() if calibrate else None

  wants_confidences = property(lambda self: self._use_confidence)      # fixed: the latter picks
  wants_spec_confidences = property(lambda self: self._spec_confidence)  # what warm_up compiles

  needs_costs = property(lambda self: not self.live.idle)   # no cost table yet (`set_costs`)

  @property
  def costs(self) -> Optional[dict]:
    """The fitted d(K) {K: seconds} of a full round (None before `set_costs`)."""
    return self.live.table(None) if self.live.idle else None

  host = property(lambda self: self.live.host)    # h(K): `HostSeconds` (`LiveCosts.host`)

  def setup(self, k_max: int) -> None:
    super().setup(k_max)
    if self._candidates is not None:
      bad = [k for k in self._candidates if not is_int_in(k, 0, k_max)]
      if bad or not self._candidates:
        raise ValueError(f'GoodputK candidates {self._candidates} must be ints in [0, {k_max}]')
      self._candidates = tuple(int(k) for k in self._candidates)
    if self._pending_costs is not None:
      self.set_costs(self._pending_costs)

  @property
  def candidates(self) -> tuple:
    return self._candidates if self._candidates is not None else tuple(range(self.k_max + 1))

  def set_costs(self, costs, by_rows=None):
    """Take the cost table {K: seconds} of a full round and optionally one per row bucket
    {rows: {K: seconds}}, each made non-decreasing in K (`nondecreasing`: a round at a larger K
    does strictly more work, so a measured dip is timing noise).

    Raises:
      ValueError: a candidate K missing, a time that is not > 0.
    """
    tables = {None: costs, **(by_rows or {})}
    self.live.set_tables({rows: checked_table(table, self.candidates)
                          for rows, table in tables.items()})
    self._version += 1

  def goodput(self, alphas: Sequence[float], k: int,
              rooms: Optional[Sequence[int]] = None,
              later: Optional[Sequence] = None) -> float:
    """The per-round score Σ_i E_i / (d(K) + h + [K >= 1] (once_s / R + split_s / R')), tokens
    per second: E_i = E[tokens | α_i, β_i, min(K, room_i - 1)] (`expected_tokens`; a round emits
    at most room_i tokens, none at room 0; uncapped without rooms), R = max(1, Σ_i room_i /
    Σ_i E_i), the rounds a switch serves (1 without rooms), and R' = max(1, (Σ_i room_i +
    split_tokens) / Σ_i E_i), the rounds until the successors a split admits are done too.
    `later`: each request's β (`expected_tokens`; None: β = α).

    Raises:
      ValueError: rooms or later not one per α; sync_s, split_s or slots bad (`_check_inputs`).
    """
    self._check_inputs()
    for name, values in (('rooms', rooms), ('later', later)):
      if values is not None and len(values) != len(alphas):
        raise ValueError(f'goodput needs one {name} value per α: got {len(values)} for '
                         f'{len(alphas)}')
    tokens = round_tokens(alphas, alphas if later is None else later, rooms, k)[k]
    return self._per_second(tokens, k, rooms)

  @property
  def once_s(self) -> float:
    """Seconds a round at K >= 1 pays once, besides a split: the catch-up (`sync_s`) and, after
    K = 0 rounds, the first rounds' excess over steady ones (`LiveCosts.switch_s`)."""
    return self.sync_s + (self.live.switch_s if self.live.zero_rounds else 0.0)

  def _per_second(self, tokens: float, k: int, rooms) -> float:
    seconds = self.live.table(self.rows)[k] + self.host.of(k)
    once = self.once_s if k >= 1 else 0.0
    if k >= 1 and tokens > 0 and (once > 0 or self.split_s > 0):
      left = sum(rooms) if rooms else 0.0    # tokens the decoding requests may still emit
      seconds += once / max(1.0, left / tokens)
      seconds += self.split_s / max(1.0, (left + self.split_tokens) / tokens)
    return tokens / seconds

  def _scores(self, alphas: np.ndarray, later: np.ndarray, raise_by: float = 0.0) -> dict:
    """{K: goodput} over `candidates` for acceptance estimates alphas [n] (first proposal) and
    later [n, K_max] (proposals 2, 3, ...: `_alphas`); the queue at
    `AlphaTracker.queue_estimates` raised by `raise_by` (as `worth_probing` raises the rows')."""
    self._check_inputs()
    rooms, priced, keep = self.pricing(len(alphas))
    if len(keep) < len(alphas):                 # finished rows: no tokens, no rounds
      if not keep:
        return {k: 0.0 for k in self.candidates}
      alphas, later = alphas[keep], later[keep]
    if priced == 'finish':
      # Nothing waits: the batch's remaining time is its slowest request's (`makespan`).
      rounds = makespan.rounds_to_finish(alphas, rooms, self.k_max, later)
      table, once = self.live.table(self.rows), self.once_s
      return {k: sum(rooms) / (rounds[k] * (table[k] + self.host.of(k)) + (once if k else 0.0))
              for k in self.candidates}
    if priced == 'queue':
      # Requests wait: the time until they are done too (`makespan.rounds_with_queue`); the
      # rounds run the full batch; K >= 1 pays `once_s` once, the split once per wave.
      queue = self.queue_rooms
      profile = self.tracker.profile(self.k_max) if self._profile is None else self._profile
      xs, ns = zip(*self._x.values()) if self._x else ((), ())
      queue_alpha, queue_later = self.tracker.queue_estimates(xs, profile, raise_by, ns)
      rounds = makespan.rounds_with_queue(alphas, rooms, self.k_max, later, queue, queue_alpha,
                                          queue_later, self.slots)
      table = self.live.table(None)
      tokens, wave = sum(rooms) + sum(queue), sum(queue)
      # Waves admitted after the horizon's (`later_waves`, each like the listed one: its tokens,
      # its share of the rounds) pay the split again: finishes apart at K >= 1 stay apart and
      # every admission is prefilled alone (B = 2: 7 prefill calls for 8 requests, K = 0's 4).
      later_waves = max(0, (self.queued or 0) - len(queue)) / self.slots if wave else 0.0
      scores, once = {}, self.once_s
      for k in self.candidates:
        seconds = rounds[k] * (table[k] + self.host.of(k))
        split = self.split_s if k else 0.0
        scores[k] = (tokens + later_waves * wave) / (
            seconds + (once + split if k else 0.0) +
            later_waves * (seconds * wave / tokens + split))
      return scores
    # Per round (one slot, or no queue inputs), as `goodput` prices one K.
    totals = round_tokens(alphas.tolist(), later.tolist(), rooms, self.k_max)
    return {k: self._per_second(totals[k], k, rooms) for k in self.candidates}

  def pricing(self, n: int) -> tuple:
    """(rooms, how, keep): how `_scores` prices n requests (the class doc). keep: the indices
    of the rows it scores (all but those with room < 1, which have finished); rooms: theirs (a
    list; None unless one per request); how: 'finish', 'queue' (the full batch's table), 'round'."""
    rooms = list(self.rooms) if self.rooms is not None and len(self.rooms) == n else None
    keep = list(range(n)) if rooms is None else [i for i, room in enumerate(rooms) if room >= 1]
    rooms = None if rooms is None else [rooms[i] for i in keep]
    if rooms is not None and self.queued == 0:
      return rooms, 'finish', keep
    waits = rooms is not None and self.queue_rooms is not None and 1 < (self.slots or 0) and \
        len(rooms) <= self.slots
    return rooms, 'queue' if waits else 'round', keep

  def _scored(self, alphas: np.ndarray, later: np.ndarray, raise_by: float = 0.0) -> dict:
    """`_scores` with every K >= 1's divided by 1 + `spec_margin` and multiplied by the
    calibration's factor (what a choice compares)."""
    hurdle = (1.0 + self.spec_margin) / (self.calibration.factor if self.calibration else 1.0)
    return {k: g / hurdle if k else g for k, g in self._scores(alphas, later, raise_by).items()}

  def _pick(self, scores: dict) -> int:
    if not all(0.0 <= g < math.inf for g in scores.values()):      # NaN fails too
      raise ValueError(f'GoodputK scores {scores} must be finite and >= 0: check the cost '
                       f'table and sync_s={self.sync_s}, split_s={self.split_s}')
    best = max(scores.values())
    return min(k for k, g in scores.items() if g * (1 + self.margin) >= best)

  def _alphas(self, request_ids, confident: bool = True) -> tuple:
    """`AlphaTracker.estimates` of the requests at their `KPolicy.confidences` (unless
    `use_confidence` is off, or not `confident`), weighed by their `confidence_tokens`; keeps
    the profile for `observe` and the confidences (if `confident`) for the queue's pricing and,
    those of `FIT_TOKENS` tokens or more, for `observe`'s fit: a noisy x flattens a fitted slope
    (errors in variables), and a request at K >= 1 from its admission would add every round's
    observation at its first token's."""
    ids = request_ids or [None]
    xs = self.confidences if confident and self.wants_confidences and \
        self.confidences is not None and len(self.confidences) == len(ids) else [None] * len(ids)
    ns = list(self.confidence_tokens) if self.confidence_tokens is not None and \
        len(self.confidence_tokens) == len(ids) else None
    if confident:
      self._x = {i: (x, n) for i, x, n in zip(ids, xs, ns or [None] * len(ids))}
      self._fit_x = {i: x for i, x, n in zip(ids, xs, ns or [self.FIT_TOKENS] * len(ids))
                     if n >= self.FIT_TOKENS}
    alphas, later, self._profile = self.tracker.estimates(ids, xs, self.k_max, ns)
    return alphas, later

  def choose(self, request_ids):
    if not self.live.idle:
      raise ValueError('GoodputK has no cost table: call set_costs (the engine does at warm_up)')
    # The holds of the class doc: drift and h against their values at the choice, not binned (a
    # value near a bin edge broke most holds); ratios with the table's prior rounds included.
    ratios = self.live.group_ratios(self.rows)     # the round's row bucket's
    queue = (self.queued, self.slots,
             None if self.queue_rooms is None else tuple(self.queue_rooms))
    host = self.host.of(0) / self.live.unit_s()
    spec = self._spec_held
    if spec is not None and spec.steady(ratios) and spec.rounds < spec.limit and \
        spec.key == holds.spec_key(self, request_ids, queue, spec.k):
      # A K >= 1 choice is kept for up to `_spec_hold_rounds` rounds of the same batch, queue,
      # costs, live cost ratios and rooms as far as they cap K + 1 (a shrinking room below
      # that would change what K and K + 1 gain; one above it only lowers what larger K gain):
      # the estimates move by one round's observations (a scoring's cost: the class doc).
      spec.rounds += 1
      return spec.k, [spec.k] * len(request_ids)
    inputs = holds.Key(tuple(request_ids), queue, self.rows, version=self._version)
    left = sum(self.rooms) if self.rooms is not None else math.inf
    held = self._held
    if held is not None and held.key == inputs and self._k0_stands(held, ratios, host) and \
        left <= held.left and self.sync_s >= held.sync_s and self.split_s >= held.split_s:
      held.rounds += 1
      return 0, [0] * len(request_ids)
    alphas, later = self._alphas(request_ids)
    scores = self._scored(alphas, later)
    k = self._pick(scores)
    if k == 0 and self._last_k and len(scores) > 1 and \
        scores[0] < max(g for c, g in scores.items() if c) * (1 + self.stay_margin):
      k = self._pick({c: g for c, g in scores.items() if c})   # stay: the draft is in sync
    if k and self.calibration is not None:     # what each round at K should deliver
      rooms, _, keep = self.pricing(len(alphas))
      tokens = round_tokens(alphas[keep].tolist(), later[keep].tolist(), rooms, k)[k]
      self.calibration.expect(tokens, self.live.table(self.rows)[k] + self.host.of(k),
                              self.once_s)
    self._last_k = k
    self._held = None
    self._spec_held = holds.Hold(holds.spec_key(self, request_ids, queue, k), ratios, k=k,
                                 limit=self._spec_hold_rounds()) if k else None
    if k == 0:       # a clear lead holds 4x longer
      best = max((g for c, g in scores.items() if c), default=0.0)
      limit = self.HOLD_ROUNDS * (4 if scores[0] >= best * (1 + self.CLEAR_LEAD) else 1)
      self._held = holds.Hold(inputs, ratios, limit=limit, host=host, left=left,
                              sync_s=self.sync_s, split_s=self.split_s)
    return k, [k] * len(request_ids)

  def _check_inputs(self) -> None:
    """Refuse, before any scoring (`_scores`, `goodput`; so `choose` and `worth_probing` too),
    what the engine's setters would never give: seconds that are not finite and >= 0 (an
    infinite split made 0 x inf a NaN score), slots that are not an int >= 1."""
    for name in ('sync_s', 'split_s'):
      check_real(f'GoodputK {name} (seconds)', getattr(self, name), 0.0, math.inf, high_open=True)
    if self.slots is not None and not is_int_in(self.slots, 1, math.inf):
      raise ValueError(f'GoodputK slots must be an int >= 1 or None, got {self.slots!r}')

  def repeat(self, request_ids, rows, queued, rooms=None):
    """`KPolicy.repeat`: the held K = 0 or K >= 1 choice while its inputs stand, else None
    (`holds.repeat`)."""
    return holds.repeat(self, request_ids, rows, queued, rooms)

  def _k0_stands(self, held, ratios, host) -> bool:   # rounds left, steady ratios, no rise of h
    return held.rounds < held.limit and held.steady(ratios) and host <= held.host + self.HOST_RISE

  def _spec_hold_rounds(self) -> int:
    """`SPEC_HOLD_ROUNDS`, or `ONE_SLOT_HOLD_ROUNDS` with one slot (cheap scorings, short lives)."""
    return self.ONE_SLOT_HOLD_ROUNDS if self.slots == 1 else self.SPEC_HOLD_ROUNDS

  HOLD_ROUNDS, CLEAR_LEAD = 8, 0.1
  HOST_RISE = 0.05   # rise of h, in start-up K = 0 rounds, that ends a K = 0 hold
  SPEC_HOLD_ROUNDS, ONE_SLOT_HOLD_ROUNDS = 8, 2
  CHECK_EVERY = 4    # rounds of a repeated K = 0 hold between checks of its costs (`repeat`)
  COLD_TRIALS = 12   # global first-proposal trials (4 the default prior's) to be warm (`cold`)
  FIT_TOKENS = AlphaTracker.FIT_TOKENS   # a request's confidence enters the fit from this many
  PRIOR_ROUNDS, STALE_ROUNDS = LiveCosts.PRIOR_ROUNDS, LiveCosts.STALE_ROUNDS

  @property
  def cold(self) -> bool:
    """`KPolicy.cold`: the global first α rests on < `COLD_TRIALS` trials, the prior's too."""
    return self.tracker.global_trials < self.COLD_TRIALS

  def worth_probing(self, request_ids) -> bool:
    """Whether α and β estimates higher by `probe_margin` + 2 sd would choose some K >= 1, sd =
    sqrt(g (1 - g) / n) the standard error of the global estimate g over its n (decayed)
    trials: few observations leave the estimates loose and a probe worth its cost. Raised are
    the running requests' estimates and the global ones the queue is priced at (at B = 2 the
    queue holds most of the horizon's tokens), each moved by its confidence only upward: a
    slope fitted wrong must not stop the probes that would correct it. True while `cold`."""
    if not self.live.idle or self.cold:
      return True
    g, n = self.tracker.global_alpha, self.tracker.global_trials
    up = self.probe_margin + 2 * math.sqrt(g * (1 - g) / max(n, 1.0))    # + 2 sd
    plain = self._alphas(request_ids, confident=False)
    alphas, later = (np.maximum(a, b) for a, b in zip(self._alphas(request_ids), plain))
    return self._pick(self._scored(np.minimum(alphas + up, 1.0),
                                   np.minimum(later + up, 1.0), raise_by=up)) >= 1

  def observe(self, request_id, k, accepted, successes, trials):
    if trials <= 0:
      return
    self._version += 1
    if k >= 1:       # a speculative round: the first proposal and the later ones apart
      # The later trials sit at positions 2..min(n + 1, K): their profile values weigh the
      # request's `shape` (the profile of its last choice: one per round, not per row).
      n = max(0, min(int(accepted), int(k)))
      weight = sum(self._profile[:min(n + 1, k) - 1]) if self._profile is not None else None
      self.tracker.observe(request_id, *round_observation(k, accepted), later_weight=weight,
                           confidence=self._fit_x.get(request_id))
    else:            # a K = 0 probe scores one-token drafts: first-proposal observations
      self.tracker.observe(request_id, successes, trials, confidence=self._fit_x.get(request_id))
    self.tracker.observe_depth(k, accepted)      # positions j >= 2 (K = 0, 1: fading only)

  def observe_probe(self, request_id, successes, trials, later_successes, later_trials,
                    confidence=None):
    """`KPolicy.observe_probe`: one observation of both kinds (later trials at position 2)."""
    if trials <= 0:
      return
    self._version += 1
    weight = later_trials * self._profile[0] if self._profile is not None else None
    self.tracker.observe(request_id, successes, trials, later_successes, later_trials, weight,
                         confidence if self.wants_confidences else None)
    self.tracker.observe_depth(0, 0)

  def forget(self, request_id):
    self.tracker.forget(request_id)

  def round_timing(self, k, device_s, host_s):
    """`KPolicy.round_timing`: counted by `LiveCosts.add` (the first `cold_rounds` of each kind
    left out: `worth_probing` prices with the same costs, so cold ones also stopped probes).

    Raises:
      ValueError: a time that is not a finite number >= 0.
    """
    self.live.add(k, self.rows, device_s, host_s)
    if self.calibration is not None:
      self.calibration.round(k, device_s + host_s)

  def round_outcome(self, tokens, catch_up_s):
    """`KPolicy.round_outcome`: kept for the calibration (`calibrate`), if on."""
    if self.calibration is not None:
      self.calibration.outcome(tokens, catch_up_s)
