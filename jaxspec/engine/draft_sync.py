"""A lazily kept draft cache: K = 0 rounds run the target alone, and the draft catches up only
when it is needed (host side; the device step is `spec_steps.draft_catch_up`).

Why: with a draft model and an adaptive K policy, a round at K = 0 used to run one draft step
beside the target step, only to keep the draft's cache in sync. At large batch sizes, where
K = 0 is the right choice, that made "adaptive" cost more than plain continuous batching, and it
skewed the policy's cost ratio t(K) / t(0) toward speculating (t(0) held a draft step the
baseline never pays). Now:

- Prefill writes the target's cache only, unless the last decode round ran at K >= 1 (`eager`):
  while the engine speculates, an admitted request's prompt goes through the draft in the same
  call as the target's, not in a catch-up call of its own before its first round. With
  `fill_prefill` on (off by default) it does so at K = 0 too while a K >= 1 choice is within
  reach (`fills_prefill`): on the development CPU the draft adds ~1.2 ms to a 15-45 ms prefill
  call of 1-4 rows of 64 tokens, against 1.6-5 ms a chunk for catching the prompts up later, so
  a probe or a switch to K >= 1 then pays only for the tokens decoded since. At B = 4 that moved
  where goodput settles (more rounds at K >= 1 on every workload) without a measured gain over
  the default (docs/adaptive_k.md, *The study's sweeps*).
- Each request keeps `draft_computed`, the tokens of its context the draft cache holds (0 at
  every admission: after a preemption, or pages shared by the prefix cache or brought back from
  the host tier, the draft's half of a page need not hold anything).
- Before a round at K >= 1, every decoding request whose draft lags is caught up: chunks of
  `chunk_size` tokens through the draft alone, rows bucketed like prefill calls, and a pass
  whose rows each lag at most `short_width` tokens (a probe a few rounds after the last, a
  switch after a short K = 0 stretch) in a narrower call. The K policy sees the seconds this
  will take (`KPolicy.sync_s`) before it chooses.
- A catch-up scores the draft on the last `observe_tokens` tokens of each request it caught up
  that the target drew at K = 0 (it knows p of each): s = min(1, q(x) / p(x)), E[s] = α; pairs of
  consecutive scored tokens tell the policy the later proposals' acceptance β too
  (`KPolicy.observe_probe`: Σ s_j s_{j+1} over Σ s_j, `spec_steps.draft_catch_up`). Without them
  β stayed at its prior while the policy ran K = 0, which is where it must decide whether to
  speculate: json accepts a proposal after an accepted one far more often than the first.
- While the policy stays at K = 0, and only when a better α estimate could change its choice
  (`KPolicy.worth_probing`; a probe that could not is skipped as if taken, and the gap before
  the next question doubles, up to `QUIET` x `probe_every` rounds), a probe catches up
  `probe_rows` requests (the least behind) and scores them: first with gaps of 1, 2, 4, ...
  K = 0 rounds between probes (the gap restarts at 1 after a round at K >= 1, so a switch to
  K = 0 on a noisy estimate is re-checked soon), then at most every `probe_every` rounds and,
  once the policy is no longer `cold` (`KPolicy.cold`), only when the probe's estimated cost is
  at most `probe_budget` of the time of the K = 0 rounds since the last catch-up (both estimated
  from the measured call and round costs), so the α estimates keep moving while it
  does not speculate at a bounded price. Catching up every
  request every round is what the draft step of an eager K = 0 round did; it costs about as
  much in the draft however it is batched.

- Once the policy has chosen K = 0 for `OVERLAP_AFTER` rounds in a row, a round runs before the
  policy is asked about it (`overlaps`): the K = 0 device call is dispatched first and the
  policy chooses while it runs (JAX dispatches asynchronously), so its host work (a held choice
  checked, or a full scoring of the batch and queue) hides behind the device call instead of
  adding to the round, as vLLM's asynchronous scheduling and SGLang's overlap scheduler hide
  their schedulers' work. A choice of K >= 1 made so is not run (the round is a plain K = 0
  round, whose tokens stand at any K): the next round asks the policy first, with that round's
  rooms and catch-up (goodput repeats its held choice), so speculation starts a round late.
  Rounds with a probe due, or with a request new to the batch, choose first as before.

After a round at K >= 1 the draft holds what the target holds (the invariant of
`spec_steps.model_step`).
"""

