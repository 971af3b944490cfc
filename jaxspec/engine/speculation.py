"""The engine's speculation settings: which drafter and K policy serve it (checked once), and
the K and per-row caps of each decode round (checked every round). Host side, plain Python.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
from typing import Callable, Mapping, Optional, Sequence

from jaxspec.checks import is_int_in
from jaxspec.decoding.generate import MAX_K
from jaxspec.decoding.sampling import INVALID_TOKEN
from jaxspec.decoding.speculative import proposals_in_reach
from jaxspec.engine.acceptance import AlphaTracker
from jaxspec.engine.drafters import ModelDrafter, make_drafter
from jaxspec.engine.k_policy import FixedK, KPolicy, make_policy


def setup(drafter, k_policy, *, has_draft_model: bool, k: int):
  """(Drafter or None, KPolicy or None) of an engine with speculation length k (K_max).

  Args:
    drafter: None ('model' when a draft model is given, else no speculation), 'model', 'ngram'
      or a `Drafter`; k_policy: 'fixed', 'schedule', 'goodput' or a `KPolicy` (bound to k here).
    has_draft_model: whether the engine holds a draft model; k: int >= 0 (checked by the caller).
  Returns:
    (None, None) without speculation (k = 0, no drafter).
  Raises:
    ValueError: naming the value: a drafter without k >= 1 or k without a drafter, a drafter
      that needs a draft model without one (or takes none and got one), k > MAX_K, an adaptive
      policy without speculation, a policy whose candidates are not ints in [0, k] or that is
      already bound to another engine, an unknown drafter or policy, a `ModelDrafter` whose
      lazy draft cache options (`ModelDrafter.lazy_options_set`) the engine would not use (its
      policy never chooses K = 0, e.g. a fixed K >= 1 or 'schedule', or lazy=False).
  """
  made = make_drafter(drafter, has_draft_model)
  got = f'draft={"a model" if has_draft_model else "None"}'
  if made is not None and k == 0:
    raise ValueError(f'a drafter (a draft model, or drafter=\'ngram\') speculates: it needs the '
                     f'speculation length k >= 1; got {got}, drafter={drafter!r}, k={k}')
  if made is None and k != 0:
    raise ValueError(f"k={k} >= 1 needs a drafter (a draft model, or drafter='ngram'); got "
                     f'{got}, drafter={drafter!r}, k={k}')
  if made is not None and made.uses_draft_model != has_draft_model:
    need = 'needs a' if made.uses_draft_model else 'takes no'
    raise ValueError(f'drafter={drafter!r} {need} draft model, got {got}')
  if k > MAX_K:
    raise ValueError(f'speculation length K must be an int in [1, {MAX_K}], got k={k}')
  policy = make_policy(k_policy)
  if made is None:
    if not isinstance(policy, FixedK):
      raise ValueError(f"k_policy={k_policy!r} chooses K but the engine does not speculate "
                       f"(give a draft model or drafter='ngram', and k >= 1)")
    return None, None
  unbound = policy.k_max is None
  try:
    policy.setup(k)
    bad = [c for c in policy.candidates if not is_int_in(c, 0, k)]
    if bad or not policy.candidates:
      raise ValueError(f'k_policy {policy!r} declares candidates {policy.candidates}: each must '
                       f'be an int in [0, k={k}]')
    idle = (made.lazy_options_set() if isinstance(made, ModelDrafter) and
            not keeps_lazy_draft(made, policy) else [])
    if idle:
      why = (f'its K policy, {type(policy).__name__}, never chooses K = 0' if made.lazy else
             'the drafter has lazy=False')
      raise ValueError(f'drafter options {idle} act on the lazy draft cache, which this engine '
                       f'does not keep ({why})')
  except BaseException:
    if unbound:        # bound here: free for the corrected engine (another's binding stays)
      policy.release()
    raise
  return made, policy


def keeps_lazy_draft(drafter, policy) -> bool:
  """Whether an engine with this drafter and policy keeps its draft cache lazily
  (`jaxspec.engine.draft_sync`): a lazy `ModelDrafter` and a policy that may choose K = 0."""
  return isinstance(drafter, ModelDrafter) and drafter.lazy and 0 in policy.candidates


@contextlib.contextmanager
def released_on_error(policy):
  """Around an engine's checks after `setup`: if one raises, the `KPolicy` instance it bound is
  released (`KPolicy.release`), so the corrected engine can take the same instance."""
  try:
    yield
  except BaseException:
    if policy is not None:
      policy.release()
    raise


def split_cost(decodes, waiting: Sequence, prefill_costs: Mapping[int, float],
               chunk_size: int) -> tuple:
  """What breaking the decoding requests' lock-step costs in extra prefill calls (host side).

  Requests with equal room that run K = 0 finish in the same round, and the requests waiting
  for their slots are then prefilled together, in one call of their row bucket. A round at
  K >= 1 accepts a different number of tokens per request, so they finish in different rounds
  and each admission is prefilled alone. Every call reads all the weights, so on a
  memory-bound device a lone [1, C] chunk costs far more than 1/a of an [a, C] one (on the
  development CPU 12.8 ms against 61.7 / 8 = 7.7 ms per row at a = 8). A K policy adds the
  difference to the first round at K >= 1 (`KPolicy.split_s`); once the finishes are apart it
  is 0.

  Args:
    decodes: the decoding requests (`.room`); waiting: the queued requests in admission order
      (`.prefill_tokens`, `.max_tokens`).
    prefill_costs: {rows: seconds} one prefill call per row bucket (must hold 1 and the
      largest bucket); chunk_size: C, prefill tokens per request per call.
  Returns:
    (seconds: Σ over groups of equal room of chunks x (a x t(1) - t(a, batched)) for the a
    requests the group admits, tokens: Σ max_tokens of the requests those admit).
  """
  if not prefill_costs or not waiting:
    return 0.0, 0
  buckets = sorted(prefill_costs)
  largest = buckets[-1]

  def batched(a):      # seconds of prefilling a requests' chunks together, per chunk
    full, rest = divmod(a, largest)
    return full * prefill_costs[largest] + (
        prefill_costs[min(b for b in buckets if b >= rest)] if rest else 0.0)

  queue = list(waiting)
  seconds, tokens, start = 0.0, 0, 0
  for _, size in sorted(collections.Counter(r.room for r in decodes).items()):
    admitted = queue[start:start + size]
    start += len(admitted)
    if len(admitted) >= 2:
      chunks = max(math.ceil(len(r.prefill_tokens) / chunk_size) for r in admitted)
      seconds += chunks * (len(admitted) * prefill_costs[buckets[0]] - batched(len(admitted)))
      tokens += sum(r.max_tokens for r in admitted)
    if start >= len(queue):
      break
  return max(seconds, 0.0), tokens


def horizon(engine, decodes) -> tuple:
  """(split, queued, queue_rooms, slots) for `choose`: `split_cost` of the engine's decoding and
  waiting requests, its seconds times how much slower live prefill calls run than the table
  (`Engine.prefill_live`: 1.10-1.27x in the batching study's interleaved runs); the requests
  still prefilling or waiting for a slot, their count and their decode tokens (room - 1: the
  prefill emits one, except a resumed request's; prefilling first, then in admission order, at
  most `num_slots`; none with no token to decode); and the slot count. ((0.0, 0), None, None,
  None) without a policy."""
  if engine.policy is None:
    return (0.0, 0), None, None, None
  scheduler = engine.scheduler
  seconds, tokens = split_cost(decodes, scheduler.waiting, engine.prefill_costs, engine.chunk_size)
  split = seconds * engine.prefill_live.value, tokens
  decoding = {id(r) for r in decodes}
  queue = [r for r in scheduler.running if id(r) not in decoding]
  queue.extend(itertools.islice(scheduler.waiting, max(0, engine.num_slots - len(queue))))
  # The prefill emits one token, except a resumed request's (its pending token is an output).
  rooms = [room for room in (r.room - (0 if r.output else 1) for r in queue[:engine.num_slots])
           if room >= 1]
  return split, num_queued(engine, decodes), rooms, engine.num_slots


def known_max_p(request, tokens: int = AlphaTracker.CONFIDENCE_TOKENS) -> list:
  """The target's max softmax probabilities of the last `tokens` (>= 1) of the request's outputs
  whose confidence is known (its `max_p`, recorded with a lazy draft cache: by prefill, by
  rounds at K = 0 and, for a policy that reads them there (`KPolicy.wants_spec_confidences`),
  at K >= 1; read from the end, so the newest first); [] when it has none."""
  return list(itertools.islice((p for p in reversed(getattr(request, 'max_p', ())) if p > 0),
                               max(1, tokens)))


def confidence(request, tokens: int = AlphaTracker.CONFIDENCE_TOKENS) -> Optional[float]:
  """The mean of `known_max_p` (`KPolicy.confidences`), None when it has none. The first
  token's, from prefill, is what the first decode round of a new request is priced with."""
  return _mean(known_max_p(request, tokens))


def _mean(values: list) -> Optional[float]:
  return sum(values) / len(values) if values else None


def num_queued(engine, decodes) -> int:
  """Requests still prefilling or waiting for a slot (`decodes`: the running ones decoding)."""
  return len(engine.scheduler.waiting) + len(engine.scheduler.running) - len(decodes)


def choose(policy: Optional[KPolicy], decodes, rows: int, k_max: int, draft_sync=None,
           split: tuple = (0.0, 0), queued: Optional[int] = None,
           queue_rooms: Optional[Sequence[int]] = None, slots: Optional[int] = None,
           horizon: Optional[Callable[[], tuple]] = None, overlapped: bool = False):
  """The round's K and each request's cap (<= K, proposals its row may accept), from the policy
  (None: K = 0), checked.

  Args:
    decodes: the decoding requests (with `.id` and `.room`, given to the policy as
      `KPolicy.rooms`).
    rows: the row count of the round's device call (`KPolicy.rows`: its cost table's row).
    split: (seconds, tokens) of `split_cost` (`KPolicy.split_s`, `KPolicy.split_tokens`).
    queued: requests waiting for a slot or prefilling (`KPolicy.queued`); queue_rooms: their
      decode tokens (`KPolicy.queue_rooms`); slots: the engine's batch slots (`KPolicy.slots`).
    draft_sync: the engine's lazy draft cache (`jaxspec.engine.draft_sync.DraftSync`) or None:
      it probes when due and tells the policy its catch-up seconds (`KPolicy.sync_s`) before
      the choice, and catches the draft up after a choice of K >= 1.
    horizon: None, or a function returning (split, queued, queue_rooms, slots) (`horizon`),
      called only when the policy does not repeat a held choice (`KPolicy.repeat`, asked with
      `queued` when no probe is due): gathering them costs host time every round.
    overlapped: the choice is made while a K = 0 round of `decodes` runs (`DraftSync.overlaps`,
      which found no probe due); a K >= 1 choice is returned without its catch-up (the round
      runs at K = 0, and the next one asks the policy again first).
  Returns:
    (K, caps: list of int aligned with `decodes`).
  Raises:
    ValueError: the policy chose a K that is not an int candidate in [0, k_max], or caps that
      are not ints in [0, K] (one per request).
  """
  if policy is None:
    return 0, [0] * len(decodes)
  if horizon is not None:
    again = None if draft_sync is not None and not overlapped and \
        draft_sync.probe_due(decodes) else \
        policy.repeat([r.id for r in decodes], rows, queued, [r.room for r in decodes])
    if again is not None:
      k, caps = _checked(policy, k_max, len(decodes), *again)
      if draft_sync is not None and not overlapped:
        draft_sync.before_round(decodes, k)
      return k, caps
    split, queued, queue_rooms, slots = horizon()
  policy.rooms = [r.room for r in decodes]
  known = [known_max_p(r) for r in decodes] \
      if policy.gets_confidences(draft_sync is not None) else None
  policy.confidences = None if known is None else [_mean(p) for p in known]
  policy.confidence_tokens = None if known is None else [len(p) for p in known]
  policy.rows, policy.queued = rows, queued
  policy.queue_rooms, policy.slots = queue_rooms, slots
  policy.split_s, policy.split_tokens = split
  if draft_sync is not None:
    policy.sync_s = draft_sync.before_choice(decodes)
  k, caps = _checked(policy, k_max, len(decodes), *policy.choose([r.id for r in decodes]))
  if draft_sync is not None and not overlapped:
    draft_sync.before_round(decodes, k)
  return k, caps


def observe_round(policy: Optional[KPolicy], layout, result, caps) -> None:
  """Give the policy each row's acceptance observation of a decode round
  (`KPolicy.observe`) and add the row's proposals and accepted tokens to its request's
  metrics (accepted counts only emitted tokens, proposed only those in reach of the cuts:
  `jaxspec.decoding.speculative.proposals_in_reach`). Rows with neither proposals nor trials
  (K = 0 without a draft step or probe) tell nothing and are skipped; nothing without a
  policy.

  Args:
    layout: [(row, request)] of the round's decoding requests.
    result: the round's `jaxspec.engine.drafters.Round` (arrays [rows]).
    caps: [rows] int32, the proposals each row could accept.
  """
  if policy is None:
    return
  observed = (result.num_proposed > 0) | (result.trials > 0)
  for row, request in layout:
    n, e = int(result.num_accepted[row]), int(result.emitted[row])
    # A row whose target logits were not finite ends in INVALID_TOKEN and fails: what it
    # "accepted" says nothing about the draft (and would enter the global sums every request
    # shares).
    if observed[row] and INVALID_TOKEN not in result.window[row, :e]:
      if result.draft_failed is not None:
        request.metrics.draft_failed += int(result.draft_failed[row])
      request.metrics.proposed += proposals_in_reach(int(result.num_proposed[row]), n, e)
      request.metrics.accepted += min(n, e)
      policy.observe(request.id, int(caps[row]), n, float(result.successes[row]),
                     float(result.trials[row]))


def _checked(policy, k_max: int, n: int, k, caps) -> tuple:
  """(k, list(caps)) if K is an int candidate in [0, k_max] and caps n ints in [0, K]."""
  caps = list(caps)
  if type(k) is int and k == 0 and len(caps) == n and all(type(c) is int for c in caps) and \
      caps.count(0) == n and 0 in policy.candidates:
    return 0, caps      # the K = 0 of most rounds at large B: no is_int_in per cap
  if not (is_int_in(k, 0, k_max) and k in policy.candidates and len(caps) == n and
          all(is_int_in(c, 0, k) for c in caps)):
    raise ValueError(f'k_policy {policy!r} chose K={k!r} (candidates {policy.candidates}) with '
                     f'caps {caps!r} for {n} requests: K must be an int candidate in '
                     f'[0, k={k_max}] and each cap an int in [0, K]')
  return int(k), [int(c) for c in caps]
