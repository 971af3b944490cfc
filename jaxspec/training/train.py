"""Next-token training with optax: AdamW, linear warmup + cosine decay, global-norm clipping."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from jaxspec.checks import check_int, check_real, is_int_in, seed_key
from jaxspec.data import random_windows
from jaxspec.models import ModelConfig, Transformer
from jaxspec.training import resume


def lm_loss(params, config: ModelConfig, windows):
  """Mean next-token cross-entropy (nats/token).

  Args:
    windows: [B, T+1] int32 token windows; inputs are windows[:, :-1], targets windows[:, 1:].
  Returns:
    scalar float32.
  """
  inputs, targets = windows[:, :-1], windows[:, 1:]
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
  logits, _ = Transformer(config).apply(params, inputs, positions, None)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(*, learning_rate: float, warmup_steps: int, total_steps: int,
                   weight_decay: float = 0.1, grad_clip: float = 1.0):
  """AdamW (b2 = 0.95) on a warmup + cosine schedule, after clipping the global gradient norm."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=max(total_steps, warmup_steps + 1), end_value=learning_rate * 0.1)
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


def init_params(config: ModelConfig, seed: int):
  """Fresh float32 params of `config`."""
  tokens = jnp.zeros((1, 8), jnp.int32)
  positions = jnp.arange(8, dtype=jnp.int32)[None]
  return Transformer(config).init(seed_key(seed), tokens, positions, None)


def evaluate(params, config: ModelConfig, tokens: np.ndarray, *, batch_size: int, seq_len: int,
             num_batches: int, seed: int = 1234) -> float:
  """Mean loss (nats/token) over `num_batches` fixed random windows of a held-out stream."""
  rng = np.random.default_rng(seed)
  loss = jax.jit(lm_loss, static_argnums=1)
  losses = [float(loss(params, config, random_windows(tokens, batch_size, seq_len, rng)))
            for _ in range(num_batches)]
  return float(np.mean(losses))


