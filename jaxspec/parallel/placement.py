"""From config fields to a placement: the mesh, the steps and the params placed on it."""

from __future__ import annotations

from typing import Optional

import jax
from jax.sharding import Mesh

from jaxspec.checks import check_int
from jaxspec.decoding.steps import LOCAL_STEPS
from jaxspec.models import ModelConfig
from jaxspec.parallel.mesh import make_mesh
from jaxspec.parallel.steps import ShardedSteps, shard_params


def mesh_of(mesh_config) -> Optional[Mesh]:
  """The mesh a config's `mesh` fields (data, model; absent = 1) name: None for a 1 x 1 mesh in a
  single process (the single-device path), else a mesh over every device of every process.

  Raises:
    ValueError: a field other than data and model, mesh sizes that are not ints >= 1 (named), or
      a mesh that does not match the devices.
  """
  mesh_config = dict(mesh_config or {})
  unknown = sorted(set(mesh_config) - {'data', 'model'})
  if unknown:
    raise ValueError(f'mesh fields are data and model, got {unknown}')
  data = check_int('mesh.data', mesh_config.get('data', 1), 1)
  model = check_int('mesh.model', mesh_config.get('model', 1), 1)
  if data * model == 1 and jax.process_count() == 1:
    return None
  return make_mesh(data, model)


def place_pair(mesh_config, target: ModelConfig, target_params, draft_params):
  """Where `generate` runs for a config's `mesh` fields (data, model).

  A 1 x 1 mesh in a single process keeps the single-device path untouched (LOCAL_STEPS on the
  default device, params as given). Anything else builds the mesh over every device of every
  process (`mesh_of`), shards the target's params over it and replicates the draft's (params
  already placed so, e.g. by `load_sharded`, stay where they are).

  Args:
    mesh_config: ConfigDict / dict with ints `data` and `model` (absent = 1).
  Returns:
    (steps, target_params, draft_params): pass all three to `generate`.
  Raises:
    ValueError: mesh sizes that are not ints >= 1 (named), the mesh does not match the devices,
      or its model axis does not divide the target's heads / d_ff / vocabulary (the message
      names the sizes).
  """
  mesh = mesh_of(mesh_config)
  if mesh is None:
    return LOCAL_STEPS, target_params, draft_params
  return (ShardedSteps(mesh), shard_params(target_params, target, mesh),
          shard_params(draft_params, None, mesh, replicate=True))
