"""The engine's device steps: pure functions over the shared page pools, jitted once per static
shape (rows, chunk size, K) and never per request.

The host binds each call's page table and lengths to the caches (`bind`), so the scheduler's
integers are the single source of truth and a request can move between slots freely. Rows with
nothing to do get the null page table row and length 0 (`idle_rows`): whatever they compute is
written to the null page 0 and discarded, so they never touch pages holding live data.

Built from `jaxspec.decoding`: `prefill` (each row starts at its cache length; rows with zero new
tokens are padding), `decode_step`, `probabilities` / `sample`, and `cut_lengths` (stop tokens,
max tokens). A row whose target logits are not finite draws INVALID_TOKEN, which ends its window
(`rounds.emit` fails that request alone). The speculative steps (draft model, prompt lookup,
K = 0 with a draft) are in `jaxspec.engine.spec_steps`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import NULL_PAGE
from jaxspec.checks import is_int_in
from jaxspec.decoding.autoregressive import decode_step, prefill_logits
from jaxspec.decoding.output import cut_lengths
from jaxspec.decoding.sampling import RowSampling, probabilities, sample
from jaxspec.models import ModelConfig


def bind(caches, page_table: np.ndarray, lengths: np.ndarray) -> list:
  """Give each cache (target, draft) this call's page table and lengths as host (numpy) arrays:
  the jitted call copies each to the device in its C++ argument path (~5 us), where a
  `jnp.asarray` per array before it cost ~30 us of Python each (~10 % of a round's host time
  on the development CPU, two per cache per round); each call gets its own device copies, so
  donating them is safe.

  Args:
    page_table: [R, pages_per_seq] int32; lengths: [R] int32 tokens cached per row.
  """
  page_table, lengths = np.asarray(page_table, np.int32), np.asarray(lengths, np.int32)
  return [None if c is None else c.replace(page_table=page_table, lengths=lengths)
          for c in caches]


def fetch(values: tuple) -> tuple:
  """Read a device call's results back to the host together.

  On the CPU backend a device array already lives in host memory: `np.asarray` of each costs
  ~1 us, where `jax.device_get` first starts an asynchronous copy of each (~9 us apiece alone,
  44 us for a round's five [B] results on the development CPU; a scratch timer inside the
  engine, where host work right after a device call runs slower: 269 against 66 us median per
  K >= 1 round). On an accelerator `jax.device_get` overlaps the device-to-host copies, which
  `np.asarray` one by one would wait for in turn.

  Args:
    values: a tuple of jax arrays of any shape and dtype, or None.
  Returns:
    a tuple of the same length: read-only numpy arrays (same shapes and dtypes), None kept.
    Waits until the call that computes them has finished; raises what that call raised.
  """
  if _cpu_backend():
    return tuple(None if v is None else np.asarray(v) for v in values)
  return tuple(jax.device_get(values))


@functools.cache
def _cpu_backend() -> bool:
  return jax.default_backend() == 'cpu'


def idle_rows(rows: int, pages_per_seq: int):
  """(page_table [rows, pages_per_seq], lengths [rows]) of rows that do nothing: the null page."""
  return (np.full((rows, pages_per_seq), NULL_PAGE, np.int32), np.zeros((rows,), np.int32))


def prefill_buckets(prefill_rows: int) -> tuple:
  """The sorted row counts a prefill call is compiled for (`Engine(prefill_rows=...)`): the powers
  of two below prefill_rows, and prefill_rows (>= 1, checked by the caller)."""
  return tuple(sorted({1 << i for i in range(prefill_rows.bit_length()) if 1 << i < prefill_rows}
                      | {prefill_rows}))


def decode_buckets(num_slots: int, buckets) -> tuple:
  """The sorted row counts a decode round is compiled for (`Engine(decode_buckets=...)`):
  `buckets` checked (ints in [1, num_slots], num_slots among them), or by default num_slots // 4^i
  while >= 1 (8 slots: 2 and 8; 16: 1, 4 and 16; so not always down to 1). Raises ValueError
  naming a bad value."""
  if buckets is None:
    return tuple(sorted({num_slots // 4 ** i for i in range(num_slots.bit_length())
                         if num_slots // 4 ** i >= 1}))
  try:
    made = tuple(sorted(set(buckets)))
  except TypeError:
    raise ValueError(f'decode_buckets must be a sequence of ints, got {buckets!r}') from None
  bad = [b for b in made if not is_int_in(b, 1, num_slots)]
  if bad or num_slots not in made:
    raise ValueError(f'decode_buckets={buckets!r} must be ints in [1, num_slots={num_slots}] '
                     f'including num_slots')
  return tuple(int(b) for b in made)     # numpy ints too, as plain ints


@functools.partial(jax.jit, static_argnames=('target', 'draft'),
                   donate_argnames=('target_cache', 'draft_cache'))
def prefill_chunk(target: ModelConfig, draft, target_params, draft_params, target_cache,
                  draft_cache, tokens, counts, rng, sampling: RowSampling):
  """One chunk of prefill for up to R requests, in the target and (when given) the draft.

  Args:
    target, draft: static configs (draft None: no draft cache).
    target_cache, draft_cache: bound caches (donated); row r holds lengths[r] tokens already.
    tokens: [R, C] int32 new tokens, right-padded; counts: [R] int32 real tokens per row (0: an
      idle row, which must be bound to the null page).
    rng: PRNG key.
    sampling: each row's request's parameters ([R] arrays; traced, so any mix shares a compile).
  Returns:
    (next_token [R] int32 drawn from the target at each row's last new token: the request's first
    token when this chunk ends its prompt; max_p [R] float32 the target's top probability there,
    as `decode_round` gives it (the first token's confidence); target_cache, draft_cache).
  """
  last, target_cache = prefill_logits(target, target_params, target_cache, tokens, counts)
  if draft is not None:
    _, draft_cache = prefill_logits(draft, draft_params, draft_cache, tokens, counts)
  return sample(rng, probabilities(last, sampling)), top_probability(last), target_cache, \
      draft_cache


def top_probability(logits):
  """max softmax(logits) over the last axis, float32 (the model's own confidence, whatever the
  sampling): [..., V] -> [...]."""
  logits = logits.astype(jnp.float32)
  return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


@functools.partial(jax.jit, static_argnames=('target',), donate_argnames=('target_cache',))
def decode_round(target: ModelConfig, target_params, target_cache, pending, room, stop, rng,
                 sampling: RowSampling):
  """One autoregressive step for every row (the K = 0 baseline of continuous batching).

  Args:
    target_cache: bound cache (donated); row b holds every committed token but `pending[b]`.
    pending: [B] int32 last committed token per row (input of this step).
    room: [B] int32 tokens each row may still emit; 0 marks an idle row (bound to the null page).
    stop: [B, S] int32 stop ids per row, -1 padded.
    sampling: [B] per-row parameters (traced).
  Returns:
    (window [B, 1] int32 the sampled token, emitted [B] int32 0 or 1, token_p [B] float32 the
    probability p(token) it was drawn with (1 for greedy rows; a lazy draft cache scores its
    draft against it later, `jaxspec.engine.draft_sync`), max_p [B] float32 the model's own
    top probability max softmax(logits) whatever the sampling (its confidence, which goes with
    the draft's acceptance: `jaxspec.engine.acceptance.AlphaTracker.confidence_shift`),
    target_cache).
  """
  logits, target_cache = decode_step(target, target_params, target_cache, pending)
  p = probabilities(logits, sampling)
  window = sample(rng, p)[:, None]
  emitted, _ = cut_lengths(window, jnp.ones_like(room), stop, room)
  return window, emitted, jnp.take_along_axis(p, window, axis=1)[:, 0], top_probability(logits), \
      target_cache


def compile_counts() -> dict:
  """Compiled variants of each device step in this process (the jit caches' sizes): a test
  checks that new requests of new lengths add none."""
  from jaxspec.engine import spec_steps  # the drafters' steps (spec_steps imports nothing here)
  return {f.__name__: f._cache_size() for f in (prefill_chunk, decode_round) + spec_steps.STEPS}
