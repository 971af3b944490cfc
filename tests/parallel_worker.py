"""Multi-device checks, run by tests/test_parallel.py in a subprocess with 8 simulated CPU devices
(XLA_FLAGS must be set before JAX starts, and the main test process has one device).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel_worker.py

Prints one JSON object of measurements; the tests assert on them.
"""

import json
import os
import pathlib
import re
import sys
import tempfile

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

# pylint: disable=wrong-import-position
from jaxspec.cache import PageAllocator, init_eviction, make_policy, pages_needed
from jaxspec.decoding import (PrefixCachedGenerator, SamplingParams,
                              decode_autoregressive_evicting, generate, prefill_evicting)
from jaxspec.models import (ModelConfig, Transformer, cache_for, load_model, param_shapes,
                            save_model)
from jaxspec.parallel import ShardedSteps, load_sharded, make_mesh, shard_params, specs
from jaxspec.training import init_params
# pylint: enable=wrong-import-position

# 8 query / 4 KV heads so that a model axis of 4 splits them; exact-verify numerics as in the
# single-device greedy tests; projections scaled 3x so greedy output wanders (tests/conftest.py).
CONFIG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=8, num_kv_heads=4,
                     head_dim=8, d_ff=64, max_seq_len=256, exact_verify=True)
DATA, MODEL, K, PAGE = 2, 4, 3, 8


def error(fn):
  try:
    fn()
  except ValueError as e:
    return str(e)
  return None


def _is_spec(x):
  return isinstance(x, jax.sharding.PartitionSpec)


def collective_sizes(hlo_text):
  """Element counts of the results of every cross-device collective in compiled HLO text."""
  sizes = []
  pattern = r'= \w+\[([\d,]*)\][^ ]* (all-gather|all-reduce|all-to-all|reduce-scatter|' \
            r'collective-permute)(-start)?\('
  for m in re.finditer(pattern, hlo_text):
    sizes.append(int(np.prod([int(d) for d in m.group(1).split(',') if d])))
  return sizes


