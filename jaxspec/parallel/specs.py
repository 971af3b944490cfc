"""Every partition spec of the sharded target, in one place.

Tensor parallelism as in Megatron-LM (Shoeybi et al. 2019): the q/k/v projections are split on
their output (heads) dimension and `o` on its input dimension, so each 'model' shard owns whole
attention heads and the attention itself needs no communication; gate/up are split on the hidden
units and `down` on its input, so the MLP needs one all-reduce. The KV pages are split on the KV
head axis, like the k/v kernels that fill them. The output head is split on the vocabulary; the
embedding table and the norms are replicated. Batch-major arrays (tokens, page table, lengths)
are split over 'data'. The draft is replicated: it runs beside the target on every device.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.cache import PagedKVCache
from jaxspec.parallel.mesh import DATA, MODEL

REPLICATED = P()

# (module, param) -> spec. Kernels are [D_in, D_out]; biases [D_out].
PARAM_RULES = {
    ('q', 'kernel'): P(None, MODEL),        # [D, N*H]: query heads
    ('k', 'kernel'): P(None, MODEL),        # [D, K*H]: KV heads
    ('v', 'kernel'): P(None, MODEL),        # [D, K*H]
    ('q', 'bias'): P(MODEL),                # [N*H]
    ('k', 'bias'): P(MODEL),                # [K*H]
    ('v', 'bias'): P(MODEL),
    ('o', 'kernel'): P(MODEL, None),        # [N*H, D]: partial sums, all-reduced
    ('gate', 'kernel'): P(None, MODEL),     # [D, d_ff]
    ('up', 'kernel'): P(None, MODEL),       # [D, d_ff]
    ('down', 'kernel'): P(MODEL, None),     # [d_ff, D]: partial sums, all-reduced
    ('lm_head', 'kernel'): P(None, MODEL),  # [D, V]: logits split on the vocabulary
    ('embed', 'embedding'): REPLICATED,     # [V, D]: a local lookup on every device
    ('attn_norm', 'scale'): REPLICATED,     # [D]
    ('mlp_norm', 'scale'): REPLICATED,
    ('final_norm', 'scale'): REPLICATED,
}

# The paged KV cache: pages [layers, K, P, L, H] split on the KV heads; the page table [B, pages]
# and lengths [B] split on the batch. The page pool itself is shared by all rows, so it is
# replicated over 'data' (every data shard holds the pool, writes reach every copy).
CACHE_SPEC = PagedKVCache(k_pages=P(None, MODEL), v_pages=P(None, MODEL),
                          page_table=P(DATA), lengths=P(DATA))
# The draft's cache: replicated like the draft, batch split like the target's.
DRAFT_CACHE_SPEC = PagedKVCache(k_pages=REPLICATED, v_pages=REPLICATED,
                                page_table=P(DATA), lengths=P(DATA))
BATCH = P(DATA)                             # [B, ...] arrays: tokens, lengths, first tokens
# Eviction state beside the cache (jaxspec.cache.EvictionState): key_pos, free_from, scores are
# [layers, B, S], split on the batch. Scores are sums over the KV heads, which 'model' splits:
# XLA's partitioner adds that sum as an all-reduce over 'model'.
EVICTION_SPEC = P(None, DATA)


def param_specs(params):
  """The PartitionSpec of every leaf of a target's params (the same tree structure).

  Args:
    params: a params pytree of `jaxspec.models.Transformer` (arrays or ShapeDtypeStructs).
  Raises:
    ValueError: a leaf no rule covers (a new parameter must get a spec here, not a silent
      replication), named by its path.
  """
  def spec(path, leaf):
    names = tuple(getattr(k, 'key', getattr(k, 'name', str(k))) for k in path)
    rule = PARAM_RULES.get(names[-2:])
    if rule is None:
      raise ValueError(f'no partition rule for parameter {"/".join(map(str, names))} of shape '
                       f'{tuple(leaf.shape)}; add one to jaxspec.parallel.specs.PARAM_RULES')
    return rule
  return jax.tree_util.tree_map_with_path(spec, params)


def named(mesh: Mesh, specs):
  """NamedSharding(mesh, spec) for every PartitionSpec in a pytree of specs."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))
