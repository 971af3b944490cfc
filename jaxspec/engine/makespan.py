"""How many decode rounds a batch needs until its last request has finished, per K (host side,
numpy): the horizon an adaptive K policy scores; and what one round emits (`round_tokens`,
`expected_tokens`, `token_moments`).

The batch's remaining time is set by its slowest slot: at K = 0 every request emits one token
per round, so requests with equal room finish together, while at K >= 1 each accepts a random
number per round and they finish at different rounds; the last rounds then run a batch with few
busy rows at the price of the whole bucket. A per-round score does not see that tail;
`rounds_to_finish` prices it. While requests wait for a slot, each freed slot takes the next
one, whose prefill step leaves the slot's row idle for one round if other rows still decode
(requests that finish together at K = 0 are prefilled together, with no round to idle in);
`rounds_with_queue` prices those gaps and the tail after the queue.

Per request i and K, tokens per round T (no stop token; at most its room r) are 1 + the
proposals accepted, P(at least j accepted) = s_j (`survival`: α^j for one acceptance α,
Leviathan et al. 2023): mean E = Σ_{j<=min(K, r-1)} s_j and variance V. Emitting r tokens
takes about r / E rounds with standard deviation sqrt(r V / E^3) (renewal-reward central
limit), and the expected maximum over n requests is taken as max_i mean_i + g(n) max_i sd_i,
g(n) the expected maximum of n standard normals (Blom's approximation).
"""

from __future__ import annotations

import functools
import numbers
import statistics

from typing import Optional, Sequence

import numpy as np


def expected_tokens(alpha: float, k: int, later=None) -> float:
  """E[tokens emitted by one round] = 1 + α Σ_{j<K} β^j, α the first proposal's acceptance and
  β each later one's (`later`: one β, or a sequence of >= K, proposal j = 2, 3, ...'s; None:
  β = α, giving (1 - α^{K+1}) / (1 - α), Leviathan et al. 2023, Eq. 1; K + 1 at α = 1)."""
  return round_tokens([alpha], [alpha if later is None else later], None, k)[k]


def round_tokens(alphas: Sequence[float], later: Sequence, rooms: Optional[Sequence[int]],
                 k_max: int) -> list:
  """[k_max + 1] floats: Σ_i E[tokens request i emits in one round at K], K = 0..k_max, with
  first- and later-proposal acceptance alphas[i], later[i] (`expected_tokens`; later[i] one β
  or a sequence of >= k_max, proposal j = 2, 3, ...'s), each request's proposals capped at
  room_i - 1 (a round emits at most room_i tokens; none at room 0; no cap without rooms): the
  cumulative sums of P(T > j) = α_i Π_{m=2..j} β_im, j < room_i (Leviathan et al. 2023, Eq. 1,
  with later-proposal β). Plain Python (n is small where it is used, and a numpy call costs
  more than the sums). alphas, later and rooms are aligned (not checked: the callers build
  them together)."""
  totals = [0.0] * (k_max + 1)
  for i, (a, b) in enumerate(zip(alphas, later)):
    last = k_max if rooms is None else min(k_max, rooms[i] - 1)
    if last < 0:
      continue       # no room: emits nothing
    per_position = not isinstance(b, numbers.Real)     # a sequence of >= k_max β
    s, e = a, 1.0
    for j in range(k_max + 1):
      totals[j] += e
      if j < last:
        e, s = e + s, s * (b[j] if per_position else b)
  return totals


def later_matrix(alphas, k_max: int, later=None) -> np.ndarray:
  """[n, k_max] float64: each request's acceptance of proposal j = 2..k_max + 1 given the ones
  before it were accepted, from `later`: None (β = α, the constant-α model of Leviathan et al.
  2023), [n] (one β for every later proposal) or [n, J >= k_max] (per position, e.g. β times
  `AlphaTracker.profile`). The last column (j = k_max + 1) is never drafted at K <= k_max: it
  only completes `survival`'s last column, which `token_moments` drops.

  Raises:
    ValueError: later of another shape.
  """
  alphas = np.asarray(alphas, np.float64)
  if later is None:
    return np.repeat(alphas[:, None], k_max, axis=1)
  later = np.asarray(later, np.float64)
  if later.ndim == 1 and later.shape == alphas.shape:
    return np.repeat(later[:, None], k_max, axis=1)
  if later.ndim == 2 and later.shape[0] == alphas.shape[0] and later.shape[1] >= k_max:
    return later[:, :k_max]
  raise ValueError(f'need one later acceptance (or one per position 2..{k_max + 1}) per α, got '
                   f'{later.shape} for {alphas.shape}')