def main():
  out = {'devices': jax.device_count()}
  params = jax.tree_util.tree_map_with_path(
      lambda p, w: w * 3.0 if 'kernel' in jax.tree_util.keystr(p) else w, init_params(CONFIG, 0))
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  draft_params = jax.tree_util.tree_unflatten(
      tree, [w + 0.02 * jnp.std(w) * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)])

  mesh = make_mesh(DATA, MODEL)
  steps = ShardedSteps(mesh)
  sharded = shard_params(params, CONFIG, mesh)
  draft_sharded = shard_params(draft_params, CONFIG, mesh, replicate=True)
  q = sharded['params']['layer_0']['attn']['q']['kernel']
  out['q_shard_shape'] = list(q.addressable_shards[0].data.shape)
  out['q_shape'] = list(q.shape)
  out['draft_shard_shape'] = list(
      draft_sharded['params']['layer_0']['attn']['q']['kernel'].addressable_shards[0].data.shape)

  # Logits of prefill (T = 16), one decode step (T = 1) and a verification (T = K + 1).
  alloc = PageAllocator(2 * 5 + 1)
  table = np.array([alloc.allocate(5) for _ in range(2)], np.int32)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 64, size=(2, 16)).astype(np.int32)
  lengths = np.array([16, 11], np.int32)
  positions = np.where(np.arange(16)[None] < lengths[:, None], np.arange(16)[None], -1)
  forward = jax.jit(lambda p, c, t, pos: Transformer(CONFIG).apply(p, t, pos, c))
  local_cache = cache_for(CONFIG, table, alloc.num_pages, PAGE)
  mesh_cache = steps.new_cache(CONFIG, table, alloc.num_pages, PAGE)
  diffs = {}
  for name, width in (('prefill', 16), ('decode', 1), ('verify', K + 1)):
    if name == 'prefill':
      t, pos = tokens, positions
    else:
      t = rng.integers(3, 64, size=(2, width)).astype(np.int32)
      pos = np.asarray(local_cache.lengths)[:, None] + np.arange(width)[None]
    a, local_cache = forward(params, local_cache, jnp.asarray(t), jnp.asarray(pos))
    b, mesh_cache = forward(sharded, mesh_cache, steps.put_batch(t), steps.put_batch(pos))
    valid = pos >= 0
    diffs[name] = float(np.abs(np.asarray(a) - np.asarray(b))[valid].max())
    diffs[name + '_argmax_equal'] = bool(
        (np.asarray(a).argmax(-1) == np.asarray(b).argmax(-1))[valid].all())
  out['logits'] = diffs
  out['logit_scale'] = float(np.abs(np.asarray(a)).max())
  out['cache_spec_kept'] = str(mesh_cache.k_pages.sharding.spec) == str(specs.CACHE_SPEC.k_pages)

  # Greedy generation: autoregressive and speculative, sharded vs one device.
  prompts = [rng.integers(3, 64, size=n).tolist() for n in (9, 17)]
  kw = dict(max_new_tokens=24, page_size=PAGE)
  spec = dict(draft=CONFIG, k=K)
  ar_local = generate(CONFIG, params, prompts, **kw)
  ar_mesh = generate(CONFIG, sharded, prompts, steps=steps, **kw)
  sp_local = generate(CONFIG, params, prompts, draft_params=draft_params, **spec, **kw)
  sp_mesh = generate(CONFIG, sharded, prompts, draft_params=draft_sharded, steps=steps,
                     **spec, **kw)
  out['ar_local'], out['ar_mesh'] = ar_local.tokens, ar_mesh.tokens
  out['sp_local'], out['sp_mesh'] = sp_local.tokens, sp_mesh.tokens
  out['alpha_local'], out['alpha_mesh'] = sp_local.acceptance_rate, sp_mesh.acceptance_rate

  # Prefix caching (with a host tier, in a pool small enough to demote) on a data=1 mesh.
  mesh1 = make_mesh(1, MODEL, jax.devices()[:MODEL])
  steps1 = ShardedSteps(mesh1)
  turns = {}
  for name, kw1 in (('local', {}), ('mesh', dict(steps=steps1))):
    p1 = shard_params(params, CONFIG, mesh1) if kw1 else params
    d1 = shard_params(draft_params, CONFIG, mesh1, replicate=True) if kw1 else draft_params
    gen = PrefixCachedGenerator(CONFIG, p1, num_pages=9, page_size=PAGE, host_pages=16,
                                draft=CONFIG, draft_params=d1, k=K, **kw1)
    convs = [rng_p.integers(3, 64, size=2 * PAGE + 3).tolist()
             for rng_p in (np.random.default_rng(s) for s in (7, 8, 9))]
    got = []
    for _ in range(2):
      for c, conv in enumerate(convs):
        r = gen.generate(conv, max_new_tokens=6)
        got.append((r.tokens[0], r.cached_tokens, r.promoted_tokens, r.accepted))
        convs[c] = conv + r.tokens[0] + [c + 3]
    turns[name] = got
  out['prefix_local'], out['prefix_mesh'] = turns['local'], turns['mesh']

  # Eviction (H2O, a budget the prompts overflow) on the sharded target: same tokens and state.
  policy = make_policy('h2o', 12)
  per_seq = pages_needed(policy.slots, PAGE)
  evict_table = np.arange(1, 2 * per_seq + 1, dtype=np.int32).reshape(2, per_seq)
  evicted = {}
  for name in ('local', 'mesh'):
    on_mesh = name == 'mesh'
    cache = (steps.new_cache(CONFIG, evict_table, 2 * per_seq + 1, PAGE) if on_mesh
             else cache_for(CONFIG, evict_table, 2 * per_seq + 1, PAGE))
    state = init_eviction(policy, cache)
    state = steps.put_eviction(state) if on_mesh else state
    put_b = steps.put_batch if on_mesh else jnp.asarray
    put_r = steps.put_replicated if on_mesh else jnp.asarray
    p1 = sharded if on_mesh else params
    toks = np.zeros((2, 16), np.int32)
    toks[0, :16], toks[1, :9] = prompts[1][:16], prompts[0]
    first, cache, state = prefill_evicting(CONFIG, p1, cache, state, put_b(toks),
                                           put_b(np.array([16, 9], np.int32)),
                                           put_r(jax.random.PRNGKey(0)), sampling=SamplingParams())
    res, cache, state = decode_autoregressive_evicting(
        CONFIG, p1, cache, state, first, put_r(jax.random.PRNGKey(1)),
        put_r(np.zeros(0, np.int32)), sampling=SamplingParams(), max_new_tokens=20)
    evicted[name] = (np.asarray(res.tokens).tolist(), np.asarray(state.key_pos).tolist(),
                     float(np.abs(np.asarray(state.scores)).sum()))
  out['evict_local'], out['evict_mesh'] = evicted['local'], evicted['mesh']
  out['evict_scores_mesh_sharded'] = str(state.scores.sharding.spec)

  # Compile once: other prompts in the same bucket, another seed, no new executable.
  out['compilations_first'] = steps.compilations()
  for seed in (1, 2):
    other = [rng.integers(3, 64, size=n).tolist() for n in (5, 30)]
    generate(CONFIG, sharded, other, steps=steps, seed=seed, **kw)
    generate(CONFIG, sharded, other, draft_params=draft_sharded, steps=steps, seed=seed,
             **spec, **kw)
  out['compilations_after'] = steps.compilations()

  # No collective moves a whole weight or KV pool: compare result sizes with every split tensor.
  first = steps.put_batch(np.zeros((2,), np.int32))
  target_cache = steps.new_cache(CONFIG, table, alloc.num_pages, PAGE)
  draft_cache = steps.new_cache(CONFIG, table, alloc.num_pages, PAGE, draft=True)
  hlo = steps._speculative.lower(  # pylint: disable=protected-access
      CONFIG, CONFIG, sharded, draft_sharded, target_cache, draft_cache, first,
      steps.put_replicated(jax.random.PRNGKey(0)), steps.put_replicated(np.zeros(0, np.int32)),
      k=K, sampling=SamplingParams(), max_new_tokens=10).compile().as_text()
  out['collective_sizes'] = collective_sizes(hlo)
  leaf_specs = jax.tree.leaves(specs.param_specs(params), is_leaf=_is_spec)
  split = [int(np.prod(x.shape)) for x, s in zip(jax.tree.leaves(sharded), leaf_specs)
           if s != specs.REPLICATED]
  pool = target_cache.k_pages.shape
  out['split_sizes'] = split + [int(np.prod(pool)), int(np.prod(pool[1:]))]

  # A checkpoint restored straight into its shardings equals the params sharded after loading.
  with tempfile.TemporaryDirectory() as tmp:
    save_model(f'{tmp}/m', CONFIG, params, dtype='float32')
    _, restored = load_sharded(f'{tmp}/m', mesh)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b)))
                        and a.sharding.is_equivalent_to(b.sharding, a.ndim), restored, sharded)
    out['load_sharded_equal'] = all(jax.tree.leaves(same))
    # float32 on disk read as bfloat16: equal to load_model's cast, its checksums hold (were
    # checked after casting back, which is not exact in this direction).
    _, narrow = load_sharded(f'{tmp}/m', mesh, dtype='bfloat16')
    _, local = load_model(f'{tmp}/m', dtype='bfloat16')
    out['load_sharded_bfloat16_equal'] = all(jax.tree.leaves(jax.tree.map(
        lambda a, b: a.dtype == b.dtype and bool(np.array_equal(np.asarray(a), np.asarray(b))),
        narrow, local)))
    out['error_load_sharded_dtype'] = error(lambda: load_sharded(f'{tmp}/m', mesh, dtype='int32'))
    save_model(f'{tmp}/b', CONFIG, params)                          # bfloat16, as shipped
    load_sharded(f'{tmp}/b', mesh)                                  # its checksums hold
    sums = json.loads(pathlib.Path(f'{tmp}/b/checksums.json').read_text())
    sums['sha256']['params/layer_0/mlp/down/kernel'] = '0' * 64     # as a damaged file reads
    pathlib.Path(f'{tmp}/b/checksums.json').write_text(json.dumps(sums))
    out['error_load_sharded_checksum'] = error(lambda: load_sharded(f'{tmp}/b', mesh))
    fields = json.loads(pathlib.Path(f'{tmp}/m/config.json').read_text())
    pathlib.Path(f'{tmp}/m/config.json').write_text(json.dumps({**fields, 'd_ff': 128}))
    out['error_load_sharded_config'] = error(lambda: load_sharded(f'{tmp}/m', mesh))
    sums = json.loads(pathlib.Path(f'{tmp}/m/checksums.json').read_text())
    del sums['config']                                    # as written before configs were listed
    pathlib.Path(f'{tmp}/m/checksums.json').write_text(json.dumps(sums))
    out['error_load_sharded'] = error(lambda: load_sharded(f'{tmp}/m', mesh))

  # Errors naming the sizes.
  out['error_mesh_size'] = error(lambda: make_mesh(3, 3))
  out['error_prefix_data_axis'] = error(lambda: PrefixCachedGenerator(
      CONFIG, params, num_pages=8, page_size=PAGE, steps=ShardedSteps(make_mesh(2, 4))))
  shipped_shape = ModelConfig.from_name('target-12m')
  mesh8 = make_mesh(1, 8)
  out['error_heads_params'] = error(lambda: shard_params(param_shapes(shipped_shape),
                                                        shipped_shape, mesh8))
  out['error_heads_cache'] = error(lambda: ShardedSteps(mesh8).new_cache(
      shipped_shape, table, alloc.num_pages, PAGE))
  out['error_unplaced_target'] = error(lambda: generate(CONFIG, params, prompts, steps=steps, **kw))
  out['error_unplaced_draft'] = error(lambda: generate(
      CONFIG, sharded, prompts, draft_params=draft_params, steps=steps, **spec, **kw))
  out['error_batch'] = error(lambda: generate(CONFIG, sharded, prompts[:1], steps=steps, **kw))
  # The shipped target's shape fits a model axis of 2 (6 query / 2 KV heads, d_ff 1024).
  out['shipped_model_2'] = error(lambda: ShardedSteps(make_mesh(1, 2, jax.devices()[:2])).new_cache(
      shipped_shape, table, alloc.num_pages, PAGE))
  # Each device holds 1/MODEL of the target's pool and all of the draft's, and these CPU devices
  # all hold theirs in the one host memory: DATA whole target pools (2) fit in 3 pools' worth,
  # 8 draft pools do not (was: no check on a mesh, then each share against all of the RAM).
  from jaxspec.cache import paged  # pylint: disable=import-outside-toplevel
  whole = (2 * CONFIG.num_layers * CONFIG.num_kv_heads * alloc.num_pages * PAGE * CONFIG.head_dim
           * jnp.dtype(CONFIG.dtype).itemsize)
  memory_bytes, paged.memory_bytes = paged.memory_bytes, lambda device=None: 3 * whole
  out['pool_share_target'] = error(lambda: steps.new_cache(CONFIG, table, alloc.num_pages, PAGE))
  out['error_pool_share_draft'] = error(lambda: steps.new_cache(CONFIG, table, alloc.num_pages,
                                                                PAGE, draft=True))
  paged.memory_bytes = memory_bytes
  out.update(experiment_placement())
  print('RESULT ' + json.dumps(out))