from __future__ import annotations

import time

import numpy as np

from jaxspec.engine import device, spec_steps, timing
from jaxspec.engine.acceptance import AlphaTracker
from jaxspec.engine.live_costs import LiveRatio
from jaxspec.engine import rows as rows_lib


class DraftSync:
  """The engine's lazy draft cache (see the module doc).

  Args:
    engine: the `Engine` (its draft, caches, chunk size, prefill row buckets, policy).
    drafter: the engine's lazy `ModelDrafter`, whose settings it follows: probe_every (K = 0
      rounds between two probes at least once the early, doubling ones are done; None: never
      probe), probe_rows (requests a probe catches up), probe_budget (the fraction of K = 0
      round time probes may take; None: no bound), observe_tokens (M, tokens per request a
      catch-up scores at most), fill_prefill and overlap_choice (the attributes below).
  Attributes:
    costs: {rows: seconds} one catch-up call of `chunk_size` tokens per row bucket (`measure`;
      empty before); short_costs: the same for calls of `short_width` tokens (empty when
      chunk_size <= SHORT_WIDTH).
    short_width: tokens per row of a short catch-up call: a chunk pass whose rows each have at
      most this many tokens left runs this narrower call (once `measure` compiled it): a probe
      of a request some rounds behind, or a switch to K >= 1 after a short K = 0 stretch, pays
      ~0.6x a full call (1.6 against 2.7 ms for one row of the batching study's 64-token chunks
      on the development CPU).
    rounds_since: K = 0 rounds since the draft last caught up.
    num_calls: catch-up calls run so far; seconds: their wall time (host and device).
    round_s: seconds of the catch-up before the coming round at K >= 1 (`before_round`; 0 for
      a round without one: probes are not in it; reset by `after_round`).
    live: the catch-ups' wall time over their estimate from `costs` (a `LiveRatio` over the
      last RATIO_WINDOW); live_ratio: its value.
    eager: whether the last decode round ran at K >= 1 (prefill chunks then fill the draft's
      cache too, `fills_prefill`: a request admitted while the engine speculates would need its
      prompt caught up before its first round, in a call of its own).
    overlap_choice: whether K = 0 rounds may run while the policy chooses (`overlaps`; the
      drafter's, default True; False: every round's choice comes first).
    fill_prefill: whether prefill fills the draft at K = 0 too while K >= 1 is within reach
      (`fills_prefill`; the drafter's, default False: only while the engine speculates,
      `eager`).
    probe_new: whether probes go to requests the draft has not scored (`draft_computed` 0)
      first, without asking `worth_probing`, and a request joining the batch unscored cuts the
      gap before the next probe back to `probe_every` (the drafter's, default False: probes
      take the least behind, each asked about). Its case: after a stretch of low α the gap grows
      to `QUIET` x `probe_every` rounds and the global α's error, `worth_probing`'s margin, is
      small, so requests of another workload arriving at K = 0 were not probed for whole B = 4
      passes (docs/adaptive_k.md, *The study's sweeps*). The budget still bounds the probes.
      Off: in two B = 4 A/Bs it probed them and gained nothing measurable (the same section).
  """

  RATIO_WINDOW = 8
  SHORT_WIDTH = 16

  def __init__(self, engine, drafter):
    self.engine = engine
    self.short_width = min(self.SHORT_WIDTH, engine.chunk_size)
    self.short_costs: dict = {}
    self._short_measured = None  # the short_width that `measure` compiled and timed
    self.probe_every, self.probe_rows = drafter.probe_every, drafter.probe_rows
    self.probe_budget, self.observe_tokens = drafter.probe_budget, drafter.observe_tokens
    self.costs: dict = {}
    self.rounds_since = 0
    self.backoff = 1             # K = 0 rounds before the next early probe (doubles)
    self.zero_s = 0.0            # estimated seconds of the K = 0 rounds since the last catch-up
    self.num_calls = 0
    self.seconds = self.round_s = 0.0
    self.live = LiveRatio(self.RATIO_WINDOW)
    self.eager = False           # the last decode round ran at K >= 1: prefill the draft too
    self._forced = False         # every request of the coming round has one token left
    self._afford_s = 0.0         # zero_s at which the last probe the budget refused fits it
    self._due = None             # (decodes, probe) of this round's `probe_due`
    self.overlap_choice, self.fill_prefill = drafter.overlap_choice, drafter.fill_prefill
    self.probe_new = drafter.probe_new
    self._k0_rounds = 0          # rounds in a row run at K = 0 as the policy chose for them
    self._batch = frozenset()    # the request ids of the last decode round
    self.choice_error = None     # an exception of a choice made while a round ran (`overlaps`)

  QUIET = 8   # the longest gap between two questions to the policy, in probe_every units
  # K = 0 rounds in a row before a round may run while the policy chooses (`overlaps`): a short
  # stretch at K = 0 often ends at the next choice, which would then start a round late.
  OVERLAP_AFTER = 4

  @property
  def live_ratio(self) -> float:
    return self.live.value

  @property
  def fills_prefill(self) -> bool:
    """Whether this step's prefill call writes the draft's cache too: while the engine
    speculates (`eager`), or while K >= 1 is within reach: `fill_prefill` on, probes on, and the
    policy `cold` or the gap between probes not grown past `probe_every` by answers of
    `worth_probing` that no probe could change the choice (the early gaps 1, 2, 4, ... double on
    a no as on a probe: it takes a no once the gap is `probe_every`, or several in a row before
    it is, to turn filling off)."""
    if self.eager:
      return True
    policy = self.engine.policy
    return self.fill_prefill and self.probe_every is not None and policy is not None and (
        policy.cold or self.backoff <= self.probe_every)

  # ------------------------------------------------------------ round hooks

  def probe_due(self, decodes) -> bool:
    """Whether `before_choice` would ask the policy about a probe this round (`_probe`; kept
    for `before_choice` of the same `decodes`)."""
    self._due = decodes, self._probe(decodes)
    return bool(self._due[1])

  def overlaps(self, decodes) -> bool:
    """Whether this round runs at K = 0 with the policy choosing while its device call runs
    (see the module doc): `overlap_choice` is on, the last `OVERLAP_AFTER` rounds ran at K = 0
    as the policy chose, no request is new to the batch (its first round is priced first), and
    no probe is due (a probe comes before the choice it informs)."""
    return self.overlap_choice and self._k0_rounds >= self.OVERLAP_AFTER and \
        all(r.id in self._batch for r in decodes) and not self.probe_due(decodes)

  def _probe(self, decodes) -> list:
    """The requests a probe would catch up this round (the `probe_rows` least behind of those with
    drawn tokens to score; `probe_new`: the unscored first), if one is due (the K = 0 rounds since
    the last catch-up reached the current gap) and affordable (an early probe, or one within
    `probe_budget`); else []. Affordability comes first: a probe the budget refuses is not worth a
    question (one scores the batch), and asking every round until the budget allows cost B = 2
    rounds ~5 % on the development CPU. A probe the budget refused is not looked for again until the
    K = 0 rounds since have cost what would have afforded it then (its lag grows meanwhile, so it
    may be refused again): looking costs a sort and a price of the batch per round. While the policy
    is `cold` (`KPolicy.cold`: its estimates rest on a few observations) no budget applies."""
    if self.probe_every is not None and self.probe_new and \
        any(r.id not in self._batch and _unscored(r) for r in decodes):
      self.backoff = min(self.backoff, self.probe_every)   # an unscored request joined
    if self.probe_every is None or self.rounds_since < self.backoff or \
        self.zero_s < self._afford_s:
      return []
    probe = sorted((r for r in _lagging(decodes) if any(r.token_p)),
                   key=lambda r: (self.probe_new and not _unscored(r),
                                  r.num_computed - r.draft_computed))[:self.probe_rows]
    if not probe or self.backoff < self.probe_every or self.probe_budget is None or \
        (self.engine.policy is not None and self.engine.policy.cold):
      return probe
    cost = self.pending_s(probe)
    if cost <= self.probe_budget * self.zero_s:
      return probe
    self._afford_s = cost / self.probe_budget
    return []

  def before_choice(self, decodes) -> float:
    """Probe when due, affordable and worth it; return the seconds a catch-up of `decodes`
    would take now (the K policy's `sync_s`: a round at K >= 1 pays it first)."""
    # Every request on its last token: any K emits just that one, so K = 0 is forced and says
    # nothing about whether the engine speculates (`after_round` keeps `eager`).
    self._forced = all(r.room <= 1 for r in decodes)
    due, self._due = self._due, None
    probe = due[1] if due is not None and due[0] is decodes else self._probe(decodes)
    policy = self.engine.policy
    unscored = self.probe_new and any(_unscored(r) for r in probe)
    if probe and policy is not None and not unscored:   # could a better α change the choice?
      policy.sync_s = self.pending_s(decodes)
      if not policy.worth_probing([r.id for r in decodes]):
        # Asked again after a gap twice as long (at most QUIET x probe_every rounds): far
        # from the threshold the answer rarely changes, and asking scores the batch.
        probe = []
        self.rounds_since = 0
        self.backoff = min(2 * self.backoff, self.QUIET * self.probe_every)
    if probe:
      early = self.backoff < self.probe_every
      self.catch_up(probe)
      self.backoff = min(2 * self.backoff, self.probe_every) if early else self.probe_every
    return self.pending_s(decodes)

  def before_round(self, decodes, k: int) -> None:
    """A round at K >= 1 needs every decoding request's draft cache complete."""
    if k >= 1:
      before = self.seconds
      self.catch_up(decodes)
      self.round_s = self.seconds - before

  def after_round(self, decodes, k: int, zero_s: float, chose_k0: bool = True) -> None:
    """Book-keeping after the round: at K >= 1 the draft wrote what the target wrote; a K = 0
    round adds its estimated seconds `zero_s` (its row bucket's t(0)) to the probe budget's base.
    A K = 0 round of requests that each had one token left leaves `eager` as it was: the
    requests it admits next start as the engine was going. `chose_k0`: False when the choice
    made while a K = 0 round ran (`overlaps`) was K >= 1, or failed: the next round asks first."""
    self._k0_rounds = self._k0_rounds + 1 if k == 0 and chose_k0 else 0
    self.round_s = 0.0
    self._batch = frozenset(r.id for r in decodes)
    if k >= 1 or not self._forced:
      self.eager = k >= 1
    self._forced = False
    if k >= 1:
      for request in decodes:
        request.draft_computed = request.num_computed
      self.backoff = 1
      self._afford_s = 0.0
    else:
      self.rounds_since += 1
      self.zero_s += zero_s

  # ------------------------------------------------------------ catch-up

  def pending_s(self, decodes) -> float:
    """Estimated seconds to catch up `decodes` now: the calls `catch_up` would make, priced by
    the start-up tables (`_estimate`), times `live_ratio` (0 when none lags or before
    `measure`)."""
    return self._estimate(_lagging(decodes)) * self.live_ratio

  def _estimate(self, lagging) -> float:
    """Seconds of the catch-up calls of `lagging` by the start-up tables alone: the calls
    `catch_up` makes (groups of `prefill_rows`, each pass in the bucket of the rows still
    lagging, short where they all fit `short_width`)."""
    if not self.costs:
      return 0.0
    chunk, rows = self.engine.chunk_size, self.engine.prefill_rows
    lags = [r.num_computed - r.draft_computed for r in lagging]
    seconds = 0.0
    for i in range(0, len(lags), rows):
      group = lags[i:i + rows]
      while group:
        seconds += self._cost(len(group), max(group))
        group = [lag - chunk for lag in group if lag > chunk]
    return seconds

  def _cost(self, n: int, longest: int) -> float:
    """The table's seconds of one catch-up call of n rows whose longest has `longest` tokens."""
    bucket = _bucket(self.engine, n)
    return self.short_costs[bucket] if self._short(bucket, longest) else self.costs[bucket]

  def _short(self, bucket: int, longest: int) -> bool:
    """Whether a call of `bucket` rows, the longest with `longest` tokens to catch up, runs
    `short_width` tokens wide (only at the width `measure` compiled and timed: a short_width
    changed after warm-up runs full-width calls, not a compile at run time)."""
    return longest <= self.short_width == self._short_measured and bucket in self.short_costs

  def catch_up(self, decodes) -> None:
    """Run the draft over every lagging request's context[draft_computed:num_computed], in
    chunks, and give the policy the scores (as K = 0 observations)."""
    lagging = _lagging(decodes)
    self.rounds_since, self.zero_s, self._afford_s = 0, 0.0, 0.0
    if not lagging:     # nothing lags (every round at K >= 1 after the first): no call
      return
    start = time.perf_counter()
    estimate = self._estimate(lagging)
    rows = self.engine.prefill_rows
    for i in range(0, len(lagging), rows):
      group = lagging[i:i + rows]
      while group:
        self._call(group)
        group = [r for r in group if r.draft_computed < r.num_computed]
    spent = time.perf_counter() - start
    self.seconds += spent
    self.live.add(spent, estimate)   # host work and live pages: the table underestimates

  def _call(self, group) -> None:
    engine, m = self.engine, self.observe_tokens
    rows = _bucket(engine, len(group))
    table, lengths = device.idle_rows(rows, engine.pages_per_seq)
    longest = max(r.num_computed - r.draft_computed for r in group)
    width = self.short_width if self._short(rows, longest) else engine.chunk_size
    tokens = np.zeros((rows, width), np.int32)
    counts = np.zeros((rows,), np.int32)
    at = np.zeros((rows, m), np.int32)
    nxt = np.zeros((rows, m), np.int32)
    prob = np.zeros((rows, m), np.float32)
    top = [[] for _ in range(rows)]        # the target's top probabilities of the scored tokens
    for row, request in enumerate(group):
      start = request.draft_computed
      n = min(width, request.num_computed - start)
      context = request.context
      pages = request.handle.pages
      table[row, :len(pages)] = pages
      lengths[row] = start
      tokens[row, :n] = context[start:start + n]
      counts[row] = n
      first_output = len(request.prompt)
      for j, c in enumerate(range(max(0, n - m), n)):   # token start + c; the target drew c + 1
        position = start + c + 1 - first_output
        at[row, j] = c
        if position >= 0 and request.token_p[position] > 0:
          nxt[row, j] = context[start + c + 1]
          prob[row, j] = request.token_p[position]
          top[row].append(request.max_p[position])
    sampling = rows_lib.sampling(list(enumerate(group)), rows)
    bound = device.bind([engine.caches[1]], table, lengths)[0]
    *scores, failed, engine.caches[1] = spec_steps.draft_catch_up(
        engine.draft, engine.draft_params, bound, tokens, counts, at, nxt, prob, sampling)
    successes, trials, later_successes, later_trials, failed = device.fetch((*scores, failed))
    self.num_calls += 1
    for row, request in enumerate(group):
      request.draft_computed += int(counts[row])
      request.metrics.draft_failed += int(failed[row])       # a probe of a broken draft
      if trials[row] > 0 and engine.policy is not None:
        engine.policy.observe_probe(request.id, float(successes[row]), float(trials[row]),
                                    float(later_successes[row]), float(later_trials[row]),
                                    float(np.mean(top[row]))
                                    if len(top[row]) >= AlphaTracker.FIT_TOKENS else None)

  def measure(self, repeats: int) -> dict:
    """Compile and time one catch-up call per row bucket over idle rows (`timing.fastest`), at
    `chunk_size` tokens (`costs`) and, when narrower, at `short_width` (`short_costs`); returns
    `costs` {rows: seconds}."""
    engine, m = self.engine, self.observe_tokens

    def call_of(rows, width):
      def call():
        table, lengths = device.idle_rows(rows, engine.pages_per_seq)
        zeros = np.zeros((rows, m), np.int32)
        bound = device.bind([engine.caches[1]], table, lengths)[0]
        out = spec_steps.draft_catch_up(
            engine.draft, engine.draft_params, bound, np.zeros((rows, width), np.int32),
            np.zeros((rows,), np.int32), zeros, zeros, np.zeros((rows, m), np.float32),
            rows_lib.sampling([], rows))
        engine.caches[1] = out[-1]
        np.asarray(out[0])
      return call

    widths = sorted({engine.chunk_size, self.short_width})
    timed = timing.fastest({(rows, width): call_of(rows, width)
                            for rows in engine.prefill_buckets for width in widths}, repeats)
    for (rows, width), seconds in timed.items():
      (self.costs if width == engine.chunk_size else self.short_costs)[rows] = seconds
    if self.short_width < engine.chunk_size:
      self._short_measured = self.short_width
    return self.costs


def _unscored(request) -> bool:
  """Whether the draft has not caught up any of the request's context since its admission
  (`draft_computed` 0: no catch-up has scored it; `probe_new`)."""
  return request.draft_computed == 0


def _lagging(decodes) -> list:
  return [r for r in decodes if r.draft_computed < r.num_computed]


def _bucket(engine, n: int) -> int:
  """The smallest compiled row count holding n rows."""
  return min(b for b in engine.prefill_buckets if b >= n)