def survival(alphas, k_max: int, later=None) -> np.ndarray:
  """[n, k_max + 2] float64: s_j = P(a round accepts at least j proposals) for j = 0..k_max + 1
  with no cap, s_0 = 1 and s_j = α_i Π_{m=2..j} β_im: α_i the acceptance of the first proposal,
  β_im that of proposal m given the ones before it were accepted (`later_matrix`: one β_i for
  every m, or one per position; None: β = α, the constant-α model of Leviathan et al. 2023).
  Measured pairs accept the first proposal more often than the later ones (e.g. 0.75 against
  ~0.65), so one α fitted to either end misprices K.

  Args:
    alphas: [n] float64 in [0, 1]; later: None, [n] or [n, >= k_max] in [0, 1].
  Raises:
    ValueError: later of another shape (`later_matrix`).
  """
  alphas = np.asarray(alphas, np.float64)
  later = later_matrix(alphas, k_max, later)
  chain = np.cumprod(np.concatenate([alphas[:, None], later], axis=1), axis=1)
  return np.concatenate([np.ones((alphas.size, 1)), chain], axis=1)


def token_moments(alphas: np.ndarray, k_max: int, later=None, rooms=None) -> tuple:
  """(mean, variance), each [n, k_max + 1] float64: tokens one round emits for a request at
  K = 0..k_max (K = 0: exactly 1, variance 0), its proposals accepted as in `survival`.

  Args:
    alphas: [n] float64 in [0, 1]; later: None, [n] or [n, >= k_max] (`survival`).
    rooms: [n] tokens each may still emit (>= 1), capping its tokens per round (None: no cap).
  """
  s = survival(alphas, k_max, later)[:, :-1]         # P(T > j), j = 0..k_max
  j = np.arange(k_max + 1)
  if rooms is not None:                              # T = min(1 + accepted, room)
    s = np.where(j < np.asarray(rooms, np.float64)[:, None], s, 0.0)
  mean = np.cumsum(s, axis=1)                        # E[T] = Σ_{j<=K} P(T > j)
  second = np.cumsum((2 * j + 1) * s, axis=1)        # E[T^2] = Σ_{j<=K} (2j + 1) P(T > j)
  return mean, np.maximum(second - mean ** 2, 0.0)


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
  """E[max of n i.i.d. standard normals] by Blom's approximation Φ^{-1}((n - 3/8) / (n + 1/4))
  (0 for n = 1)."""
  if n <= 1:
    return 0.0
  return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def rounds_to_finish(alphas, rooms, k_max: int, later=None) -> np.ndarray:
  """[k_max + 1] float64: the expected decode rounds until every request has emitted its room,
  running K every round (K = 0: max_i room_i; a round emits at most a request's room, so a
  request with room 1 takes one round at every K).

  Args:
    alphas: [n] acceptance estimates in [0, 1] (later: of the later proposals, `survival`);
      rooms: [n] tokens each may still emit (>= 1).
  Raises:
    ValueError: alphas and rooms (or later) of different lengths, or none.
  """
  alphas, rooms = np.asarray(alphas, np.float64), np.asarray(rooms, np.float64)
  if alphas.shape != rooms.shape or alphas.ndim != 1 or not alphas.size:
    raise ValueError(f'need one room per α, got {alphas.shape} α and {rooms.shape} rooms')
  mean, var = token_moments(alphas, k_max, later, rooms)
  rounds = rooms[:, None] / mean
  sd = np.sqrt(rooms[:, None] * var / mean ** 3)
  return rounds.max(axis=0) + expected_max_normal(len(alphas)) * sd.max(axis=0)


