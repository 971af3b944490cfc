"""The eviction selection step, as a Pallas kernel: under a budget, drop the lowest-priority cached
token outside the attention sinks and the recent window, and pick the slot the new token goes to.

One program per sequence, one new token per call (decode; verification calls it once per query
token, in order). For the token at position p:

1. live = slots holding a token (key_pos >= 0). If there are `budget` or more, evict the live slot
   of lowest priority among the candidates: key_pos >= sinks and key_pos < p - window (ties: the
   oldest position, so a decision does not depend on which slot a token landed in). Its position
   becomes -1 and it is free for tokens at positions >= p + reuse_delay (a delay of K+1 keeps a
   verification round from overwriting a token a rejected draft position evicted, so speculative
   decoding can roll eviction back).
2. The new token takes the lowest-index free slot whose delay has passed; its position is set.

Padding (p < 0) changes nothing and gets slot -1. The priority is the policy's (H2O: accumulated
attention, TOVA: the last query's attention, sliding window: the position); see
`jaxspec.cache.eviction`. Backends checked: interpret mode on CPU, and Pallas' Triton backend,
compiled and run on an NVIDIA H200 (bit for bit equal to the reference, ties and NaN priorities
included; scripts/check_kernels_gpu.py). 1-D power-of-two blocks: the slot axis is padded; min
reductions, no argmin or sort.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxspec.checks import check_array, check_int


INT32_MAX = 2 ** 31 - 1   # positions and budgets are int32 on device


@dataclasses.dataclass(frozen=True)
class SelectParams:
  """Static parameters of the selection (`EvictionPolicy.select_params` builds them).

  Attributes:
    budget: live tokens kept per sequence, the new one included (tokens).
    sinks: first positions never evicted (StreamingLLM's attention sinks).
    window: most recent positions before the new token never evicted.
    reuse_delay: positions an evicted slot waits before it is written again.

  Raises:
    ValueError: a field not an int, budget < 1, sinks / window / reuse_delay < 0, a field past
      int32 (`INT32_MAX`), or budget <
      sinks + window + 1 (no token could ever be evicted, so more than budget would stay live).
  """

  budget: int
  sinks: int = 0
  window: int = 0
  reuse_delay: int = 0

  def __post_init__(self):
    for name, low in (('budget', 1), ('sinks', 0), ('window', 0), ('reuse_delay', 0)):
      # Stored as Python ints: the params are a static (hashed) argument of the jitted selection.
      value = check_int(f'SelectParams.{name}', getattr(self, name), low)
      if value > INT32_MAX:      # compared with int32 positions on device: an OverflowError
        raise ValueError(f'SelectParams.{name}={value} exceeds the int32 positions it is '
                         f'compared with (at most {INT32_MAX})')
      object.__setattr__(self, name, value)
    if self.budget < self.sinks + self.window + 1:
      raise ValueError(f'SelectParams.budget={self.budget} must be >= sinks + window + 1 = '
                       f'{self.sinks + self.window + 1}: otherwise no token is ever evictable')


def _select(priority, key_pos, free_from, p, params: SelectParams):
  """Shared body of kernel and reference: [S] arrays of one sequence, p a scalar int32."""
  s = key_pos.shape[0]
  idx = jax.lax.broadcasted_iota(jnp.int32, (s,), 0)
  live = key_pos >= 0
  must_evict = (p >= 0) & (jnp.sum(live.astype(jnp.int32)) >= params.budget)
  candidate = live & (key_pos >= params.sinks) & (key_pos < p - params.window) & must_evict
  # A NaN priority (a model that produced NaN) counts as lowest, so a slot is still freed.
  masked = jnp.where(candidate, jnp.where(jnp.isnan(priority), -jnp.inf, priority), jnp.inf)
  lowest = jnp.min(masked)
  tied = candidate & (masked == lowest)
  oldest = jnp.min(jnp.where(tied, key_pos, jnp.iinfo(jnp.int32).max))   # live positions differ
  victim = jnp.min(jnp.where(tied & (key_pos == oldest), idx, s))
  evicted = idx == victim
  key_pos = jnp.where(evicted, -1, key_pos)
  free_from = jnp.where(evicted, p + params.reuse_delay, free_from)
  writable = (key_pos < 0) & (free_from <= p) & (p >= 0)
  slot = jnp.min(jnp.where(writable, idx, s))
  key_pos = jnp.where(idx == slot, p, key_pos)
  return key_pos, free_from, jnp.where(victim < s, victim, -1), jnp.where(slot < s, slot, -1)


def _kernel(priority_ref, key_pos_ref, free_from_ref, pos_ref,
            key_pos_out, free_from_out, victim_out, slot_out, *, params: SelectParams):
  # priority_ref:  [S] float32  keep priority of each slot (higher = keep)
  # key_pos_ref:   [S] int32    position held by each slot, -1 = empty
  # free_from_ref: [S] int32    first position allowed to write each empty slot
  # pos_ref:       [1] int32    position of the new token (-1 = padding)
  # key_pos_out, free_from_out: [S] int32 updated; victim_out, slot_out: [1] int32 (-1 = none)
  key_pos, free_from, victim, slot = _select(priority_ref[...], key_pos_ref[...],
                                             free_from_ref[...], pos_ref[0], params)
  key_pos_out[...] = key_pos
  free_from_out[...] = free_from
  victim_out[...] = jnp.full((1,), victim, jnp.int32)
  slot_out[...] = jnp.full((1,), slot, jnp.int32)


def _check(priority, key_pos, free_from, positions, params=None, interpret=False):
  check_array('priority', priority, 'float')
  for name, x in (('key_pos', key_pos), ('free_from', free_from), ('positions', positions)):
    check_array(name, x, 'integer')
  if params is not None and not isinstance(params, SelectParams):
    raise ValueError(f'params must be a SelectParams, got {params!r}')
  if not isinstance(interpret, bool):
    raise ValueError(f'interpret must be True or False, got {interpret!r}')
  shapes = [jnp.shape(x) for x in (priority, key_pos, free_from, positions)]
  if len(shapes[1]) != 2 or shapes[0] != shapes[1] or shapes[2] != shapes[1] or \
      shapes[3] != shapes[1][:1]:
    raise ValueError(f'priority {shapes[0]}, key_pos {shapes[1]} and free_from {shapes[2]} must '
                     f'be one shape [B, S] and positions {shapes[3]} [B]')


def select_slots(priority, key_pos, free_from, positions, params: SelectParams, *,
                 interpret: bool = False):
  """Evict (at most one token per sequence) and choose the slot of each sequence's new token.

  Args:
    priority: [B, S] float32 keep priority (higher = keep).
    key_pos: [B, S] int32 position in each slot, -1 = empty.
    free_from: [B, S] int32 first position allowed to write each slot.
    positions: [B] int32 position of each sequence's new token, -1 = padding.
    params: static `SelectParams`.
    interpret: run in the Pallas interpreter (CPU).
  Returns:
    key_pos [B, S] (victim -1, new slot = its position), free_from [B, S], victim [B] int32 and
    slot [B] int32 (-1 when nothing was evicted / no slot is free). A batch of B = 0 gives
    empty results.
  Raises:
    ValueError: an argument that is not an array, priority not float or the others not integer,
      priority, key_pos and free_from not all of one shape [B, S], positions not [B], params
      not a SelectParams, interpret not a bool.
  """
  _check(priority, key_pos, free_from, positions, params, interpret)
  return _select_slots(priority, key_pos, free_from, positions, params, interpret=interpret)


@functools.partial(jax.jit, static_argnames=('params', 'interpret'))
def _select_slots(priority, key_pos, free_from, positions, params: SelectParams, *,
                  interpret: bool):
  b, s = key_pos.shape
  if b == 0:                                   # a grid of no programs: nothing to select
    empty = jnp.zeros((0,), jnp.int32)
    return key_pos.astype(jnp.int32), free_from.astype(jnp.int32), empty, empty
  pad = (1 << max(0, (s - 1).bit_length())) - s     # power-of-two blocks for Triton
  never = jnp.iinfo(jnp.int32).max                   # padded slots: empty, never writable
  priority = jnp.pad(priority.astype(jnp.float32), ((0, 0), (0, pad)))
  key_pos = jnp.pad(key_pos.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
  free_from = jnp.pad(free_from.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=never)
  row = pl.BlockSpec((None, s + pad), lambda i: (i, 0))
  one = pl.BlockSpec((None, 1), lambda i: (i, 0))
  key_pos, free_from, victim, slot = pl.pallas_call(
      functools.partial(_kernel, params=params),
      grid=(b,),
      in_specs=[row, row, row, one],
      out_specs=[row, row, one, one],
      out_shape=[jax.ShapeDtypeStruct((b, s + pad), jnp.int32),
                 jax.ShapeDtypeStruct((b, s + pad), jnp.int32),
                 jax.ShapeDtypeStruct((b, 1), jnp.int32), jax.ShapeDtypeStruct((b, 1), jnp.int32)],
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
  )(priority, key_pos, free_from, positions.astype(jnp.int32)[:, None])
  return key_pos[:, :s], free_from[:, :s], victim[:, 0], slot[:, 0]


def _select_reference(priority, key_pos, free_from, p, params: SelectParams):
  live = key_pos >= 0
  must_evict = (p >= 0) & (live.sum() >= params.budget)
  candidate = live & (key_pos >= params.sinks) & (key_pos < p - params.window)
  priority = jnp.where(jnp.isnan(priority), -jnp.inf, priority)    # NaN: lowest (as the kernel)
  masked = jnp.where(candidate, priority, jnp.inf)
  # The oldest candidate of lowest priority; argmin alone would pick slot 0 (maybe no candidate)
  # when every candidate's priority is +inf.
  tied = candidate & (masked == masked.min())
  victim = jnp.argmax(tied & (key_pos == jnp.where(tied, key_pos, jnp.iinfo(jnp.int32).max).min()))
  victim = jnp.where(must_evict & candidate.any(), victim, -1)
  key_pos = key_pos.at[victim].set(jnp.where(victim >= 0, -1, key_pos[victim]))
  free_from = free_from.at[victim].set(
      jnp.where(victim >= 0, p + params.reuse_delay, free_from[victim]))
  writable = (key_pos < 0) & (free_from <= p) & (p >= 0)
  slot = jnp.where(writable.any(), jnp.argmax(writable), -1)
  key_pos = key_pos.at[slot].set(jnp.where(slot >= 0, p, key_pos[slot]))
  return key_pos, free_from, victim.astype(jnp.int32), slot.astype(jnp.int32)


def select_slots_reference(priority, key_pos, free_from, positions, params: SelectParams):
  """Pure-jnp reference of `select_slots` (argmax, vmapped over the batch): same args, results
  and errors."""
  _check(priority, key_pos, free_from, positions, params)
  if key_pos.shape[1] == 0:                    # no slot: nothing to evict or write
    none = jnp.full(key_pos.shape[:1], -1, jnp.int32)
    return key_pos.astype(jnp.int32), free_from.astype(jnp.int32), none, none
  return jax.vmap(lambda a, b, c, d: _select_reference(a, b, c, d, params))(
      priority.astype(jnp.float32), key_pos.astype(jnp.int32), free_from.astype(jnp.int32),
      positions.astype(jnp.int32))
