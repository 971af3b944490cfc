"""The jitted decoding steps on a mesh, with explicit shardings on every input and output.

The decoding functions of `jaxspec.decoding` are used as they are: this module re-jits their
Python bodies with `out_shardings` and places every input on the mesh before the call, so each
jitted step sees fixed input shardings and returns the same ones (donated caches are updated in
place, and a step compiles once per shape). Params that are not placed as expected are refused
with a ValueError (`check_params`) rather than copied whole onto every device by jit.

    steps = ShardedSteps(mesh)
    params = shard_params(target_params, target, mesh)
    generate(target, params, prompts, ..., steps=steps)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxspec.cache import PagedKVCache
from jaxspec.cache.paged import check_page_table, check_pool_fits
from jaxspec.checks import check_int
from jaxspec.decoding import autoregressive, speculative
from jaxspec.models import ModelConfig
from jaxspec.parallel import specs
from jaxspec.parallel.mesh import MODEL, check_batch_fits, check_model_fits


def put(x, sharding: NamedSharding):
  """A global jax.Array with `sharding` from a host value that every process holds in full
  (works across processes: each takes only the slices of its own devices).

  Args:
    x: numpy-convertible array, or a jax.Array: returned as it is when already placed with
      `sharding` (e.g. by `load_sharded`), moved by `jax.device_put` when it spans processes,
      else fetched to host first.
  """
  if isinstance(x, jax.Array):
    if x.sharding.is_equivalent_to(sharding, x.ndim):
      return x
    if not x.is_fully_addressable:             # no process can fetch it whole
      return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_params(params, config: ModelConfig, mesh: Mesh, *, replicate: bool = False):
  """Place a loaded target's params on the mesh, each leaf with its `specs.PARAM_RULES` spec
  (or replicated, for the draft, with `replicate=True`). Host-side leaves are sliced per device,
  so no device ever holds the whole tensor of a split parameter.

  Raises:
    ValueError: config not a ModelConfig for a target (replicate=False), or the mesh's 'model'
      axis does not divide the heads / d_ff / vocabulary (named).
  """
  if replicate:
    return jax.tree.map(lambda x: put(x, NamedSharding(mesh, specs.REPLICATED)), params)
  if not isinstance(config, ModelConfig):
    raise ValueError(f'shard_params splits a target by its ModelConfig, got config={config!r} '
                     f'(a draft is replicated: replicate=True)')
  check_model_fits(config, mesh.shape[MODEL])
  shardings = specs.named(mesh, specs.param_specs(params))
  return jax.tree.map(put, params, shardings)


class ShardedSteps:
  """`generate`'s device-side calls on a mesh: the target and its cache split over 'model', the
  draft and its cache replicated, batch-major arrays split over 'data'.

  Same signatures as `jaxspec.decoding.prefill`, `decode_autoregressive` and
  `decode_speculative`; `new_cache` makes an empty cache directly in its sharding (zeros created
  on each device, never whole on one); `put_batch` / `put_replicated` place host arrays.
  Decode outputs (tokens, counters) come back replicated, so every process can read them.
  """

  def __init__(self, mesh: Mesh):
    self.mesh = mesh
    self._empty_caches = {}      # (shape, dtype, draft) -> its jitted maker (per instance: an
                                 # lru_cache on the method kept every instance alive)
    self._named = functools.partial(specs.named, mesh)
    self._cache = {False: self._named(specs.CACHE_SPEC), True: self._named(specs.DRAFT_CACHE_SPEC)}
    batch, rep = self._named(specs.BATCH), self._named(specs.REPLICATED)
    self._batch, self._rep = batch, rep
    jit = lambda f, static, donate, out: jax.jit(f, static_argnames=static,
                                                 donate_argnames=donate, out_shardings=out)
    self._prefill = {
        draft: jit(autoregressive.prefill.__wrapped__, ('config', 'sampling'), ('cache',),
                   (batch, self._cache[draft]))
        for draft in (False, True)}
    self._decode = jit(autoregressive.decode_autoregressive.__wrapped__,
                       ('config', 'sampling', 'max_new_tokens'), ('cache',),
                       (rep, self._cache[False]))
    self._speculative = jit(speculative.decode_speculative.__wrapped__,
                            ('target', 'draft', 'k', 'sampling', 'max_new_tokens'),
                            ('target_cache', 'draft_cache'),
                            (rep, rep, self._cache[False], self._cache[True]))

  def put_batch(self, x):
    """[B, ...] host array -> split over 'data'. Raises ValueError if x has no batch axis (a
    scalar) or B % data != 0."""
    if not np.ndim(x):
      raise ValueError(f'put_batch needs a [B, ...] array, got a scalar {x!r}')
    check_batch_fits(np.shape(x)[0], self.mesh)
    return put(x, self._batch)

  def put_eviction(self, state):
    """An `EvictionState` (host or default-device arrays) -> its arrays split on the batch over
    'data' (`specs.EVICTION_SPEC`), so the jitted loops under eviction
    (`jaxspec.decoding.prefill_evicting`, `decode_autoregressive_evicting`,
    `decode_speculative_evicting`) run on the mesh with a cache from `new_cache`.

    Raises:
      ValueError: the batch does not divide over 'data'.
    """
    check_batch_fits(state.key_pos.shape[1], self.mesh)
    sharding = NamedSharding(self.mesh, specs.EVICTION_SPEC)
    return jax.tree.map(lambda x: put(x, sharding), state)

  def put_replicated(self, x):
    """Host array (PRNG key, stop tokens) -> a copy on every device."""
    return put(x, self._rep)

  def new_cache(self, config: ModelConfig, page_table, num_pages: int, page_size: int, *,
                draft: bool = False) -> PagedKVCache:
    """An empty cache for `config` (see `jaxspec.models.cache_for`), split over 'model' on the
    KV heads (replicated with `draft=True`).

    Raises:
      ValueError: bad sizes or page table entries outside [0, num_pages); KV heads or batch not
        divisible by the mesh; a device's share of the pool (the target's: 1 / the 'model'
        axis; the draft's: all of it) past its memory, or on the CPU, whose simulated devices
        share the host's memory, every device's share together (`check_pool_fits`).
    """
    num_pages = check_int('num_pages', num_pages, 1)
    page_size = check_int('page_size', page_size, 1)
    check_page_table(page_table, num_pages)
    table = np.asarray(page_table)
    if not draft:
      check_model_fits(config, self.mesh.shape[MODEL])
    shape = (config.num_layers, config.num_kv_heads, num_pages, page_size, config.head_dim)
    split = 1 if draft else self.mesh.shape[MODEL]       # the target's pool: KV heads over 'model'
    first = self.mesh.devices.flat[0]
    shares = self.mesh.devices.size if first.platform == 'cpu' else 1   # one host memory
    check_pool_fits([('draft' if draft else 'target', shape, config.dtype, split, shares)],
                    'the sharded KV cache', device=first)
    return self._empty_cache(shape, jnp.dtype(config.dtype), draft)(
        self.put_batch(table.astype(np.int32)))

  def _empty_cache(self, shape, dtype, draft: bool):
    key = (shape, dtype, draft)
    if key not in self._empty_caches:
      def empty(page_table):
        return PagedKVCache(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
                            page_table=page_table,
                            lengths=jnp.zeros(page_table.shape[:1], jnp.int32))
      self._empty_caches[key] = jax.jit(empty, out_shardings=self._cache[draft])
    return self._empty_caches[key]

  def _is_draft_cache(self, cache: PagedKVCache) -> bool:
    return cache.k_pages.sharding.is_equivalent_to(self._cache[True].k_pages, cache.k_pages.ndim)

  def check_params(self, params, *, draft: bool = False) -> None:
    """Refuse params that are not where the steps expect them, instead of letting jit copy a
    whole target onto every device: the target's leaves must carry their `specs.PARAM_RULES`
    sharding on this mesh (`shard_params`), the draft's must live on this mesh's devices.

    Raises:
      ValueError: naming the first misplaced tensor and its sharding.
    """
    want = None if draft else self._named(specs.param_specs(params))
    devices = set(self.mesh.devices.flat)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    wanted = [None] * len(leaves) if draft else jax.tree.leaves(want)
    for (path, leaf), sharding in zip(leaves, wanted):
      have = getattr(leaf, 'sharding', None)
      ok = have is not None and (
          have.device_set == devices if draft else have.is_equivalent_to(sharding, leaf.ndim))
      if not ok:
        role, how = ('draft', ', replicate=True') if draft else ('target', '')
        raise ValueError(f'{role} tensor {jax.tree_util.keystr(path)} is not placed on the mesh '
                         f'as expected (has {have}); place the params with '
                         f'jaxspec.parallel.shard_params(params, config, mesh{how})')

  # Same arguments as the functions they wrap; only the ones whose placement matters are named.

  def prefill(self, config, params, cache, *args, **kwargs):
    """`jaxspec.decoding.prefill` on the mesh; the cache keeps its sharding (target or draft)."""
    draft = self._is_draft_cache(cache)
    self.check_params(params, draft=draft)
    return self._prefill[draft](config, params, cache, *args, **kwargs)

  def decode_autoregressive(self, config, params, *args, **kwargs):
    """`jaxspec.decoding.decode_autoregressive` on the mesh (target cache)."""
    self.check_params(params)
    return self._decode(config, params, *args, **kwargs)

  def decode_speculative(self, target, draft, target_params, draft_params, *args, **kwargs):
    """`jaxspec.decoding.decode_speculative` on the mesh: sharded target, replicated draft."""
    self.check_params(target_params)
    self.check_params(draft_params, draft=True)
    return self._speculative(target, draft, target_params, draft_params, *args, **kwargs)

  def compilations(self) -> int:
    """Executables compiled so far by this object's jitted steps (for compile-once checks)."""
    fns = [*self._prefill.values(), self._decode, self._speculative]
    # The empty-cache makers: one jitted function per cache shape, each compiled once.
    fns += list(self._empty_caches.values())
    return sum(f._cache_size() for f in fns)  # pylint: disable=protected-access