def rounds_with_queue(alphas, rooms, k_max: int, later, queue_rooms, queue_alpha: float,
                      queue_later, slots: int) -> np.ndarray:
  """[k_max + 1] float64: the expected decode rounds until the running requests and the queued
  ones (in admission order, each taking the slot that frees first) have all finished, running K
  every round.

  List scheduling per K on expected rounds (mean room / E, as in `rounds_to_finish`): each
  queued request takes the slot whose expected finish f is earliest, and that slot's row idles
  one round (the request's prefill step) if a row admitted before f still decodes at f; rows
  finishing together with it at K = 0 do not count (their successors are prefilled together,
  with no round to idle in), while at K >= 1 slots tied in expectation finish at random rounds
  and do. The total is the largest slot's finish plus g(busy slots) times the largest slot's
  standard deviation (its requests' spreads added). Slots not held by a running request are
  free at round 0.

  Args:
    alphas, later: [n] first and [n] or [n, >= k_max] later acceptance estimates of the running
      requests (`survival`; later None: β = α); rooms: [n] tokens each may still emit (>= 1).
    queue_rooms: [m] decode tokens each queued request will emit after its prefill's token
      (>= 1); queue_alpha, queue_later: their acceptance estimates (the global ones; queue_later
      one β or [>= k_max] per position, `later_matrix`).
    slots: the engine's batch slots (>= n).
  Raises:
    ValueError: lengths that differ, no running request, more running requests than slots, a
      room below 1.
  """
  alphas, rooms = np.asarray(alphas, np.float64), np.asarray(rooms, np.float64)
  queue = np.asarray(queue_rooms, np.float64)
  if alphas.shape != rooms.shape or alphas.ndim != 1 or not alphas.size:
    raise ValueError(f'need one room per α, got {alphas.shape} α and {rooms.shape} rooms')
  later = later_matrix(alphas, k_max, later)
  if queue.ndim != 1:
    raise ValueError(f'queue_rooms must be a list of rooms, got shape {queue.shape}')
  if (rooms < 1).any() or (queue < 1).any():
    raise ValueError(f'rooms must be >= 1, got {rooms.tolist()} and queue {queue.tolist()}')
  if slots < alphas.size:
    raise ValueError(f'{alphas.size} running requests do not fit {slots} slots')
  n, m, eps = alphas.size, queue.size, 1e-9
  # One pass over the running requests and the queued ones (the global acceptance).
  queue_later = np.asarray(queue_later, np.float64)
  if queue_later.ndim > 1 or (queue_later.ndim == 1 and queue_later.size < k_max):
    raise ValueError(f'queue_later must be one β or one per position 2..{k_max + 1}, got shape '
                     f'{queue_later.shape}')
  queue_later = np.full((m, k_max), float(queue_later)) if queue_later.ndim == 0 else \
      np.broadcast_to(queue_later[:k_max], (m, k_max))
  mean, var = token_moments(np.concatenate([alphas, np.full(m, queue_alpha)]), k_max,
                            np.concatenate([later, queue_later]),
                            np.concatenate([rooms, queue]))
  tokens = np.concatenate([rooms, queue])[:, None]
  rounds, spreads = tokens / mean, tokens * var / mean ** 3
  width = k_max + 1
  finish = np.zeros((slots, width))
  spread = np.zeros((slots, width))
  admitted = np.full((slots, width), -1.0)          # when each slot's request was admitted
  finish[:n], spread[:n] = rounds[:n], spreads[:n]
  # Flat views: one slot per column is read and written per admission, by flat index (a
  # scoring runs this loop every few rounds on the host; fewer numpy calls, same arithmetic).
  flat_finish, flat_spread, flat_admitted = finish.ravel(), spread.ravel(), admitted.ravel()
  offsets = np.arange(width)
  queued_rounds, queued_spreads = rounds[n:], spreads[n:]
  for j in range(m):
    index = finish.argmin(axis=0) * width + offsets  # [K + 1]: the slot freed first
    first = flat_finish[index]
    # A row admitted before `first` still decodes then, or (K >= 1) another slot ties with it
    # (`first` is the column's minimum, so finish - first >= 0).
    level = finish - first <= eps
    gap = (~level & (admitted < first - eps)).any(axis=0)
    gap[1:] |= level[:, 1:].sum(axis=0) > 1
    flat_admitted[index] = first
    flat_finish[index] = first + gap + queued_rounds[j]
    flat_spread[index] += queued_spreads[j]
  busy = min(slots, n + m)
  return finish.max(axis=0) + expected_max_normal(busy) * np.sqrt(spread.max(axis=0))
