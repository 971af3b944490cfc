"""Compile and run the eviction kernels on a GPU (Pallas' Triton backend) against their jnp
references.

Not run in this project so far (no GPU was available); on a CUDA machine:

    pip install -e '.[cuda]'  # or jax[cuda13]
    python scripts/check_kernels_gpu.py

Prints the largest differences and exits 1 if a kernel disagrees with its reference, 2 (saying
so) when JAX's default backend is not a GPU.
"""

import argparse
import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import (BlockSizes, SelectParams, paged_attention_with_mass,
                             paged_attention_with_mass_reference, select_slots,
                             select_slots_reference)


def main() -> int:
  print('devices:', jax.devices())
  if jax.default_backend() != 'gpu':
    print(f'needs a GPU: the default JAX backend is {jax.default_backend()!r} (on CPU the kernels '
          'run only in interpret mode; tests/test_kernels_eviction.py covers that)')
    return 2
  rng = np.random.default_rng(0)
  ok = True
  for t, group, pages_per_seq, pages_per_block in [(1, 3, 13, 1), (5, 3, 8, 2), (5, 1, 64, 4)]:
    b, kv_heads, h, page_size = 4, 2, 64, 16
    num_pages = b * pages_per_seq + 1
    pools = [jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, h)), jnp.float32)
             for _ in range(2)]
    table = jnp.asarray(1 + rng.permutation(b * pages_per_seq).reshape(b, pages_per_seq),
                        jnp.int32)
    s = pages_per_seq * page_size
    length = s - 7
    key_pos = np.full((b, s), -1, np.int32)
    for row in range(b):
      key_pos[row, rng.permutation(s)[:length]] = np.arange(length)
    q_pos = jnp.asarray(np.tile(np.arange(length - t, length), (b, 1)), jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, t, kv_heads * group, h)), jnp.float32)
    args = (q, *pools, table, jnp.asarray(key_pos), q_pos)
    out, mass = paged_attention_with_mass(*args, BlockSizes(pages_per_block=pages_per_block))
    out_ref, mass_ref = paged_attention_with_mass_reference(*args)
    d_out, d_mass = float(jnp.abs(out - out_ref).max()), float(jnp.abs(mass - mass_ref).max())
    print(f'attention T={t} G={group} pages={pages_per_seq}: max |out| diff {d_out:.2e}, '
          f'max |mass| diff {d_mass:.2e}')
    ok &= d_out < 1e-2 and d_mass < 1e-2          # TF32 dots on recent GPUs: loose tolerance
    params = SelectParams(budget=length - 3, sinks=4, window=16, reuse_delay=2)
    prio = jnp.asarray(rng.normal(size=(b, s)), jnp.float32)
    free = jnp.zeros((b, s), jnp.int32)
    pos = jnp.full((b,), length, jnp.int32)
    got = select_slots(prio, jnp.asarray(key_pos), free, pos, params)
    want = select_slots_reference(prio, jnp.asarray(key_pos), free, pos, params)
    same = all(bool((g == w).all()) for g, w in zip(got, want))
    print(f'select S={s}: equal to reference: {same}')
    ok &= same
  return 0 if ok else 1


if __name__ == '__main__':
  description = ' '.join(__doc__.split('\n\n')[0].split())
  argparse.ArgumentParser(description=description).parse_args()   # --help; no flags
  sys.exit(main())
