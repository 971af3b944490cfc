"""Compile and run the eviction kernels on a GPU (Pallas' Triton backend) against their jnp
references, then time them.

On a CUDA machine (jaxspec installed, or its requirements plus this checkout):

    pip install -e . 'jax[cuda13]'   # the H200 run: CUDA 13 ('.[cuda]' installs jax[cuda12])
    python scripts/check_kernels_gpu.py

Checks, each against the pure-jnp reference on the same GPU:
  1. paged attention with per-key mass over the unit tests' grid (page sizes, T in {1, 5}, GQA
     groups, lengths on and off page boundaries, shuffled slots) and larger decode / verify shapes,
     in float32 and bfloat16;
  2. the selection kernel, bit for bit (ties, NaN priorities, padding rows);
  3. a whole tiny model under H2O eviction, token by token (`score_tokens`): compiled kernels
     (use_kernel=True, interpret=False) against the jnp path: log-probabilities, argmax and the
     slots kept.
Then prints kernel and reference times (median of timed calls after a warm-up, one run) and their
ratio. Exits 0 when every check passes, 1 on a mismatch or an error, 2 (saying so) when JAX's
default backend is not a GPU. Matmuls inside the Triton kernel may use TF32 on recent GPUs, so
float32 outputs are compared to 1e-2 (bfloat16: 5e-2), not bit for bit.
"""

import argparse
import pathlib
import statistics
import sys
import time
import traceback

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import (BlockSizes, SelectParams, paged_attention_with_mass,
                             paged_attention_with_mass_reference, select_slots,
                             select_slots_reference)
from jaxspec.kernels.paged_attention import key_blocks

# (page_size, pages_per_seq, length, t, group, pages_per_block, batch, kv_heads, head_dim):
# the unit tests' grid, then decode (T=1) and verify (T=5) shapes of a real model's size.
ATTENTION_CASES = [
    (4, 4, 8, 1, 1, 1, 2, 2, 8),
    (4, 4, 11, 5, 3, 2, 2, 2, 8),
    (8, 2, 16, 5, 1, 1, 2, 2, 8),
    (8, 2, 13, 1, 3, 2, 2, 2, 8),
    (16, 2, 21, 5, 2, 1, 2, 2, 8),
    (4, 3, 9, 5, 2, 2, 2, 2, 8),
    (16, 13, 201, 1, 3, 1, 4, 2, 64),
    (16, 8, 121, 5, 3, 2, 4, 2, 64),
    (16, 64, 1017, 5, 1, 4, 4, 2, 64),
    (16, 128, 2048, 1, 4, 4, 8, 8, 128),
    (4, 2, 7, 5, 2, 1, 2, 2, 8),          # key blocks widened past the padded page table
    (8, 1, 5, 1, 1, 1, 2, 2, 8),
]
TOLERANCE = {jnp.float32: 1e-2, jnp.bfloat16: 5e-2}


def _attention_case(rng, page_size, pages_per_seq, length, t, group, batch, kv_heads, head_dim,
                    dtype):
  """Random pools; row 0 holds `length` tokens in slot order, the others at shuffled slots."""
  num_pages = batch * pages_per_seq + 1
  pools = [jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, head_dim)), dtype)
           for _ in range(2)]
  table = jnp.asarray(1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq),
                      jnp.int32)
  s = pages_per_seq * page_size
  key_pos = np.full((batch, s), -1, np.int32)
  for row in range(batch):
    slots = np.arange(length) if row == 0 else rng.permutation(s)[:length]
    key_pos[row, slots] = np.arange(length)
  q_pos = np.tile(np.arange(length - t, length), (batch, 1)).astype(np.int32)
  q_pos[-1, 0] = -1                                    # a padding query in the last row
  q = jnp.asarray(rng.normal(size=(batch, t, kv_heads * group, head_dim)), dtype)
  return q, *pools, table, jnp.asarray(key_pos), jnp.asarray(q_pos)


def check_attention(rng) -> bool:
  ok = True
  for dtype in (jnp.float32, jnp.bfloat16):
    for case in ATTENTION_CASES:
      page_size, pages_per_seq, length, t, group, per_block, batch, kv_heads, head_dim = case
      args = _attention_case(rng, page_size, pages_per_seq, length, t, group, batch, kv_heads,
                             head_dim, dtype)
      blocks = BlockSizes(pages_per_block=per_block)
      out, mass = paged_attention_with_mass(*args, blocks)
      run_block, run_pages = key_blocks(pages_per_seq, page_size, blocks)   # as the kernel ran
      out_ref, mass_ref = paged_attention_with_mass_reference(*args)
      d_out = float(jnp.abs(out.astype(jnp.float32) - out_ref.astype(jnp.float32)).max())
      d_mass = float(jnp.abs(mass - mass_ref).max())
      empty_mass = float(jnp.abs(jnp.where(args[4][:, None] < 0, mass, 0)).max())
      good = d_out < TOLERANCE[dtype] and d_mass < TOLERANCE[dtype] and empty_mass == 0
      ok &= good
      print(f'  attention {jnp.dtype(dtype).name:8s} L={page_size:2d} pages={pages_per_seq:3d} '
            f'len={length:4d} T={t} G={group} block={run_block}/{run_pages} pages: max |out| '
            f'diff {d_out:.1e}, '
            f'max |mass| diff {d_mass:.1e}, mass on empty slots {empty_mass:.0e} '
            f'{"ok" if good else "MISMATCH"}')
  return ok


