"""A resumable training state on disk: params, optimizer state, the steps done and the last
loss, written with orbax beside the arguments that produced it (so a resume with other
arguments is refused instead of silently mixing two runs) and a checksum per array (so a damaged
state is refused instead of silently resuming from changed weights)."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Optional

import numpy as np
import orbax.checkpoint as ocp

from jaxspec.models.checkpoint import (CHECKSUMS, CheckpointError, verify_checksums,
                                       write_checksums)
from jaxspec.models.restore_errors import check_orbax_metadata, quiet_late_reads, restore_error


class TrainState:
  """`DIR/state` (an orbax pytree checkpoint holding also our `checksums.json`) and
  `DIR/args.json` of one training run.

  A save never leaves the directory without a whole state: the new one is written to
  `DIR/state.new`, then the old one is renamed `DIR/state.old`, the new one `DIR/state`, and the
  old one removed; a run killed between the two renames is resumed from `DIR/state.old`.

  Args:
    path: the directory (created at the first `save`).
    args: the run's arguments that must match on resume (JSON-serialisable: sizes, rates,
      seed, the model's parameter count).
  """

  def __init__(self, path, args: dict):
    self.path = pathlib.Path(path).absolute()
    self.args = json.loads(json.dumps(args))        # as a reread args.json would be

  def save(self, params, opt_state, step: int, loss: float) -> None:
    """Write the state after `step` steps, replacing the previous one (waits for the write).
    args.json goes first: a state on disk always has the arguments it is checked against."""
    self.path.mkdir(parents=True, exist_ok=True)
    (self.path / 'args.json').write_text(json.dumps(self.args, indent=2) + '\n')
    state = dict(params=params, opt_state=opt_state, step=np.array(step, np.int64),
                 loss=np.array(loss, np.float32))
    new, current, old = (self.path / name for name in ('state.new', 'state', 'state.old'))
    for leftover in self.path.glob('state.new*'):   # a save cut short (orbax's temporary too)
      shutil.rmtree(leftover)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(new, state)
    write_checksums(new / CHECKSUMS, state)
    if current.exists():
      if old.exists():
        shutil.rmtree(old)
      current.rename(old)
    new.rename(current)
    shutil.rmtree(old, ignore_errors=True)
    (self.path / CHECKSUMS).unlink(missing_ok=True)   # the layout before checksums moved in

  def restore(self, params, opt_state) -> Optional[tuple]:
    """(params, opt_state, step, loss) of a saved state shaped like the given ones, or None
    when there is none.

    Raises:
      CheckpointError: a state written with other arguments (naming them), unreadable, or an
        array whose bytes differ from its checksum (named).
    """
    if not (self.path / 'state').exists() and (self.path / 'state.old').exists():
      (self.path / 'state.old').rename(self.path / 'state')   # killed between save's renames
    if not (self.path / 'state').exists():
      return None
    try:
      saved = json.loads((self.path / 'args.json').read_text())
    except (OSError, ValueError) as e:
      raise CheckpointError(f'{self.path / "args.json"} is missing or unreadable: {e}') from e
    if not isinstance(saved, dict):
      raise CheckpointError(f'{self.path / "args.json"} is not a JSON object of arguments, got '
                            f'{type(saved).__name__}')
    differ = sorted(k for k in set(saved) | set(self.args) if saved.get(k) != self.args.get(k))
    if differ:
      changes = ', '.join(f'{k}: {saved.get(k)!r} -> {self.args.get(k)!r}' for k in differ)
      raise CheckpointError(f'the training state in {self.path} was written with other '
                            f'arguments ({changes}): resume with the same ones, or use another '
                            f'checkpoint directory')
    target = dict(params=params, opt_state=opt_state, step=np.array(0, np.int64),
                  loss=np.array(0.0, np.float32))
    check_orbax_metadata(self.path / 'state')
    try:
      with quiet_late_reads(), ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(self.path / 'state', target)
    except Exception as e:  # orbax raises many types for damaged files; name the path
      raise restore_error('the training state', self.path / 'state', e) from e
    inside = self.path / 'state' / CHECKSUMS
    verify_checksums(inside if inside.exists() else self.path / CHECKSUMS, state)
    return state['params'], state['opt_state'], int(state['step']), float(state['loss'])
