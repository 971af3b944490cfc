"""The output buffer of a compiled generation loop, and the one place tokens are committed to it.

Both the autoregressive and the speculative loops commit through `commit`, so stop tokens and
max_new_tokens are handled identically: tokens after a stop token, or past max_new_tokens, are
never emitted (not even a speculative bonus token).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import INVALID_TOKEN


@flax.struct.dataclass
class Output:
  """Tokens emitted so far.

  Fields:
    tokens: [B, N] int32, N = max_new_tokens + window slack; valid up to num_tokens.
    num_tokens: [B] int32 tokens emitted per row.
    done: [B] bool, row hit a stop token, max_new_tokens or INVALID_TOKEN (its logits were not
      finite: the row's last token is then INVALID_TOKEN, which the host checks with
      `check_valid`).
  """

  tokens: jax.Array
  num_tokens: jax.Array
  done: jax.Array

  @classmethod
  def empty(cls, batch: int, capacity: int) -> 'Output':
    """No tokens yet: [batch, capacity] buffer, nothing done."""
    return cls(tokens=jnp.zeros((batch, capacity), jnp.int32),
               num_tokens=jnp.zeros((batch,), jnp.int32),
               done=jnp.zeros((batch,), bool))


def cut_lengths(window, num_candidates, stop_tokens, room):
  """How many of each row's candidate tokens are emitted: up to and including the first stop
  token or INVALID_TOKEN (a row whose logits were not finite ends there, so the host sees it as
  the row's last token), and at most `room` (the rule every decode loop shares).

  Args:
    window: [B, W] int32 candidate tokens, in order.
    num_candidates: [B] int32 in [0, W], how many of them are real.
    stop_tokens: [S] int32 stop ids shared by every row, or [B, S] int32 per row (-1 pads).
    room: [B] int32 tokens each row may still emit (max_new_tokens - emitted so far).
  Returns:
    (n [B] int32 tokens to emit, stopped [B] bool: a stop token is among them).
  """
  w = window.shape[1]
  idx = jnp.arange(w, dtype=jnp.int32)
  if stop_tokens.ndim == 1:
    is_stop = jnp.isin(window, stop_tokens)
  else:
    is_stop = (window[:, :, None] == stop_tokens[:, None, :]).any(axis=-1)
  is_stop |= window == INVALID_TOKEN
  is_stop &= idx[None, :] < num_candidates[:, None]
  stop_cut = jnp.where(is_stop.any(axis=1), jnp.argmax(is_stop, axis=1) + 1, w + 1)
  n = jnp.minimum(jnp.minimum(num_candidates, stop_cut), room).astype(jnp.int32)
  return n, stop_cut <= n


def commit(out: Output, window, num_candidates, stop_tokens, max_new_tokens: int):
  """Append up to `num_candidates` tokens of `window` to each row that is not done.

  A row's commit stops after the first stop token (which is emitted) and at max_new_tokens.

  Args:
    out: the buffer; its capacity must be >= max_new_tokens + W.
    window: [B, W] int32 candidate tokens, in order.
    num_candidates: [B] int32 in [1, W], how many of them are real.
    stop_tokens: [S] int32 stop token ids (S may be 0).
    max_new_tokens: static int.
  Returns:
    (out, num_emitted [B] int32): the updated buffer and the tokens actually appended per row.
  """
  n, stopped = cut_lengths(window, num_candidates, stop_tokens, max_new_tokens - out.num_tokens)
  n = jnp.where(out.done, 0, n).astype(jnp.int32)
  tokens = jax.vmap(lambda row, win, start: jax.lax.dynamic_update_slice(row, win, (start,)))(
      out.tokens, window, out.num_tokens)
  num_tokens = out.num_tokens + n
  done = out.done | stopped | (num_tokens >= max_new_tokens)
  return Output(tokens=tokens, num_tokens=num_tokens, done=done), n


class NonFiniteLogitsError(FloatingPointError):
  """A model's logits were not finite (NaN or +inf; a float16 model whose activations overflow,
  NaN weights) or left no token to draw, so the row drew INVALID_TOKEN instead of a token."""


def non_finite_message(where: str, model: str = 'model') -> str:
  """The one wording of a NonFiniteLogitsError (`check_valid`, the engine's failed requests):
  `where` names the row and token, e.g. 'prompt 2 at token 5'."""
  return (f'the {model}\'s logits were not finite (NaN or +inf) or allowed no token for {where}: '
          f'a float16 model that overflows, or NaN weights? Compare it with its float32 or '
          f'bfloat16 twin')


def draft_failed_message(rounds: int, total: int, what: str = 'the draft') -> str:
  """The wording for a draft whose logits were NaN or +inf in `rounds` of `total` rounds
  (`GenerationResult.check_draft`, generate's warning, the engine's requests)."""
  return (f'{what}\'s logits were not finite (NaN or +inf) in {rounds} of {total} rounds: its '
          f'proposals there were rejected, so the tokens are the target\'s, but α and speedup '
          f'measure a broken draft (a float16 draft that overflows, or NaN weights?)')


def check_valid(rows, what: str = 'prompt') -> None:
  """Raise unless every row of emitted tokens is made of real tokens.

  Args:
    rows: per row, its emitted token ids (Python ints).
    what: what a row is, for the message ('prompt', 'request', ...; numbered when there are
      several rows).
  Raises:
    NonFiniteLogitsError: naming the rows (by index) whose model logits were not finite, and
      at which of their tokens.
  """
  bad = [i for i, row in enumerate(rows) if len(row) and row[-1] == INVALID_TOKEN]
  if bad:
    label = (lambda i: what) if len(rows) == 1 else (lambda i: f'{what} {i}')
    where = ', '.join(f'{label(i)} at token {len(rows[i]) - 1}' for i in bad[:8])
    more = f' and {len(bad) - 8} more' if len(bad) > 8 else ''
    raise NonFiniteLogitsError(non_finite_message(where + more))
