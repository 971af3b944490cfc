"""Beyond one device: the target sharded over a ('data', 'model') mesh, the draft replicated
beside it, and multi-process runs on `jax.distributed`."""

from jaxspec.parallel.checkpoint import load_sharded
from jaxspec.parallel.distributed import DistributedSettings, initialize, is_primary, settings
from jaxspec.parallel.mesh import DATA, MODEL, check_batch_fits, check_model_fits, make_mesh
from jaxspec.parallel.placement import mesh_of, place_pair
from jaxspec.parallel.specs import CACHE_SPEC, DRAFT_CACHE_SPEC, PARAM_RULES, param_specs
from jaxspec.parallel.steps import ShardedSteps, put, shard_params

__all__ = ['CACHE_SPEC', 'DATA', 'DRAFT_CACHE_SPEC', 'DistributedSettings', 'MODEL', 'PARAM_RULES',
           'ShardedSteps', 'check_batch_fits', 'check_model_fits', 'initialize', 'is_primary',
           'load_sharded', 'make_mesh', 'mesh_of', 'param_specs', 'place_pair', 'put', 'settings',
           'shard_params']
