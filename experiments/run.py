"""Run one experiment from a config file.

    python -m experiments.run                                     # speculative decoding, default
    python -m experiments.run --config=configs/speculative.py --config.k=8 --workdir=/tmp/run
    python -m experiments.run --config=configs/speculative.py:smoke

Results land in WORKDIR/EXPERIMENT/RUN_ID/ (config.json, environment.json, results.jsonl). In a
multi-process run (config.distributed or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID) every process runs the experiment as one program and process 0 alone writes the
results.
"""

import os
import pathlib
import shutil
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.common import (DEFAULT_CONFIG, exit_config_error, exit_unknown_field,
                                import_experiment, parse_flags, validate, warn_if_busy)
from experiments.records import DiscardedResults, Results, new_run_dir
from jaxspec.checks import nearest_existing
from jaxspec.models.restore_errors import out_of_memory
from jaxspec.parallel import distributed

try:  # with the default config file, overrides are applied here, at definition
  _CONFIG = config_flags.DEFINE_config_file(
      'config', DEFAULT_CONFIG, 'Experiment config file (path[:variant]).',
      lock_config=True)
except (AttributeError, KeyError) as _error:
  exit_unknown_field(_error, sys.argv)
except OSError as _error:   # an override of the default config, which could not be loaded
  exit_config_error(_error)
_WORKDIR = flags.DEFINE_string('workdir', 'runs', 'Root directory for results.')
_TRACEBACK = flags.DEFINE_bool('traceback', False, 'Show the traceback of a bad-input error '
                               '(ValueError, FileNotFoundError, FloatingPointError: training '
                               'diverged; default: one FATAL line naming the bad value).')


def check_workdir(workdir) -> None:
  """ValueError unless run directories can be made under `workdir`: the nearest existing
  directory on its path is a writable directory."""
  start = nearest_existing(os.path.realpath(workdir))   # '..' as `new_run_dir` resolves it
  if not start.is_dir() or not os.access(start, os.W_OK | os.X_OK):
    raise ValueError(f'cannot make a run directory under --workdir={workdir}: {start} is '
                     f'{"not a directory" if not start.is_dir() else "not writable"}')


def _remove_empty_parents(run_dir: pathlib.Path, made_from: pathlib.Path) -> None:
  """Remove the directories between `run_dir` and `made_from` (the nearest one that existed
  before the run, e.g. WORKDIR/EXPERIMENT; both with links and '..' resolved) that the run
  made and left empty."""
  for parent in pathlib.Path(os.path.realpath(run_dir)).parents:
    if parent == made_from or made_from not in parent.parents:
      return
    try:
      parent.rmdir()                     # only an empty directory: another run's stay
    except OSError:
      return


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
  config = _CONFIG.value
  try:
    if distributed.settings(config.get('distributed')).process_id == 0:
      # Process 0 writes the results: a workdir it cannot use ends the run before it joins
      # (after, the others failed half a minute later with an error about the checkpoint).
      check_workdir(_WORKDIR.value)
    # Before any device is touched; with 1 process a no-op.
    distributed.initialize(config.get('distributed'))
    module = import_experiment(config.experiment)
    validate(module, config)             # before a run directory is made
    if distributed.is_primary():
      # Resolved: a '..' after a folder that does not exist yet is not where the run writes.
      made_from = nearest_existing(os.path.realpath(pathlib.Path(_WORKDIR.value) /
                                                    config.experiment))
      try:
        run_dir = new_run_dir(_WORKDIR.value, config.experiment)
      except OSError as error:     # exists as a file, not a directory, no permission, read-only
        raise ValueError(f'cannot make a run directory under --workdir={_WORKDIR.value}: '
                         f'{error}') from error
  except ValueError as error:          # bad input before anything runs: one line
    if _TRACEBACK.value:
      raise
    sys.exit(f'FATAL: {error}')
  if not distributed.is_primary():
    module.run(config, DiscardedResults())
    return
  print(f'results -> {run_dir}', flush=True)
  warn_if_busy()
  results = Results(run_dir, config)
  try:
    module.run(config, results)
  except BaseException as error:
    removed = ''
    if not results.records:               # nothing measured: leave no empty run directory
      shutil.rmtree(run_dir, ignore_errors=True)
      _remove_empty_parents(run_dir, made_from)
      removed = f'; nothing was measured, {run_dir} removed'
    # Bad input (a bad value, a missing file named in the config, a learning rate that diverged):
    # one line.
    if (isinstance(error, (ValueError, FileNotFoundError, FloatingPointError)) and
        not _TRACEBACK.value):
      sys.exit(f'FATAL: {error} (--traceback shows where{removed})')
    if out_of_memory(error) and not _TRACEBACK.value:   # sized past the device's memory
      first = str(error).strip().splitlines()[0]
      sys.exit(f'FATAL: out of device memory ({first[:300]}): the model at its dtype or a config '
               f'size (pool pages, batch, requests) is too large for this device (--traceback '
               f'shows where{removed})')
    raise
  print(f'done; results in {run_dir / "results.jsonl"}', flush=True)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
