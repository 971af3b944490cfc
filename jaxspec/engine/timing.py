"""Timing device calls for the engine's cost tables (`Engine.step_costs`, the lazy draft's
catch-up costs) and compiling them first (`Engine.warm_up`): host side, wall clock."""

from __future__ import annotations

import math
import time
from typing import Callable, Hashable, Mapping, Optional, Sequence

import numpy as np

from jaxspec.cache import host as host_lib
from jaxspec.checks import check_int, check_real, is_int_in
from jaxspec.engine import device
from jaxspec.engine.live_costs import line_through
from jaxspec.engine import rows as rows_lib


BUDGET_MIN_ROUNDS = 5    # rounds `fastest` runs before a time budget may stop it


def fastest(calls: Mapping[Hashable, Callable[[], object]], repeats: int,
            block: int = 3, base_of: Optional[Mapping[Hashable, Hashable]] = None,
            budget_s: Optional[float] = None) -> dict:
  """The fastest timed call of each function: one untimed call of each first (it compiles),
  then `repeats` rounds in which each function runs one untimed call and `block` timed ones,
  back to back.

  Back to back because a device call runs slow right after a different one and recovers over a
  few calls (on the development CPU a B = 4 decode round at K = 0 right after one at K = 8 took
  3.5-5.0 ms, ~2.75 ms after K = 0): timed one call per key in turn, the table priced K = 0 at
  ~1.45x its live rounds and K = 1, 2 at 1.35x and 1.18x, so speculation looked cheaper against
  K = 0 than it was (`scripts/policy_host_time.py --costs`, B = 4 retrieval); with every timed
  call after a call of its own key it was 0.85-0.86x of them at K = 0, 1 and 2 in one run and
  0.79-0.86x in another, no longer falling with K. Live rounds mostly follow rounds at the same
  K; `LiveCosts` sees the rest. The rounds run the keys in alternating directions and each round
  calls every key, so a drift in the machine's load hits every key alike; the minimum is kept
  because timing noise only adds.

  With `base_of`, a key priced against a base key gets the base's time times the median over
  rounds of its fastest call over the base's fastest call in the same round. What a policy
  weighs is the ratio, and the minimum of each key over all rounds takes each key's luckiest
  moment on its own: eight B = 2 tables of one engine, 40 rounds of 3 calls each, put
  t(K = 1)/t(K = 0) at 1.72 +- 0.017 as median ratios and 1.79 +- 0.16 as minima (2026-12-07,
  `python scripts/cost_table_noise.py --batch 2 --tables 8 --repeats 40`); at 5 rounds the
  two were alike (+- 0.07-0.08).

  Args:
    calls: {key: function of no arguments that returns once its results are on the host}.
    repeats: rounds (>= 1); block: timed calls per key and round (>= 1).
    base_of: {key: base key} for the keys priced by their median ratio to a base (a key of
      `calls` not itself in `base_of`, or the key itself); the others keep their minimum.
    budget_s: seconds (> 0) after which no further round starts, once `BUDGET_MIN_ROUNDS`
      (or `repeats`, if fewer) have run; None: every round runs.
  Returns:
    {key: seconds}.
  Raises:
    ValueError: repeats or block not an int >= 1, budget_s not a finite number > 0; a base_of
      key or base not in calls, or a base that is itself priced against another.
  """
  repeats, block = check_int('repeats', repeats, 1), check_int('block', block, 1)
  _check_budget('budget_s', budget_s)
  base_of = {key: base for key, base in (base_of or {}).items() if key != base}
  for key, base in base_of.items():
    if key not in calls or base not in calls or base in base_of:
      raise ValueError(f'base_of {key!r}: {base!r} must be keys of calls, and {base!r} not '
                       f'priced against another key')
  keys = list(calls)
  for key in keys:
    calls[key]()
  times = {key: [] for key in keys}
  start_s = time.perf_counter()
  for r in range(repeats):
    if (budget_s is not None and r >= BUDGET_MIN_ROUNDS and
        time.perf_counter() - start_s >= budget_s):
      break
    for key in (keys if r % 2 == 0 else keys[::-1]):
      calls[key]()                    # untimed: the block's timed calls follow their own key
      times[key].append(float('inf'))
      for _ in range(block):
        start = time.perf_counter()
        calls[key]()
        times[key][-1] = min(times[key][-1], time.perf_counter() - start)
  out = {key: min(t) for key, t in times.items()}
  for key, base in base_of.items():
    out[key] = out[base] * float(np.median(np.asarray(times[key]) / np.asarray(times[base])))
  return out


def warm_up(engine, cost_repeats: int, decode_rounds: int,
            decode_budget_s: Optional[float]) -> None:
  """`Engine.warm_up`: compile the host-tier copies (when there is a host tier) and every
  prefill row bucket (timed into `engine.prefill_costs` only for a policy that prices lock-step
  admissions, `speculation.split_cost`; the target's alone), with a lazy draft cache also the
  prefill that fills the draft too (`DraftSync.fills_prefill`), then time the decode rounds
  (`measure_costs`: `decode_rounds` rounds within `decode_budget_s`; the catch-up calls
  `cost_repeats`). Raises ValueError (before compiling anything) for cost_repeats or
  decode_rounds not an int >= 1, decode_budget_s neither None nor a finite number > 0."""
  cost_repeats = check_int('cost_repeats', cost_repeats, 1)
  decode_rounds = check_int('decode_rounds', decode_rounds, 1)
  _check_budget('decode_budget_s', decode_budget_s)
  if engine.prefix.host is not None:
    engine.caches = host_lib.warm_up_copies(engine.caches, engine.pages_per_seq)
  priced = engine.policy is not None and engine.policy.needs_costs
  costs = prefill_costs(engine, cost_repeats if priced else None)   # a lazy draft sits out
  if priced:
    engine.prefill_costs = costs
  if engine.draft_sync is not None:
    prefill_costs(engine, None, drafted=True)
  engine.measure_costs(decode_rounds, catch_up_repeats=cost_repeats,
                       budget_s=decode_budget_s)