def experiment_placement():
  """The speculative experiment on a 4 x 2 mesh reads the shipped pair straight into its
  placement (load_sharded), never whole through load_model, and place_pair keeps it there."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from experiments import common, speculative  # pylint: disable=import-outside-toplevel
  from jaxspec.parallel import place_pair  # pylint: disable=import-outside-toplevel

  def whole(*args, **kwargs):
    raise AssertionError(f'load_model{args} read a model whole on one device')
  common.load_model = whole
  config = ml_collections.ConfigDict(dict(target='', draft='', tokenizer='', dtype='float32',
                                          mesh=dict(data=4, model=2)))
  target, tparams, _, dparams, _ = speculative.load_pair(config)
  q = tparams['params']['layer_0']['attn']['q']['kernel']
  _, placed_t, placed_d = place_pair(config.mesh, target, tparams, dparams)
  from jaxspec.models.shard_sums import tensor_sums  # pylint: disable=import-outside-toplevel
  host = jax.tree.map(np.asarray, tparams)
  return dict(
      sums_split_independent=tensor_sums(tparams) == tensor_sums(host),
      experiment_q_shard=list(q.addressable_shards[0].data.shape), experiment_q=list(q.shape),
      experiment_draft_replicated=all(x.sharding.is_fully_replicated
                                      for x in jax.tree.leaves(dparams)),
      experiment_placement_kept=all(a is b for a, b in zip(jax.tree.leaves(placed_t) +
                                                           jax.tree.leaves(placed_d),
                                                           jax.tree.leaves(tparams) +
                                                           jax.tree.leaves(dparams))))


if __name__ == '__main__':
  main()
