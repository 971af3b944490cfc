"""The work of one engine step (`Engine.step`), host side around the jitted calls: the prefill
chunks of the requests being admitted, and the decode round of the requests decoding (batched
speculative decoding when the engine has a drafter). Rows follow the engine's hooks
(`_prefill_row`, `_decode_layout`, `_call_prefill`, `_call_decode`), which `EvictingEngine`
overrides.
"""

from __future__ import annotations

import time

import numpy as np

from jaxspec.decoding.output import non_finite_message
from jaxspec.decoding.sampling import INVALID_TOKEN
from jaxspec.engine import rows as rows_lib
from jaxspec.engine import speculation
from jaxspec.engine.request import State


def prefill_chunks(engine, prefills, emitted: dict) -> None:
  """One prefill call for the step's prefilling requests: `prefills` [(request, chunk token
  ids)], at most `prefill_rows` of them, each chunk <= chunk_size tokens. A request whose
  prefill completes starts decoding and emits its first token (into `emitted`, {request id:
  [token ids]}) unless it resumes after a preemption."""
  # The smallest compiled row count that holds them: a lone admission does not pay for a
  # whole [prefill_rows, C] pass.
  rows = min(b for b in engine.prefill_buckets if b >= len(prefills))
  layout = [(engine._prefill_row(i, request), (request, chunk))
            for i, (request, chunk) in enumerate(prefills)]
  table, lengths, tokens, counts = rows_lib.prefill_inputs(layout, rows, engine.pages_per_seq,
                                                           engine.chunk_size)
  drafted = engine.draft_sync is not None and engine.draft_sync.fills_prefill
  sampling = rows_lib.sampling([(row, request) for row, (request, _) in layout], rows)
  start = time.perf_counter()
  first, max_p = engine._call_prefill(table, lengths, tokens, counts, sampling, drafted)
  now = time.perf_counter()
  # Live calls against the table that prices a split (timed without the draft: a call that
  # fills it too, `DraftSync.fills_prefill`, counts its extra, ~1.2 ms on a 15-45 ms call on
  # the development CPU, as what admissions cost).
  if engine.prefill_costs:
    engine.prefill_live.add(now - start, engine.prefill_costs.get(rows, 0.0))
  for row, (request, chunk) in layout:
    if drafted and request.draft_computed == request.num_computed:   # no gap before it
      request.draft_computed += len(chunk)
    request.num_computed += len(chunk)
    request.metrics.prefill_tokens += len(chunk)
    if request.num_computed < len(request.prefill_tokens):
      continue
    engine.scheduler.commit(request)   # its prompt pages can be shared from now on
    request.state = State.DECODE
    if not request.output:           # a resumed request's pending token is its last output
      emit(engine, request, [int(first[row])], now, emitted,
           max_p=None if max_p is None else [float(max_p[row])])


