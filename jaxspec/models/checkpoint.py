"""Saving and loading a model directory: `config.json` (the ModelConfig), `params/` (an orbax
checkpoint, stored in bfloat16 or float32), `checksums.json` (a SHA-256 per stored tensor) and
optional `info.json` (how it was trained).

Loading checks every tensor against the shapes the config implies and against its checksum, so
a wrong, truncated or damaged checkpoint is reported by name instead of failing later inside a
jitted step or, worse, loading with some weights changed (a flipped byte in orbax's data files
otherwise restores without complaint).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxspec.models.config import ModelConfig, check_model_config
from jaxspec.models.llama import Transformer
from jaxspec.models.restore_errors import (check_orbax_metadata, out_of_memory,
                                           quiet_late_reads, restore_error)
from jaxspec.models.checksums import (CHECKSUMS, CheckpointError, listed_config, verify_checksums,
                                      write_checksums)


def param_shapes(config: ModelConfig):
  """The params pytree of `config` as jax.ShapeDtypeStruct leaves (float32), without allocating
  (traced once per config; each call returns its own containers, free to edit)."""
  return jax.tree.map(lambda leaf: leaf, _param_shapes(config))


@functools.lru_cache(maxsize=16)
def _param_shapes(config: ModelConfig):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(lambda: Transformer(config).init(jax.random.PRNGKey(0), tokens, tokens))


def check_params(config: ModelConfig, params, name: str = 'params') -> None:
  """Check that `params` are a params pytree of `config`: every tensor present at its shape, of
  a real floating dtype (any width: they are cast to `config.dtype` where used), and nothing
  else, so swapped or foreign params are named before a jitted step fails inside flax.

  Raises:
    TypeError: `config` is not a `ModelConfig` (e.g. a `Transformer` module: `load_model`
      returns the config, and flax failed on the module with an AttributeError).
    CheckpointError: naming `name` and the first tensor missing, extra, of another shape, or of
      a dtype that is not a real float (int weights ran as garbage, complex ones lost their
      imaginary part).
  """
  check_model_config(config, f'the model of {name}')
  _check_tree(param_shapes(config), params, name)
  for key, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise CheckpointError(f'{name}: tensor {jax.tree_util.keystr(key)} has dtype '
                            f'{jnp.result_type(leaf)}, not a floating-point dtype')


def check_model_destination(path) -> None:
  """Refuse to save a model into `path` when it is a directory that holds something else: it must
  not exist, be empty, or be a model directory (`params/`, or a save's SAVE_INCOMPLETE marker),
  which a save replaces. Writing into a Hugging Face checkpoint replaced its config.json and
  tokenizer.json, and `load_model` then read our model from it.

  Raises:
    ValueError: naming the directory and a few of its entries.
  """
  path = pathlib.Path(path)
  if not path.is_dir() or (path / 'params').is_dir() or (path / INCOMPLETE).exists():
    return
  entries = sorted(p.name for p in path.iterdir())
  if entries:
    shown = ', '.join(entries[:5]) + (', ...' if len(entries) > 5 else '')
    raise ValueError(f'{path} is a directory that holds no jaxspec model ({shown}): save into a '
                     f'new or empty directory, or a model directory to replace')


def save_model(path, config: ModelConfig, params, *, dtype: str = 'bfloat16',
               info: Optional[dict] = None) -> None:
  """Write a model directory (overwriting one that exists).

  Args:
    path: directory to create.
    params: the params pytree of `config`.
    dtype: storage dtype of the tensors ('bfloat16' halves the size; loading casts back).
    info: JSON-serialisable facts about training (tokens seen, held-out loss, ...); None
      removes an info.json left by an earlier save.
  Raises:
    ValueError: a dtype that is not a floating-point dtype (an integer one would truncate every
      weight), a weight that is NaN or infinite, or outside the dtype's range (float16:
      |x| > 65504 would be stored as inf; named), info that is not JSON (NaN included);
      CheckpointError: params that are not `config`'s (a tensor missing, extra, of the wrong
      shape or not of a float dtype: an int tensor would be cast and saved as weights). Both
      before anything is written. A save cut short (killed, disk full) leaves a SAVE_INCOMPLETE
      marker that the loaders refuse. A ValueError too for a directory that holds something
      else (`check_model_destination`).
  """
  dtype = floating_dtype(dtype)
  check_model_destination(path)
  check_params(config, params, 'params given to save_model')
  for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    check_fits(jax.tree_util.keystr(keys), leaf, dtype)
  try:
    info_text = None if info is None else json.dumps(info, indent=2, allow_nan=False) + '\n'
  except (TypeError, ValueError) as e:
    raise ValueError(f'info is not JSON-serialisable ({e}): {str(info)[:200]}') from None
  config_fields = dataclasses.asdict(config)
  config_text = json.dumps(config_fields, indent=2) + '\n'   # before any write
  stored = jax.tree.map(lambda x: np.asarray(x).astype(dtype), params)
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  # Until the marker goes, the directory mixes two saves: the loaders refuse it.
  (path / INCOMPLETE).write_text('a save_model into this directory has not finished\n')
  (path / CHECKSUMS).unlink(missing_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path / 'params', stored, force=True)
  write_checksums(path / CHECKSUMS, stored, config_fields)
  (path / 'config.json').write_text(config_text)
  if info_text is not None:
    (path / 'info.json').write_text(info_text)
  else:
    (path / 'info.json').unlink(missing_ok=True)
  (path / INCOMPLETE).unlink()


INCOMPLETE = 'SAVE_INCOMPLETE'


def check_complete(path: pathlib.Path) -> None:
  """CheckpointError if a `save_model` into `path` started and did not finish (its marker file
  is there): params, config and info may come from different saves."""
  if (path / INCOMPLETE).exists():
    raise CheckpointError(f'{path}: a save_model into it did not finish ({INCOMPLETE} is '
                          f'there), so its params, config and info may come from different '
                          f'saves: save the model again')


def read_config(path: pathlib.Path) -> ModelConfig:
  """The ModelConfig of `save_model` directory `path` (an existing directory whose save
  finished), once its params/ directory is known to be there.

  Raises:
    CheckpointError: config.json missing, not a valid ModelConfig or not the config the
      tensors were saved with (`check_saved_config`), or params/ missing (named).
  """
  fields = None
  try:
    fields = json.loads((path / 'config.json').read_text())
    config = ModelConfig(**fields)
  except FileNotFoundError as e:
    raise CheckpointError(f'{path / "config.json"} is missing') from e
  except (OSError, TypeError, ValueError) as e:    # JSONDecodeError, UnicodeDecodeError too
    hint = (" (a Hugging Face config.json? it names no 'architectures' or 'model_type')"
            if isinstance(fields, dict) and 'hidden_size' in fields else '')
    raise CheckpointError(f'{path / "config.json"} is not a valid ModelConfig: {e}{hint}') from e
  check_saved_config(path, config)
  if not (path / 'params').is_dir():
    raise CheckpointError(f'{path / "params"} is missing')
  return config


# Numerics, not properties of the weights: config.json may change them after a save (as may a
# smaller max_seq_len, which only bounds the positions used).
FREE_FIELDS = ('dtype', 'exact_verify')


def check_saved_config(path: pathlib.Path, config: ModelConfig) -> None:
  """Compare the ModelConfig read from `path`/config.json with the one its save listed in
  checksums.json (`checksums.listed_config`): the tensors' checksums cannot see a config edited
  or damaged beside them (num_heads 4 -> 2 with num_kv_heads halved and head_dim doubled keeps
  every shape and changes every token). Compared as ModelConfigs (defaults and rope_scaling
  spellings normalised), except FREE_FIELDS and a max_seq_len lowered. Nothing to compare for a
  directory saved before configs were listed.

  Raises:
    CheckpointError: fields that differ (each named, saved -> found); a listed config that is
      not a ModelConfig.
  """
  listed = listed_config(path / CHECKSUMS)
  if listed is None:
    return
  try:
    saved = dataclasses.asdict(ModelConfig(**listed))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f'{path / CHECKSUMS} lists a config that is not a ModelConfig: '
                          f'{e}') from e
  found = dataclasses.asdict(config)
  differ = [k for k in saved if k not in FREE_FIELDS and saved[k] != found[k] and not (
      k == 'max_seq_len' and found[k] < saved[k])]
  if differ:
    changes = ', '.join(f'{k}: {saved[k]!r} -> {found[k]!r}' for k in differ)
    raise CheckpointError(f'{path / "config.json"} differs from the config its tensors were '
                          f'saved with ({changes}): the directory was edited or damaged; save the '
                          f'model again with the config it should have (only '
                          f'{", ".join(FREE_FIELDS)} and a lower max_seq_len may change)')


def check_fits(name: str, x, dtype, fix: Optional[str] = None) -> None:
  """Whether tensor `x` (any shape; a numpy or jax array) holds only finite values, and can be
  cast to `dtype` without any becoming inf (float16's max is 65504). Both are checked on x's own
  device first (one reduction each), copying x to the host only to count what is out of range;
  a widening cast is not checked. A NaN weight makes every logit NaN: a target would fail each
  request, a draft would silently propose nothing (α = 0).

  Raises:
    ValueError: naming `name` and the count of NaN / inf values; or the count and the largest
      value out of range, and `fix` (what to do instead; default: save in a wider dtype).
  """
  source = x.dtype if hasattr(x, 'dtype') else np.asarray(x).dtype
  if jnp.issubdtype(source, jnp.floating) and np.size(x):
    xp = jnp if isinstance(x, jax.Array) else np
    if not bool(xp.isfinite(x).all()):
      count = int(np.size(x) - np.count_nonzero(np.isfinite(np.asarray(x))))   # int64
      raise ValueError(f'tensor {name} holds {count} NaN or infinite values (a diverged or '
                       f'damaged model)')
  target = jnp.dtype(dtype)
  wider = 'float32' if target == jnp.bfloat16 else 'bfloat16 or float32'
  fix = f'save in a wider dtype ({wider})' if fix is None else fix.format(wider=wider)
  if (not jnp.issubdtype(source, jnp.floating) or          # jnp: knows bfloat16 is a float
      float(jnp.finfo(target).max) >= float(jnp.finfo(source).max)):   # widening
    return
  if jnp.finfo(target).maxexp >= jnp.finfo(source).maxexp:   # same range: only the very top
    xp = jnp if isinstance(x, jax.Array) else np
    top = float(max(xp.max(x), -xp.min(x))) if np.size(x) else 0.0
    if math.isfinite(top) and np.isfinite(np.asarray(top, source).astype(target)):
      return
  x = np.asarray(x)
  with np.errstate(over='ignore'):
    bad = np.isfinite(x) & ~np.isfinite(x.astype(dtype))
  if bad.any():
    worst = float(np.abs(x[bad]).max())
    raise ValueError(f'tensor {name} holds {int(bad.sum())} values outside {np.dtype(dtype).name}'
                     f"'s range (up to {worst:.4g}; max {float(jnp.finfo(dtype).max):.4g}): cast, "
                     f'they would be inf; {fix}')


def floating_dtype(dtype) -> jnp.dtype:
  """`dtype` as a jnp.dtype if it is a floating-point one JAX can hold (float64 only with
  jax_enable_x64): the storage and load dtypes `save_model` and `load_model` accept.

  Raises:
    ValueError: naming the dtype.
  """
  try:
    if dtype is None:                  # jnp.dtype(None) is float64
      raise TypeError
    if jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
      if jax.dtypes.canonicalize_dtype(dtype) != jnp.dtype(dtype):
        raise ValueError(f'dtype {dtype!r} needs jax_enable_x64 (without it JAX would give '
                         f'{jax.dtypes.canonicalize_dtype(dtype)})')
      return jnp.dtype(dtype)
  except TypeError:
    pass
  raise ValueError(f'dtype must be a floating-point dtype (float32, bfloat16, float16), got '
                   f'{dtype!r}')


def load_model(path, dtype: str = 'float32'):
  """Read a model directory written by `save_model`, or a Hugging Face checkpoint directory
  (a config.json naming an architecture or model_type, with *.safetensors; see
  `jaxspec.models.hf.load_pretrained`).

  Args:
    path: the directory.
    dtype: dtype of the returned params (for a Hugging Face checkpoint also the compute dtype).
  Returns:
    (ModelConfig, params pytree).
  Raises:
    ValueError: a dtype that is not a floating-point dtype, or float64 without jax_enable_x64
      (named).
    CheckpointError: a save into the directory did not finish, the directory, config.json or
      params/ is missing or unreadable, the config
      has unknown or missing fields, a tensor is missing, has the wrong shape or holds NaN or
      infinite values (or values past float16's range when loading in float16), or a tensor's
      bytes differ from its checksum in checksums.json (named; a directory without
      checksums.json, written before they existed, loads unverified).
  """
  floating_dtype(dtype)
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise CheckpointError(f'no model directory at {path}')
  check_complete(path)        # also before a Hugging Face layout the save may be replacing
  from jaxspec.models import hf  # imports this module
  if hf.is_pretrained(path):
    return hf.load_pretrained(path, dtype)
  config = read_config(path)
  expected = param_shapes(config)
  check_orbax_metadata(path / 'params')
  try:
    with quiet_late_reads(), ocp.StandardCheckpointer() as ckptr:
      restored = ckptr.restore(path / 'params')
  except Exception as e:  # orbax raises many types for damaged files; name the path
    if out_of_memory(e):              # not damage: the device cannot hold the model
      raise
    raise restore_error('the checkpoint', path / 'params', e) from e
  _check_tree(expected, restored, f'checkpoint {path}')
  verify_checksums(path / CHECKSUMS, restored)
  _check_all_fit(restored, dtype, f'checkpoint {path}')
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), restored)
  return config, params


def _check_all_fit(tree, dtype, where: str) -> None:
  """CheckpointError naming `where` and the tensor if `tree` holds NaN or infinite weights, or
  loading it in `dtype` (float16) would turn finite weights into inf (`check_fits`). A jax.Array
  spread over processes is checked in the shards this process holds."""
  for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    whole = not isinstance(leaf, jax.Array) or leaf.is_fully_addressable
    for part in [leaf] if whole else [shard.data for shard in leaf.addressable_shards]:
      try:
        check_fits(jax.tree_util.keystr(keys), part, jnp.dtype(dtype),
                   fix='load in {wider}')
      except ValueError as error:
        raise CheckpointError(f'{where}: {error}') from error


def _check_tree(expected, restored, where: str) -> None:
  """CheckpointError, naming `where` and the tensor, unless `restored` has exactly the leaves of
  `expected` (by path) at their shapes."""
  flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
  flat_restored = dict(jax.tree_util.tree_flatten_with_path(restored)[0])
  names = lambda d: {jax.tree_util.keystr(k): v for k, v in d.items()}
  want, got = names(flat_expected), names(flat_restored)
  for name, leaf in want.items():
    if name not in got:
      raise CheckpointError(f'{where} is missing tensor {name}')
    if tuple(np.shape(got[name])) != tuple(leaf.shape):
      raise CheckpointError(f'{where}: tensor {name} has shape '
                            f'{tuple(np.shape(got[name]))}, config implies {tuple(leaf.shape)}')
  extra = sorted(set(got) - set(want))
  if extra:
    raise CheckpointError(f'{where} has unexpected tensors {extra[:5]}')


ASSETS = pathlib.Path(__file__).resolve().parent.parent / 'assets'


def shipped(name: str) -> pathlib.Path:
  """Path of a file or model directory shipped in `jaxspec/assets/` ('target', 'draft',
  'tokenizer.json'). Raises CheckpointError naming what exists when `name` is not there."""
  path = ASSETS / name
  if not path.exists():
    have = sorted(p.name for p in ASSETS.iterdir()) if ASSETS.is_dir() else []
    raise CheckpointError(f'no shipped asset {name!r} in {ASSETS} (found {have})')
  return path
