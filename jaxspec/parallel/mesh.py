"""A 2-D device mesh ('data', 'model') and the checks that a model fits it.

'data' splits the batch (each data shard decodes its own rows); 'model' splits the target's
attention heads, KV pages and MLP hidden units (Megatron-style tensor parallelism, Shoeybi et al.
2019). The mesh spans every device of every process once `jax.distributed` is initialised.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
from jax.sharding import AxisType, Mesh

from jaxspec.checks import check_int
from jaxspec.models import ModelConfig

DATA = 'data'
MODEL = 'model'


def make_mesh(data: int = 1, model: int = 1, devices: Optional[Sequence] = None) -> Mesh:
  """A ('data', 'model') mesh of data x model devices (Auto axes: XLA's partitioner places the
  intermediates, our shardings pin the inputs and outputs).

  Args:
    data, model: axis sizes, >= 1.
    devices: the devices to use, in order; default all of `jax.devices()` (every process's).
  Returns:
    jax.sharding.Mesh of shape (data, model).
  Raises:
    ValueError: a size < 1, no devices or one listed twice, or data * model != the number of
      devices (the message names both).
  """
  data, model = check_int('mesh.data', data, 1), check_int('mesh.model', model, 1)
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError('make_mesh got an empty device list')
  if len(set(devices)) != len(devices):
    raise ValueError(f'make_mesh got a device more than once: {devices}')
  if data * model != len(devices):
    raise ValueError(f'a mesh of data={data} x model={model} = {data * model} devices does not '
                     f'match the {len(devices)} device{"s" if len(devices) != 1 else ""} '
                     f'available ({devices[0].platform}); '
                     f'set mesh.data * mesh.model (make_mesh data * model) = {len(devices)}'
                     + ('; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N set '
                        'before JAX starts simulates N devices'
                        if devices[0].platform == 'cpu' else ''))
  # jax.make_mesh orders the devices by topology on GPU/TPU (neighbours on the 'model' axis).
  return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2,
                       devices=devices)


def check_model_fits(config: ModelConfig, model: int) -> None:
  """The target can be split `model` ways: heads, KV heads, MLP hidden units and the output
  vocabulary (of an untied lm_head; tied, the embedding is replicated) must all be multiples of
  the 'model' axis.

  Raises:
    ValueError: naming every size that the axis does not divide.
  """
  sizes = (('num_heads', config.num_heads), ('num_kv_heads', config.num_kv_heads),
           ('d_ff', config.d_ff)) + (() if config.tie_embeddings else   # no lm_head to split
                                     (('vocab_size', config.vocab_size),))
  bad = [f'{name}={value}' for name, value in sizes if value % model]
  if bad:
    raise ValueError(f'mesh.model={model} does not divide {", ".join(bad)} of the target '
                     f'({config.num_heads} query heads, {config.num_kv_heads} KV heads); '
                     f'use a model axis that divides them')


def check_batch_fits(batch: int, mesh: Mesh) -> None:
  """Raises ValueError when the batch is not a multiple of the mesh's 'data' axis."""
  data = mesh.shape[DATA]
  if batch % data:
    raise ValueError(f'batch of {batch} rows is not a multiple of mesh.data={data}; '
                     f'use batch_size a multiple of {data}')