def decode_round(engine, decodes, emitted: dict) -> None:
  """One decode round over every decoding request (`decodes`, oldest first): the K policy
  chooses K (and per-row caps), the drafter proposes, one target call verifies every row, and
  each request emits its accepted tokens + 1 (into `emitted`), finishing at a stop token or
  max_tokens; the policy is told what the round accepted and what it cost (seconds). While a
  lazy draft's policy stays at K = 0 the round runs at K = 0 and the policy chooses during its
  device call (`DraftSync.overlaps`; after a K >= 1 choice the next round asks first); an
  exception of that choice is raised by the next decode round, before anything runs (a
  KeyboardInterrupt once this round's tokens are emitted)."""
  if engine.policy is not None and engine.policy.needs_costs:
    engine.measure_costs()     # before the round's clock starts: not host time of a round
  start = time.perf_counter()
  width, rows = engine._decode_layout(decodes)
  layout = list(zip(rows, decodes))
  table, lengths, pending, room = rows_lib.decode_inputs(layout, width, engine.pages_per_seq)
  sync = engine.draft_sync
  if sync is not None and sync.choice_error is not None:
    error, sync.choice_error = sync.choice_error, None
    raise error
  synced = sync.seconds if sync is not None else 0.0

  def choose(overlapped=False):
    return speculation.choose(
        engine.policy, decodes, width, engine.k, sync,
        queued=speculation.num_queued(engine, decodes) if engine.policy is not None else None,
        horizon=lambda: speculation.horizon(engine, decodes), overlapped=overlapped)

  chosen, failed = [], []
  if engine.policy is not None and sync is not None and sync.overlaps(decodes):
    k, row_caps = 0, [0] * len(decodes)

    def meanwhile():    # the round's cache is donated: the round completes whatever happens
      try:
        chosen.append(choose(overlapped=True)[0])
      except BaseException as error:  # pylint: disable=broad-except  # raised later
        failed.append(error)
  else:
    k, row_caps, meanwhile = *choose(), None
  if sync is not None:      # a lazy draft's probe and catch-up are not host time of the round
    start += sync.seconds - synced
  catch_up_s = sync.round_s if sync is not None else 0.0      # the catch-up alone
  caps = np.zeros((width,), np.int32)
  caps[rows] = row_caps
  contexts = [None] * width
  if getattr(engine.drafter, 'uses_context', False):
    for row, request in layout:
      contexts[row] = request.context
  call_start = time.perf_counter()
  stop = rows_lib.stop_table(layout, width, engine.max_stop_tokens)
  result = engine._call_decode(table, lengths, pending, room, stop,
                               rows_lib.sampling(layout, width), k=k, caps=caps,
                               contexts=contexts, meanwhile=meanwhile)
  device_s = time.perf_counter() - call_start
  engine.k_rounds[k] += 1
  now = time.perf_counter()
  if k or sync is None:   # a lazy draft's K = 0 round observes nothing (probes do)
    speculation.observe_round(engine.policy, layout, result, caps)   # before a finish forgets
  tokens = 0
  for row, request in layout:
    e = int(result.emitted[row])
    request.num_computed += e      # pending + the first e - 1 new tokens are now cached
    window = result.window[row, :e].tolist()
    # INVALID_TOKEN (logits not finite: the request fails in `emit`) is not an emitted token.
    request.metrics.accepted_lengths.append(
        window.index(INVALID_TOKEN) if INVALID_TOKEN in window else e)
    tokens += request.metrics.accepted_lengths[-1]
    emit(engine, request, window, now, emitted,
         None if result.token_p is None else [float(result.token_p[row])] * e,
         None if result.max_p is None else result.max_p[row, :e].tolist())
  if sync is not None:
    sync.after_round(decodes, k, engine.row_costs.get(width, {}).get(0, 0.0),
                     chose_k0=not failed and not any(chosen))
  if engine.policy is not None:   # host seconds of this round besides the device call
    host_s = max(0.0, time.perf_counter() - start - device_s + engine._schedule_s)
    engine.policy.round_outcome(tokens, catch_up_s)
    engine.policy.round_timing(k, device_s, host_s)
  if failed and not isinstance(failed[0], Exception):
    raise failed[0]               # KeyboardInterrupt: now, the engine consistent
  if failed:
    sync.choice_error = failed[0]


def emit(engine, request, tokens: list, now: float, emitted: dict, token_p=None,
         max_p=None) -> None:
  """Append a request's new tokens (ids, up to an `INVALID_TOKEN`, where the device step ended a
  row whose logits were not finite) to its output and to `emitted` ({request id: [token ids]}),
  with their probabilities `token_p` and top probabilities `max_p` (one float each, or None)
  kept only for a lazy draft's catch-up and policy; `now` (perf_counter seconds) is the TTFT
  clock. The request then finishes (`Engine._finish`): 'error' at an `INVALID_TOKEN` (that
  request alone fails), 'stop' at a stop token, 'length' with no room left."""
  invalid = INVALID_TOKEN in tokens
  if invalid:
    tokens = tokens[:tokens.index(INVALID_TOKEN)]
    token_p, max_p = (None if v is None else v[:len(tokens)] for v in (token_p, max_p))
  request.output.extend(tokens)
  if engine.draft_sync is not None:
    request.token_p.extend([0.0] * len(tokens) if token_p is None else token_p)
    request.max_p.extend([0.0] * len(tokens) if max_p is None else max_p)
  request.metrics.num_tokens = len(request.output)
  if tokens:           # a request that failed at its first token has none (and no TTFT)
    emitted.setdefault(request.id, []).extend(tokens)
    if request.metrics.first_token_s is None:
      request.metrics.first_token_s = now
  if invalid:
    engine._finish(request, 'error', now, error=non_finite_message(  # pylint: disable=protected-access
        f'request {request.id!r} at token {len(request.output)}'))
  elif tokens and tokens[-1] in request.stop_tokens:
    engine._finish(request, 'stop', now)                  # pylint: disable=protected-access
  elif request.room <= 0:
    engine._finish(request, 'length', now)                # pylint: disable=protected-access