def prefill_costs(engine, repeats: Optional[int], drafted: bool = False) -> dict:
  """Compile the engine's prefill call at every row bucket over idle rows (with a lazy draft
  cache, the call that fills the draft too if `drafted`) and, unless repeats is None, time each
  (`fastest`). Returns {rows: seconds} ({} when not timed)."""
  def call_of(rows):
    table, lengths = device.idle_rows(rows, engine.pages_per_seq)
    tokens = np.zeros((rows, engine.chunk_size), np.int32)
    zeros, sampling = np.zeros((rows,), np.int32), rows_lib.sampling([], rows)
    return lambda: engine._call_prefill(table, lengths, tokens, zeros, sampling, drafted)

  calls = {rows: call_of(rows) for rows in engine.prefill_buckets}
  if repeats is None:
    for call in calls.values():
      call()
    return {}
  return fastest(calls, repeats)


def decode_costs(engine, repeats: int, widths: Sequence[int], ratios: bool = True,
                 block: int = 3, budget_s: Optional[float] = None) -> dict:
  """{(rows, K): seconds} the idle decode round of the engine (`fastest`, `repeats` rounds of
  `block` timed calls) at every K its policy may choose (K = 0 without one) and every row count
  in `widths` (compiled first): the fastest at the smallest K of each row count, and with
  `ratios` every other K at that times its median ratio to it per round (`fastest`'s
  `base_of`), else its own fastest; `budget_s` as `fastest`'s."""
  ks = engine.policy.candidates if engine.policy is not None else (0,)
  base_of = {(rows, k): (rows, min(ks)) for rows in widths for k in ks} if ratios else None

  def round_at(rows, k):
    table, lengths = device.idle_rows(rows, engine.pages_per_seq)
    zeros = np.zeros((rows,), np.int32)
    stop = rows_lib.stop_table([], rows, engine.max_stop_tokens)
    sampling = rows_lib.sampling([], rows)
    return lambda: engine._call_decode(table, lengths, zeros, zeros, stop, sampling, k=k,
                                       caps=zeros)

  return fastest({(rows, k): round_at(rows, k) for rows in widths for k in ks}, repeats,
                 block, base_of, budget_s)


def measure_costs(engine, repeats: int, widths: Optional[Sequence[int]],
                  catch_up_repeats: int, budget_s: Optional[float]) -> dict:
  """`Engine.measure_costs`: time the decode rounds of `widths` (default every decode bucket;
  `decode_costs`, `repeats` rounds within `budget_s`) into `engine.row_costs` {rows: {K: seconds}}, a lazy
  draft's catch-up calls (`catch_up_repeats` rounds), and hand a policy that needs costs its
  table once the full batch's row is timed (each row's K >= 2 entries on their
  `live_costs.line_through` line, K = 0 and 1 as timed; `row_costs` keeps the timed values).

  Returns:
    `engine.step_costs` (the full batch's row; {} until it is timed).
  Raises:
    ValueError: repeats or catch_up_repeats not an int >= 1, budget_s neither None nor a
      finite number > 0, widths not a sequence of decode buckets.
  """
  repeats = check_int('repeats', repeats, 1)
  catch_up_repeats = check_int('catch_up_repeats', catch_up_repeats, 1)
  _check_budget('budget_s', budget_s)
  if widths is None:
    widths = engine.decode_buckets
  try:
    listed = list(widths)
  except TypeError:
    raise ValueError(f'widths must be a sequence of decode buckets {engine.decode_buckets}, '
                     f'got {widths!r}') from None
  if not all(is_int_in(w, 1, engine.num_slots) and w in engine.decode_buckets for w in listed):
    raise ValueError(f'widths {listed} must be decode buckets {engine.decode_buckets}')
  widths = tuple(sorted({int(w) for w in listed}))     # 3.0 == 3 was a bucket; np ints as ints
  for (rows, k), seconds in decode_costs(engine, repeats, widths, budget_s=budget_s).items():
    engine.row_costs.setdefault(rows, {})[k] = seconds
  if engine.draft_sync is not None:
    engine.draft_sync.measure(catch_up_repeats)
  # The policy's table is the full batch's row: until that row is timed (widths without
  # num_slots) the policy still needs costs, and the next round measures every bucket.
  # It is given the line through each row's K >= 2 entries (`live_costs.line_through`): a
  # timed entry off by its noise would be chosen (or never) for that alone.
  if engine.policy is not None and engine.policy.needs_costs and engine.step_costs:
    lines = {rows: line_through(table) for rows, table in engine.row_costs.items()}
    engine.policy.set_costs(line_through(engine.step_costs), by_rows=lines)
  return engine.step_costs


def _check_budget(name: str, budget_s) -> None:
  if budget_s is not None:
    check_real(name, budget_s, 0.0, math.inf, low_open=True, high_open=True)
