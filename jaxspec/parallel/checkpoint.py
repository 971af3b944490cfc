"""Loading a model directory straight into its shardings: each device (each process, on several
hosts) reads only its own slices of the checkpoint, so a target larger than one device's memory
never exists whole anywhere."""

from __future__ import annotations

import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding

from jaxspec.models import hf, param_shapes
# pylint: disable-next=protected-access
from jaxspec.models.checkpoint import (_check_all_fit, _check_tree, check_complete,
                                       floating_dtype, read_config)
from jaxspec.models.restore_errors import (check_orbax_metadata, out_of_memory,
                                           quiet_late_reads, restore_error)
from jaxspec.models.checksums import (CHECKSUMS, CheckpointError, listed_sums, verify_checksums,
                                      verify_sums)
from jaxspec.parallel import specs
from jaxspec.parallel.mesh import MODEL, check_model_fits


def _single_process() -> bool:
  """Whether this run has one process (every tensor can be whole here); a seam for tests."""
  return jax.process_count() == 1


def load_sharded(path, mesh: Mesh, *, replicate: bool = False, dtype: str = 'float32'):
  """`jaxspec.models.load_model`, restoring every tensor directly into its sharding on `mesh`:
  split by `specs.PARAM_RULES` (a target), or replicated (`replicate=True`, a draft).

  Args:
    path: a model directory written by `save_model` (config.json + params/).
    mesh: the ('data', 'model') mesh.
    dtype: dtype of the returned params (read in the stored dtype, checked, then cast).
  Returns:
    (ModelConfig, params) with params global jax.Arrays on the mesh.
  Raises:
    CheckpointError: missing or unreadable directory, config or tensors; a save into the
      directory that did not finish; NaN or infinite weights, or weights outside float16's
      range when loading in float16 (named, checked in the shards a process holds); a config.json
      that differs from the config the tensors were saved with; a Hugging Face
      directory (named, with the way to shard one); a tensor whose shape
      differs from what the config implies, or whose bytes differ from checksums.json (named):
      its SHA-256 in one process, where every tensor is whole here; across processes, where no
      process holds a tensor whole, its split-independent sum (`jaxspec.models.shard_sums`; a
      checksums.json written before the sums existed warns that nothing was checked).
    ValueError: the mesh's model axis does not divide the target's heads / d_ff / vocabulary;
      a dtype that is not a floating-point dtype (named).
  """
  floating_dtype(dtype)
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise CheckpointError(f'no model directory at {path}')
  if hf.is_pretrained(path):
    raise CheckpointError(f'{path} is a Hugging Face model directory; load_sharded reads '
                          f'save_model directories only: load it with '
                          f'jaxspec.models.hf.load_pretrained and place it with '
                          f'jaxspec.parallel.shard_params (it is read whole on the host first)')
  check_complete(path)
  config = read_config(path)
  shapes = param_shapes(config)
  if replicate:
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, specs.REPLICATED), shapes)
  else:
    check_model_fits(config, mesh.shape[MODEL])
    shardings = specs.named(mesh, specs.param_specs(shapes))
  check_orbax_metadata(path / 'params')
  try:
    with quiet_late_reads(), ocp.StandardCheckpointer() as ckptr:
      stored = ckptr.metadata(path / 'params').item_metadata.tree
      _check_tree(shapes, stored, f'checkpoint {path}')
      # With checksums, restored in the stored dtype, checked (in one process, where every
      # tensor is whole here, by SHA-256; across processes by the split-independent sums), then
      # cast; else straight into `dtype` (no second copy). A cast to a narrower range (float16)
      # is checked too, shard by shard, so those tensors are restored in the stored dtype
      # whatever the checksums.
      one = _single_process()
      verify = ((path / CHECKSUMS).exists() if one else
                listed_sums(path / CHECKSUMS)[0] is not None)
      narrows = lambda meta: (jnp.issubdtype(meta.dtype, jnp.floating) and
                              jnp.finfo(dtype).maxexp < jnp.finfo(meta.dtype).maxexp)
      as_dtype = lambda meta: meta.dtype if verify or narrows(meta) else jnp.dtype(dtype)
      target = jax.tree.map(lambda s, sh, meta: jax.ShapeDtypeStruct(s.shape, as_dtype(meta),
                                                                     sharding=sh),
                            shapes, shardings, stored)
      params = ckptr.restore(path / 'params', target)
  except CheckpointError:
    raise
  except Exception as e:  # orbax raises many types for damaged or missing files; name the path
    if out_of_memory(e):              # not damage: the devices cannot hold the model
      raise
    raise restore_error('the checkpoint', path / 'params', e) from e
  if one:
    # Absent, it warns that nothing was checked.
    verify_checksums(path / CHECKSUMS, jax.tree.map(np.asarray, params) if verify else params)
  elif not verify or not verify_sums(path / CHECKSUMS, params):
    warnings.warn(f'{path} has no {CHECKSUMS} with split-independent sums (written before they '
                  f'existed): across processes its tensors are loaded unverified; save it again '
                  f'to add them', stacklevel=2)
  _check_all_fit(params, dtype, f'checkpoint {path}')
  if any(x.dtype != jnp.dtype(dtype) for x in jax.tree.leaves(params)):
    params = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype), t),
                     out_shardings=shardings)(params)
  return config, params
