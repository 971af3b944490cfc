"""Requests as the engine sees them: host-side state, per-request metrics and finished outputs.

Plain Python over ints. A request moves waiting -> prefill -> decode -> finished; a preemption
sends it back to waiting with everything it emitted so far (see `Request.prefill_tokens`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Hashable, Mapping, Optional

from jaxspec.decoding.output import NonFiniteLogitsError, draft_failed_message
from jaxspec.decoding.sampling import SamplingParams


class State(enum.Enum):
  WAITING = 'waiting'
  PREFILL = 'prefill'
  DECODE = 'decode'
  FINISHED = 'finished'


@dataclasses.dataclass
class RequestMetrics:
  """Measurements of one request. Times are `time.perf_counter()` seconds.

  Attributes:
    arrival_s: when `add_request` accepted it.
    first_token_s: when its first token was emitted (None before).
    finish_s: when it finished or was aborted (None before).
    prompt_tokens: prompt length.
    prefill_tokens: tokens its prefills computed (recomputation after preemptions included).
    cached_tokens: tokens its admissions found in the prefix cache (device or host tier).
    preemptions: times it was preempted (its pages released, recomputed later).
    proposed: draft tokens proposed for it that were in reach (a round cut by a stop token or
      max_tokens before its first rejection counts only its emitted tokens,
      `jaxspec.decoding.speculative.proposals_in_reach`); accepted: of those, accepted and
      emitted.
    accepted_lengths: per target pass of a decode round, tokens it emitted (accepted + 1, after
      stop-token and max_tokens cuts): the per-round τ; its mean is `mean_accepted_length`.
    draft_failed: its rounds (and lazy-draft catch-ups) in which the draft model's logits were
      NaN or +inf (those proposals were rejected: its tokens are the target's, but its α
      measures a broken draft; `check_outputs` refuses it for measurement).
  """

  arrival_s: float
  first_token_s: Optional[float] = None
  finish_s: Optional[float] = None
  prompt_tokens: int = 0
  prefill_tokens: int = 0
  cached_tokens: int = 0
  preemptions: int = 0
  proposed: int = 0
  accepted: int = 0
  accepted_lengths: list = dataclasses.field(default_factory=list)
  num_tokens: int = 0
  draft_failed: int = 0

  @property
  def ttft_s(self) -> float:
    """Seconds from arrival to the first token (queueing + prefill), NaN before it."""
    return math.nan if self.first_token_s is None else self.first_token_s - self.arrival_s

  @property
  def tpot_s(self) -> float:
    """Seconds per output token after the first, NaN with fewer than two tokens or unfinished
    (an aborted request: up to the abort, time queued after a preemption included)."""
    if self.finish_s is None or self.first_token_s is None or self.num_tokens < 2:
      return math.nan
    return (self.finish_s - self.first_token_s) / (self.num_tokens - 1)

  @property
  def acceptance_rate(self) -> float:
    """α = accepted ÷ proposed draft tokens (NaN without speculation)."""
    return self.accepted / self.proposed if self.proposed else math.nan

  @property
  def mean_accepted_length(self) -> float:
    """τ = tokens emitted per target pass in decode rounds (NaN before any round)."""
    n = len(self.accepted_lengths)
    return sum(self.accepted_lengths) / n if n else math.nan

  def __repr__(self) -> str:
    """The derived measures first (TTFT, TPOT in seconds, α, τ), then the counts; the raw
    perf_counter stamps and the per-round list are left to the attributes."""
    derived = ', '.join(f'{name}={getattr(self, name):.4g}' for name in
                        ('ttft_s', 'tpot_s', 'acceptance_rate', 'mean_accepted_length'))
    counts = ', '.join(f'{name}={getattr(self, name)}' for name in
                       ('num_tokens', 'prompt_tokens', 'prefill_tokens', 'cached_tokens',
                        'preemptions', 'proposed', 'accepted', 'draft_failed'))
    return f'RequestMetrics({derived}, {counts})'


@dataclasses.dataclass
class RequestOutput:
  """A finished request.

  Attributes:
    request_id: as given to (or returned by) `add_request`.
    prompt: the prompt token ids.
    tokens: emitted token ids (a stop token that ended it included).
    finish_reason: 'stop' (a stop token), 'length' (max_tokens), 'abort' (`Engine.abort`) or
      'error' (the model's logits were not finite: NaN or +inf; `tokens` holds the real tokens
      before that point, and the other requests are unaffected).
    metrics: its `RequestMetrics`.
    error: what went wrong, for finish_reason 'error' (else None).
  """

  request_id: Hashable
  prompt: list
  tokens: list
  finish_reason: str
  metrics: RequestMetrics
  error: Optional[str] = None


def check_outputs(outputs) -> list:
  """`outputs` (RequestOutputs, or the {request_id: RequestOutput} mapping `Engine.run` returns)
  as a list, unless one finished with an error or its draft's logits turned NaN or +inf: a
  measurement over them would count a request cut short by NaN logits as served, or a broken
  draft's α as a poor draft's.

  Raises:
    NonFiniteLogitsError: naming the failed requests and the first one's error; or the requests
      whose draft failed (`RequestMetrics.draft_failed`) and the rounds.
    TypeError: an item that is not a RequestOutput.
  """
  outputs = list(outputs.values() if isinstance(outputs, Mapping) else outputs)
  odd = [o for o in outputs if not isinstance(o, RequestOutput)]
  if odd:
    raise TypeError(f'check_outputs takes RequestOutputs (or the mapping Engine.run returns), '
                    f'got {type(odd[0]).__name__} {odd[0]!r:.80}')
  failed = [o for o in outputs if o.finish_reason == 'error']
  if failed:
    names = ', '.join(repr(o.request_id) for o in failed[:8])
    more = f' and {len(failed) - 8} more' if len(failed) > 8 else ''
    raise NonFiniteLogitsError(f'{len(failed)} request{"s" if len(failed) > 1 else ""} '
                               f'failed ({names}{more}): {failed[0].error}')
  broken = [o for o in outputs if o.metrics.draft_failed]
  if broken:
    rounds = sum(o.metrics.draft_failed for o in broken)
    total = sum(len(o.metrics.accepted_lengths) for o in broken)
    names = ', '.join(repr(o.request_id) for o in broken[:8])
    raise NonFiniteLogitsError(draft_failed_message(rounds, total) + f' (requests {names}'
                               f'{" and more" if len(broken) > 8 else ""})')
  return outputs


@dataclasses.dataclass
class Request:
  """Host-side state of one request inside the engine.

  Attributes:
    id: request id; prompt: token ids; max_tokens: tokens to emit at most (>= 1);
    stop_tokens: ids that end it (emitted); salt: prefix-cache salt.
    sampling: its `SamplingParams`.
    output: tokens emitted so far.
    state: where it is; slot: its batch slot while admitted (else None).
    handle: its pages (`jaxspec.cache.Request`) while admitted.
    num_computed: tokens of `context` whose keys/values the caches hold (its cache length).
    draft_computed: of those, the tokens the draft's cache holds too, when the engine keeps it
      lazily (`jaxspec.engine.draft_sync`; 0 at every admission).
    token_p: with a lazy draft cache, per emitted token, the target probability p(token) it was
      drawn with where known (rounds at K = 0), else 0 (empty otherwise).
    max_p: alike, the target's max softmax probability at that step (its confidence), for the
      first token (from prefill), rounds at K = 0 and the draft model's rounds at K >= 1 for a
      policy that reads them there (`KPolicy.wants_spec_confidences`), else 0 (unknown).
    order: admission sequence number (lower = older = higher priority).
  """

  id: Hashable
  prompt: list
  max_tokens: int
  stop_tokens: tuple
  salt: bytes
  metrics: RequestMetrics
  output: list = dataclasses.field(default_factory=list)
  state: State = State.WAITING
  slot: Optional[int] = None
  handle: object = None
  num_computed: int = 0
  draft_computed: int = 0
  token_p: list = dataclasses.field(default_factory=list)
  order: int = -1
  sampling: SamplingParams = SamplingParams()
  finish_reason: Optional[str] = None
  max_p: list = dataclasses.field(default_factory=list)

  @property
  def context(self) -> list:
    """prompt + emitted tokens."""
    return self.prompt + self.output

  @property
  def prefill_tokens(self) -> list:
    """What a (re)admission prefills: the prompt; after a preemption, prompt + every emitted
    token but the last, which becomes the pending token again (so decoding resumes exactly where
    it stopped, without sampling anything twice)."""
    return self.context[:-1] if self.output else self.prompt

  @property
  def room(self) -> int:
    """Tokens it may still emit."""
    return self.max_tokens - len(self.output)
