"""`checksums.json` of a model directory (or a training state): a SHA-256 per stored tensor,
checked when every tensor is whole in this process, and split-independent sums
(`jaxspec.models.shard_sums`) checked when tensors are spread over processes. A flipped byte in
orbax's data files otherwise restores without complaint."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import warnings
from typing import Optional

import jax
import numpy as np

from jaxspec.models.shard_sums import tensor_sums


class CheckpointError(ValueError):
  """A model directory is missing, incomplete or does not match its config."""


CHECKSUMS = 'checksums.json'


def _leaves(tree) -> dict:
  """{'params/layer_0/attn/q/kernel': numpy array} of `tree`'s leaves, on the host."""
  return {jax.tree_util.keystr(key, simple=True, separator='/'): np.asarray(leaf)
          for key, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tensor_checksums(tree) -> dict:
  """SHA-256 (hex) of each leaf of `tree`, keyed by its '/'-joined pytree path: over the leaf's
  dtype name, shape and C-order bytes, so a value, a dtype or a shape that changed all change
  it. Leaves are brought to host memory (numpy) to be hashed."""
  return _digests(_leaves(tree))


def _digests(leaves: dict) -> dict:
  sums = {}
  for name, array in leaves.items():
    array = np.ascontiguousarray(array)
    digest = hashlib.sha256(f'{array.dtype.name}{array.shape}'.encode())
    digest.update(array.tobytes())
    sums[name] = digest.hexdigest()
  return sums


def write_checksums(file, tree, config: Optional[dict] = None) -> None:
  """Write `tensor_checksums(tree)`, each leaf's dtype and its split-independent sum
  (`shard_sums.tensor_sums`, float leaves) to `file` as JSON (through a temporary file and a
  rename, so the file is whole or absent); with `config` (a model directory's config.json
  fields, JSON-serialisable) that too, which `checkpoint.check_saved_config` compares
  config.json against."""
  file = pathlib.Path(file)
  leaves = _leaves(tree)
  dtypes = {name: array.dtype.name for name, array in leaves.items()}
  listing = {'sha256': _digests(leaves), 'dtype': dtypes, 'sum32': tensor_sums(tree)}
  if config is not None:
    listing['config'] = json.loads(json.dumps(config))
  text = json.dumps(listing, indent=1, sort_keys=True) + '\n'
  partial = file.with_name(file.name + '.partial')
  partial.write_text(text)
  os.replace(partial, file)


def verify_checksums(file, tree) -> None:
  """Check each leaf of `tree` (as restored: the stored dtype) against `file` written by
  `write_checksums`; when `file` does not exist, a warning says the tensors are unverified.

  Raises:
    CheckpointError: `file` unreadable or malformed, a tensor restored in another dtype than it
      was saved in, a tensor whose bytes differ from its checksum (the first one, by name), or
      tensors the file and the tree do not share.
  """
  file = pathlib.Path(file)
  if not file.exists():
    warnings.warn(f'{file.parent} has no {file.name}: its tensors are loaded unverified (written '
                  'before checksums existed, by a save cut short, or the file was removed)',
                  stacklevel=3)
    return
  try:
    listed = json.loads(file.read_text())
    want, dtypes = listed['sha256'], listed.get('dtype', {})
    if not isinstance(want, dict) or not isinstance(dtypes, dict):
      raise ValueError("'sha256' and 'dtype' must be objects")
  except (OSError, ValueError, KeyError, TypeError) as e:   # JSONDecodeError, UnicodeDecodeError
    raise CheckpointError(f'{file} is unreadable or malformed: {e!r}') from e
  leaves = _leaves(tree)
  _compare(file, 'checksum', want, _digests(leaves), dtypes,
           {name: array.dtype.name for name, array in leaves.items()})


def _compare(file, what: str, want: dict, got: dict, dtypes: dict, restored: dict) -> None:
  """CheckpointError for the first way a restored tree differs from `file`'s listing: `want` /
  `got` {name: checksum or sum} listed and computed, `dtypes` / `restored` {name: dtype name}
  saved and restored; `what` names the kind of check ('checksum', 'sum')."""
  if set(want) != set(got):
    odd = sorted(set(want) ^ set(got))
    raise CheckpointError(f'{file} does not list {what}s of the same tensors as the checkpoint '
                          f'beside it (differing: {odd[:5]})')
  for name, dtype in restored.items():
    if name in dtypes and dtypes[name] != dtype:
      raise CheckpointError(f'{file.parent}: tensor {name} was saved as {dtypes[name]} and '
                            f'restored as {dtype}: restore it in its saved dtype')
  bad = [name for name in got if got[name] != want[name]]
  if bad:
    raise CheckpointError(f'{file.parent}: tensor {bad[0]} does not match its {what} in '
                          f'{file.name} ({len(bad)} of {len(got)} tensors differ): the checkpoint '
                          f'is damaged; write it again (or restore it from a copy)')


def listed_config(file) -> Optional[dict]:
  """The config fields a model directory's save listed in `file` (`write_checksums`), or None
  when `file` is missing or lists none (written before configs were listed); the checkpoint
  loaders compare config.json with it (`checkpoint.read_config`).

  Raises:
    CheckpointError: `file` unreadable or malformed.
  """
  file = pathlib.Path(file)
  if not file.exists():
    return None
  try:
    listed = json.loads(file.read_text()).get('config')
    if listed is not None and not isinstance(listed, dict):
      raise ValueError("'config' must be an object")
  except (OSError, ValueError, AttributeError) as e:   # JSONDecodeError, UnicodeDecodeError
    raise CheckpointError(f'{file} is unreadable or malformed: {e!r}') from e
  return listed


def listed_sums(file) -> tuple:
  """(sums, dtypes) that `write_checksums` put in `file`: ({name: int}, {name: dtype name}), or
  (None, {}) when there is no `file` or it was written before the sums existed.

  Raises:
    CheckpointError: `file` unreadable or malformed.
  """
  file = pathlib.Path(file)
  if not file.exists():
    return None, {}
  try:
    listed = json.loads(file.read_text())
    want, dtypes = listed.get('sum32'), listed.get('dtype', {})
    if (want is not None and not isinstance(want, dict)) or not isinstance(dtypes, dict):
      raise ValueError("'sum32' and 'dtype' must be objects")
  except (OSError, ValueError, AttributeError) as e:   # JSONDecodeError, UnicodeDecodeError
    raise CheckpointError(f'{file} is unreadable or malformed: {e!r}') from e
  return want, dtypes


def verify_sums(file, tree) -> bool:
  """Check each float leaf of `tree` (as restored: the stored dtype; sharded arrays too, across
  processes) against the split-independent sums `write_checksums` put in `file`.

  Returns:
    False when there is nothing to check against (no `file`, or one written before the sums
    existed); True when every float tensor matched.
  Raises:
    CheckpointError: `file` unreadable or malformed, a tensor restored in another dtype than it
      was saved in, tensors the file's sums and the tree's float leaves do not share, or a
      tensor whose sum differs (named).
  """
  want, dtypes = listed_sums(file)
  if want is None:
    return False
  restored = {jax.tree_util.keystr(key, simple=True, separator='/'): np.dtype(leaf.dtype).name
              for key, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  _compare(file, 'sum', want, tensor_sums(tree), dtypes, restored)
  return True