def check_select(rng) -> bool:
  ok = True
  for seed, (b, s) in enumerate([(4, 13), (4, 16), (3, 208), (8, 1024)]):
    key_pos = np.full((b, s), -1, np.int32)
    free_from = rng.integers(0, s + 5, size=(b, s)).astype(np.int32)
    for row in range(b):
      n = int(rng.integers(0, s + 1))
      key_pos[row, rng.permutation(s)[:n]] = rng.permutation(s + 3)[:n]
    positions = np.full((b,), s + 3, np.int32)
    positions[-1] = -1                                               # a padding row
    priority = rng.integers(0, 4, size=(b, s)).astype(np.float32)    # ties on purpose
    priority[0, : s // 3] = np.nan                                   # NaN counts as lowest
    params = SelectParams(budget=max(6, s // 2), sinks=2, window=3, reuse_delay=seed % 3)
    args = tuple(jnp.asarray(x) for x in (priority, key_pos, free_from, positions))
    got = select_slots(*args, params)
    want = select_slots_reference(*args, params)
    same = all(bool((g == w).all()) for g, w in zip(got, want))
    ok &= same
    print(f'  select B={b} S={s}: equal to the reference: {same}')
  return ok


def check_model() -> bool:
  """A tiny model under H2O, fed token by token: kernels against the jnp path."""
  # pylint: disable=import-outside-toplevel
  from jaxspec.cache import init_eviction, make_policy
  from jaxspec.decoding.evicting import score_tokens
  from jaxspec.models import ModelConfig, cache_for
  from jaxspec.training import init_params
  config = ModelConfig.from_name('test-tiny')
  params = init_params(config, 0)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(3, config.vocab_size, size=(2, 40)), jnp.int32)
  lengths = jnp.asarray([40, 33], jnp.int32)
  page_table = np.arange(1, 9).reshape(2, 4)                       # 4 pages of 4 slots per row
  runs = []
  for use_kernel in (False, True):
    cache = cache_for(config, page_table, 9, 4)
    eviction = init_eviction(make_policy('h2o', 12, sinks=2, window=4), cache,
                             use_kernel=use_kernel, interpret=False)
    runs.append(score_tokens(config, params, cache, eviction, tokens, lengths))
  ref, ker = runs
  d_lp = float(jnp.abs(ref['logprob'] - ker['logprob']).max())
  argmax = float((ref['argmax'] == ker['argmax']).mean())
  kept = float((ref['eviction'].key_pos == ker['eviction'].key_pos).mean())
  live = bool((ref['live'] == ker['live']).all())
  good = d_lp < 1e-2 and argmax == 1 and kept == 1 and live
  print(f'  whole model (test-tiny, H2O budget 12 of 40 tokens): max |logprob| diff {d_lp:.1e}, '
        f'argmax agreement {argmax:.3f}, kept slots equal {kept:.3f}, live counts equal {live} '
        f'{"ok" if good else "MISMATCH"}')
  return good


def _median_ms(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))                                 # compile + warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def benchmark(rng, repeats: int) -> None:
  """Kernel vs reference time on decode (T=1) and verify (T=5) shapes."""
  reference = jax.jit(paged_attention_with_mass_reference)
  for batch, t, kv_heads, group, head_dim, pages_per_seq, per_block in [
      (8, 1, 8, 4, 128, 256, 4), (8, 5, 8, 4, 128, 256, 4), (32, 1, 8, 4, 128, 128, 4)]:
    page_size = 16
    s = pages_per_seq * page_size
    args = _attention_case(rng, page_size, pages_per_seq, s - 3, t, group, batch, kv_heads,
                           head_dim, jnp.bfloat16)
    kernel = jax.jit(lambda *a, n=per_block: paged_attention_with_mass(
        *a, BlockSizes(pages_per_block=n)))
    k_ms, r_ms = _median_ms(kernel, args, repeats), _median_ms(reference, args, repeats)
    kv_bytes = 2 * batch * kv_heads * s * head_dim * 2
    print(f'  bf16 B={batch} T={t} KV heads={kv_heads} G={group} H={head_dim} S={s}: kernel '
          f'{k_ms:.3f} ms ({kv_bytes / k_ms / 1e6:.0f} GB/s of K+V), reference {r_ms:.3f} ms, '
          f'reference / kernel {r_ms / k_ms:.2f}x')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  parser.add_argument('--repeats', type=int, default=50, help='timed calls per benchmark (0: none)')
  args = parser.parse_args(argv)
  print('jax', jax.__version__, 'devices:', jax.devices())
  if jax.default_backend() != 'gpu':
    print(f'needs a GPU: the default JAX backend is {jax.default_backend()!r} (on CPU the kernels '
          'run only in interpret mode; tests/test_kernels_eviction.py covers that)')
    return 2
  rng = np.random.default_rng(0)
  ok = True
  for name, check in (('attention kernel', check_attention), ('selection kernel', check_select),
                      ('whole model', lambda _: check_model())):
    print(f'{name}:')
    try:
      ok &= check(rng)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      ok = False
  if args.repeats > 0:
    print('timing (median of timed calls, one run):')
    try:
      benchmark(rng, args.repeats)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      ok = False
  print('all checks passed' if ok else 'FAILED')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
