"""How jaxspec reads an orbax restore that failed: the damaged-metadata check before it,
one `CheckpointError` naming the path and orbax's reason after it (`restore_error`,
`orbax_reason`), the device out-of-memory error passed on as it is (`out_of_memory`), and the
late tracebacks of the restore's reads still in flight kept quiet (`quiet_late_reads`). Used by
`jaxspec.models.checkpoint`, `jaxspec.parallel.checkpoint` and `jaxspec.training.resume`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import re
import sys

import jax

from jaxspec.models.checksums import CheckpointError


def out_of_memory(error: BaseException) -> bool:
  """Whether `error` is JAX's device out-of-memory error (RESOURCE_EXHAUSTED), which the
  loaders pass on as it is instead of reporting a damaged checkpoint."""
  return isinstance(error, jax.errors.JaxRuntimeError) and 'RESOURCE_EXHAUSTED' in str(error)


def check_orbax_metadata(directory: pathlib.Path) -> None:
  """Refuse an orbax checkpoint directory whose JSON metadata files do not parse, before orbax
  reads it: a damaged one failed inside orbax's restore while its array reads were in flight,
  and each of those then printed an 'Event loop is closed' traceback around the one error.

  Raises:
    CheckpointError: naming the file that is not JSON.
  """
  directory = pathlib.Path(directory)
  files = [directory / name for name in ('_METADATA', '_CHECKPOINT_METADATA', '_sharding')]
  files += sorted((directory / 'array_metadatas').glob('*'))
  for file in files:
    if file.is_file():
      try:
        json.loads(file.read_bytes())
      except (OSError, ValueError) as error:
        raise CheckpointError(f'{file} is damaged (not JSON: {error})') from error


def restore_error(what: str, directory, error: Exception) -> CheckpointError:
  """The CheckpointError for an orbax restore of `directory` that raised `error`: 'cannot read
  {what} at {directory}: {orbax_reason(error)}'. Run the restore inside `quiet_late_reads()`."""
  return CheckpointError(f'cannot read {what} at {directory}: {orbax_reason(error)}')


@contextlib.contextmanager
def quiet_late_reads():
  """Context manager around an orbax restore. When a restore raises, its other array reads
  still in flight fail or finish after its event loop has closed, each reported with a
  traceback around the one error (1-17 of them for a truncated data file, during the next
  seconds or at exit): RuntimeError('Event loop is closed') through `sys.unraisablehook` and,
  from tensorstore's completion threads, through `sys.excepthook` (a bare traceback), and
  asyncio's 'Task (or Future) exception was never retrieved' through the 'asyncio' logger.

  Installs hooks that drop the first kind and pass every other report to the hooks they
  replaced, and a filter on that logger that drops the second kind, before the restore starts
  (installed only after it raised, a read failing in between still printed: 1 run in ~7); keeps
  them for the rest of the process when the body raises, removes them when it returns."""
  undo = _install_quiet_hooks()
  yield              # an error from the body is raised here, and the hooks stay installed
  undo()


def _install_quiet_hooks():
  """Installs `quiet_late_reads`' hooks and logging filter unless they are installed; returns
  a function that removes what this call installed (where nothing replaced it since)."""
  if getattr(sys.unraisablehook, '_drops_closed_loop', False):
    return lambda: None
  previous_raise, previous_except = sys.unraisablehook, sys.excepthook

  def hook(report):
    error = report.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'):
      previous_raise(report)

  # tensorstore's completion callbacks call the closed loop's call_soon_threadsafe from its own
  # threads and print what that raises through sys.excepthook (2026-12-05: in most runs of a
  # truncated data file, before this hook).
  def excepthook(kind, error, traceback):
    if not (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'):
      previous_except(kind, error, traceback)

  hook._drops_closed_loop = True
  sys.unraisablehook, sys.excepthook = hook, excepthook
  asyncio_log = logging.getLogger('asyncio')
  added = _drop_unretrieved not in asyncio_log.filters
  if added:
    asyncio_log.addFilter(_drop_unretrieved)

  def undo():
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous_raise
    if sys.excepthook is excepthook:
      sys.excepthook = previous_except
    if added:
      asyncio_log.removeFilter(_drop_unretrieved)
  return undo


def _drop_unretrieved(record: logging.LogRecord) -> bool:
  """A logging filter: False for asyncio's 'Task exception was never retrieved' reports (and
  'Future ...', '_GatheringFuture ...': the class of the object whose error went unread)."""
  return not str(record.msg).split('\n', 1)[0].endswith(' exception was never retrieved')


def orbax_reason(error: Exception, limit: int = 400) -> str:
  """The readable part of an error orbax / tensorstore raised on a damaged checkpoint: without
  the tensorstore spec it appends (~800 characters of JSON, or a `See full TensorStore details:
  <bound method ...>` repr, from which only the array's key is kept), cut to `limit`
  characters."""
  full = str(error)
  text = re.sub(r'\s*\[tensorstore_spec=.*?\]\s*$', '', full, flags=re.S).strip()
  text, details, _ = text.partition('See full TensorStore details')
  text = text.strip()
  # The spec's paths: the file store's directory (absolute), then the array's key inside it.
  keys = [k for k in re.findall(r"'path': '([^']+)'", full) if not k.startswith('/')]
  if details and keys:
    text += f' (tensor {keys[-1].rstrip("/")})'
  return text if len(text) <= limit else text[:limit - 3] + '...'