def _check_stream(name: str, tokens, vocab_size: int, seq_len: int) -> None:
  """Raises ValueError naming `name` unless `tokens` is a 1-D integer array of at least one
  window's seq_len + 1 ids in [0, V)."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or tokens.dtype == np.bool_ or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f'{name} must be a 1-D integer array of token ids, got shape {tokens.shape} '
                     f'dtype {tokens.dtype}')
  if tokens.shape[0] < seq_len + 1:
    raise ValueError(f'{name} holds {tokens.shape[0]} ids, shorter than one window of '
                     f'seq_len + 1 = {seq_len + 1}')
  bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
  if bad.size:
    raise ValueError(f'{name}[{bad[0]}] = {tokens[bad[0]]} is outside the vocabulary '
                     f'[0, {vocab_size}) ({bad.size} such ids)')


def check_settings(config: ModelConfig, *, steps, batch_size, seq_len, learning_rate,
                   warmup_steps, weight_decay, grad_clip, seed, eval_batches, checkpoint_every):
  """`train`'s scalar arguments, checked (before any data is read: the train experiment checks
  its config with it) and converted.

  Returns:
    (steps, batch_size, seq_len, learning_rate, warmup_steps, weight_decay, grad_clip, seed,
    eval_batches, checkpoint_every) as ints and floats.
  Raises:
    ValueError: as `train` says for each.
  """
  steps, batch_size = check_int('steps', steps, 1), check_int('batch_size', batch_size, 1)
  seq_len = check_int('seq_len', seq_len, 1)
  eval_batches = check_int('eval_batches', eval_batches, 1)
  warmup_steps = check_int('warmup_steps', warmup_steps, 0)
  if warmup_steps >= steps:     # optax counts updates from 0: the last is lr * (steps - 1) / W
    raise ValueError(f'warmup_steps={warmup_steps} must be below steps={steps}: the learning '
                     f'rate would never reach learning_rate')
  learning_rate = check_real('learning_rate', learning_rate, 0.0, math.inf, high_open=True)
  if learning_rate == 0.0:
    raise ValueError('learning_rate must be > 0, got 0.0')
  weight_decay = check_real('weight_decay', weight_decay, 0.0, math.inf, high_open=True)
  grad_clip = check_real('grad_clip', grad_clip, 0.0, math.inf, high_open=True)
  if grad_clip == 0.0:
    raise ValueError('grad_clip must be > 0, got 0.0')
  checkpoint_every = check_int('checkpoint_every', checkpoint_every, 0)
  if seq_len > config.max_seq_len:
    raise ValueError(f'seq_len={seq_len} exceeds the model context {config.max_seq_len}')
  if not is_int_in(seed, 0, 2 ** 63 - 1):    # numpy's window sampler takes no negative seed
    raise ValueError(f'seed must be an int in [0, 2**63), got {seed!r}')
  return (steps, batch_size, seq_len, learning_rate, warmup_steps, weight_decay, grad_clip,
          int(seed), eval_batches, checkpoint_every)


def train(config: ModelConfig, train_tokens: np.ndarray, val_tokens: np.ndarray, *, steps: int,
          batch_size: int, seq_len: int, learning_rate: float, warmup_steps: int,
          weight_decay: float = 0.1, grad_clip: float = 1.0, seed: int = 0,
          eval_batches: int = 8, params=None, progress: bool = True,
          checkpoint_dir=None, checkpoint_every: int = 0):
  """Train `config` on random windows of `train_tokens`.

  Args:
    train_tokens, val_tokens: [N] int32 token streams.
    steps, batch_size, seq_len: optimisation steps, windows per step, tokens per window.
    params: optional params to continue from (fresh ones otherwise).
    checkpoint_dir: a directory for a resumable state (`resume.TrainState`: params, optimizer
      state, steps done), written every `checkpoint_every` steps (0: only at the end). A call
      that finds a state there written with the same arguments (sizes, rates, seed, every
      field of `config`, a SHA-256 of train_tokens) continues from it, the window
      sampler replayed to its step, so an interrupted run resumed gives the params an
      uninterrupted one would have.
  Returns:
    (params, info): info holds steps, resumed_at_step (steps a resumed state had done; 0 for a
    fresh run), train_tokens (tokens consumed by all steps), seconds (of this call's steps
    only), final train loss and the held-out val_loss (nats/token).
  Raises:
    ValueError: for non-positive sizes, a learning rate that is not a finite number > 0, a
      weight decay or warmup that is negative (or not finite), warmup_steps >= steps, a
      grad_clip that is not > 0, a stream that is not a 1-D integer array or holds an id
      outside [0, vocab_size) (named: an id past the table gave NaN, a negative one wrapped to
      the last rows silently), a
      stream shorter than one window (both checked before step 1), a seed that is not an int
      in [0, 2**63); FloatingPointError: a final train or val loss that is not
      finite (diverged: the params are not worth saving); CheckpointError: a state in
      checkpoint_dir written with other arguments, or unreadable.
  """
  (steps, batch_size, seq_len, learning_rate, warmup_steps, weight_decay, grad_clip, seed,
   eval_batches, checkpoint_every) = check_settings(
       config, steps=steps, batch_size=batch_size, seq_len=seq_len, learning_rate=learning_rate,
       warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip, seed=seed,
       eval_batches=eval_batches, checkpoint_every=checkpoint_every)
  for name, stream in (('train_tokens', train_tokens), ('val_tokens', val_tokens)):
    _check_stream(name, stream, config.vocab_size, seq_len)
  params = init_params(config, seed) if params is None else params
  optimizer = make_optimizer(learning_rate=learning_rate, warmup_steps=warmup_steps,
                             total_steps=steps, weight_decay=weight_decay, grad_clip=grad_clip)
  opt_state = optimizer.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, windows):
    loss, grads = jax.value_and_grad(lm_loss)(params, config, windows)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  loss, done = jnp.nan, 0
  state = None
  if checkpoint_dir is not None:
    state = resume.TrainState(checkpoint_dir, dict(
        steps=steps, batch_size=batch_size, seq_len=seq_len, learning_rate=learning_rate,
        warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip, seed=seed,
        num_params=config.num_params, train_tokens=int(len(train_tokens)),
        train_tokens_sha256=hashlib.sha256(np.ascontiguousarray(train_tokens)).hexdigest(),
        **{f'model.{k}': v for k, v in dataclasses.asdict(config).items()}))
    restored = state.restore(params, opt_state)
    if restored is not None:
      params, opt_state, done, loss = restored
      for _ in range(done):        # the sampler where the interrupted run left it
        random_windows(train_tokens, batch_size, seq_len, rng)
  start = time.perf_counter()
  bar = tqdm.trange(done, steps, desc=f'train {config.num_params / 1e6:.1f}M',
                    disable=not progress)
  for i in bar:
    params, opt_state, loss = step(params, opt_state,
                                   random_windows(train_tokens, batch_size, seq_len, rng))
    if i % 20 == 0 or i == steps - 1:
      bar.set_postfix(loss=f'{float(loss):.3f}')
    if state is not None and (i == steps - 1 or (checkpoint_every and
                                                 (i + 1) % checkpoint_every == 0)):
      state.save(params, opt_state, i + 1, float(loss))
  seconds = time.perf_counter() - start
  val_loss = evaluate(params, config, val_tokens, batch_size=batch_size, seq_len=seq_len,
                      num_batches=eval_batches)
  info = dict(steps=steps, resumed_at_step=done, train_tokens=steps * batch_size * seq_len,
              seconds=round(seconds, 1),
              train_loss=float(loss), val_loss=val_loss, num_params=config.num_params)
  if not (math.isfinite(info['train_loss']) and math.isfinite(val_loss)):
    raise FloatingPointError(f'training diverged: final train loss {info["train_loss"]}, val loss '
                             f'{val_loss} (learning_rate={learning_rate}); nothing is returned')
  return params, info
