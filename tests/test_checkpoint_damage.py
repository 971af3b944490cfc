"""Orbax data damaged on disk: a model directory whose tensor files or manifest are corrupt or
cut short is refused with one error naming the path (and the tensor where orbax says), without
the tracebacks of the restore's reads still in flight."""

import pathlib
import subprocess
import sys
import types

import pytest

from jaxspec.models import CheckpointError, load_model
from test_checkpoint import _largest_data_file, saved  # noqa: F401 (fixture)

# A read of a corrupt tensor (these tests damage files on purpose) leaves orbax/TensorStore's
# pending read coroutines unfinished; the collector reports them when it frees them (conftest
# collects after each file), as warnings about orbax's internals, not about these tests.
pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')


def test_corrupt_params_is_named(saved):
  path, _, _ = saved
  json_files = ('_METADATA', '_CHECKPOINT_METADATA')
  for f in (path / 'params').rglob('*'):
    if f.is_file() and f.stat().st_size > 0 and f.name not in json_files:
      f.write_bytes(b'\x00garbage' * 4)
  with pytest.raises(CheckpointError, match='cannot read the checkpoint') as error:
    load_model(path)
  assert 'tensorstore_spec' not in str(error.value)
  meta = path / 'params' / '_METADATA'                 # checked before orbax reads anything
  meta.write_bytes(meta.read_bytes()[:len(meta.read_bytes()) // 2])
  with pytest.raises(CheckpointError, match=r'params/_METADATA is damaged \(not JSON'):
    load_model(path)


def test_a_truncated_tensor_file_is_one_error_without_late_tracebacks(saved):
  # The restore's other reads, still in flight when it raised, each printed a traceback ('Event
  # loop is closed', 'Task exception was never retrieved') in the seconds after or at exit.
  path, _, _ = saved
  data = _largest_data_file(path)
  data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
  code = ('import time\nfrom jaxspec.models import CheckpointError, load_model\n'
          f'try:\n  load_model({str(path)!r})\nexcept CheckpointError as error:\n'
          '  print("refused:", error)\ntime.sleep(1)\n')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        timeout=120, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert proc.returncode == 0 and 'refused: cannot read the checkpoint' in proc.stdout, \
      proc.stdout + proc.stderr
  assert 'Traceback' not in proc.stderr and 'never retrieved' not in proc.stderr, proc.stderr


def test_a_damaged_manifest_is_named_in_a_few_hundred_characters(saved):
  # tensorstore appends its whole spec (~800 characters of JSON) to the reason.
  path, _, _ = saved
  (path / 'params' / 'manifest.ocdbt').write_bytes(b'garbage')
  with pytest.raises(CheckpointError, match='manifest.ocdbt') as error:
    load_model(path)
  reason = str(error.value).split(f'{path / "params"}: ', 1)[1]    # orbax's part, cut to 400
  assert 'tensorstore_spec' not in reason and len(reason) <= 400


def test_quieting_late_reads_drops_only_the_closed_loop_errors(monkeypatch):
  """The hooks `quiet_late_reads` installs drop RuntimeError('Event loop is closed') and pass every
  other report to the hooks they replaced."""
  from jaxspec.models import restore_errors
  seen = []
  monkeypatch.setattr(sys, 'excepthook', lambda kind, error, tb: seen.append(('except', error)))
  monkeypatch.setattr(sys, 'unraisablehook', lambda report: seen.append(('raise', report)))
  restore_errors._install_quiet_hooks()
  closed, other = RuntimeError('Event loop is closed'), RuntimeError('something else')
  sys.excepthook(RuntimeError, closed, None)
  sys.excepthook(RuntimeError, other, None)
  report = types.SimpleNamespace(exc_value=closed)
  sys.unraisablehook(report)
  kept = types.SimpleNamespace(exc_value=other)
  sys.unraisablehook(kept)
  assert seen == [('except', other), ('raise', kept)]


def test_late_read_hooks_are_in_place_during_a_restore_and_stay_only_if_it_raises(monkeypatch):
  """`quiet_late_reads` installs its hooks before the body runs (a read failing just after the
  restore raised printed a traceback when they came later), removes them when the body returns
  and keeps them when it raises."""
  import logging
  from jaxspec.models import restore_errors
  own_raise, own_except = (lambda report: None), (lambda kind, error, tb: None)
  monkeypatch.setattr(sys, 'unraisablehook', own_raise)
  monkeypatch.setattr(sys, 'excepthook', own_except)
  log = logging.getLogger('asyncio')
  monkeypatch.setattr(log, 'filters', [])
  installed = lambda: (sys.unraisablehook is not own_raise and sys.excepthook is not own_except
                       and restore_errors._drop_unretrieved in log.filters)
  with restore_errors.quiet_late_reads():
    assert installed()
  assert sys.unraisablehook is own_raise and sys.excepthook is own_except and not log.filters
  with pytest.raises(ValueError, match='restore failed'):
    with restore_errors.quiet_late_reads():
      raise ValueError('restore failed')
  assert installed()
  with restore_errors.quiet_late_reads():      # already installed: left as they are after the body
    pass
  assert installed()


def test_the_asyncio_filter_drops_unread_task_and_future_errors_only():
  from jaxspec.models import restore_errors
  import logging
  def record(msg):
    return logging.LogRecord('asyncio', logging.ERROR, __file__, 1, msg, None, None)
  for kind in ('Task', 'Future', '_GatheringFuture'):
    report = record(f'{kind} exception was never retrieved\nfuture: x')
    assert not restore_errors._drop_unretrieved(report)
  assert restore_errors._drop_unretrieved(record('Task was destroyed but it is pending!'))
