"""Runs the command-line programs for the CLI tests from one warm process.

A CLI test that starts `python -m experiments.run ...` spends ~3-4 s of its ~4 s importing jax,
flax, optax, orbax and jaxspec before the program reads its first flag; tests/test_cli_errors.py
started ~90 of them (~400 s of a CI run's test time). This server imports those libraries once
and forks a child per run: the child sets `sys.argv`, `sys.path[0]`, the working directory and
fds 0-2 as a fresh interpreter would for `python -m MODULE ARGS`, `python SCRIPT ARGS` or
`python -c CODE ARGS` (stdin empty), runs the program as `__main__` (its own module code runs
anew: experiments.run and .sweep, which define absl flags when they run, are not imported here)
and exits with the status the interpreter would give (`SystemExit` with a message prints it and
exits 1; an uncaught exception prints its traceback and exits 1), after the atexit handlers.
The fork happens before any JAX backend exists (checked at start-up), so no XLA thread is
forked; a program that uses a device starts its own backend in the child.

Runs that need a different environment (JAX_* or XLA_FLAGS, another PYTHONPATH) are not for
this server: it imported jax under the test run's environment. Those tests start their own
`subprocess.run`.

Protocol (stdin/stdout of `python tests/cli_server.py`, one JSON object per line): request
{"args": ["-m", "experiments.run", "--config=..."], ["scripts/x.py", ...] or ["-c", CODE, ...],
"cwd": DIR, "timeout": SECONDS}; answer {"returncode": int, "stdout": str, "stderr": str,
"timed_out": bool} (a child still running at its timeout is killed: returncode -9, timed_out true).
"""

import atexit
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]

WARM_MODULES = ('numpy', 'jax', 'jax.numpy', 'flax.linen', 'optax', 'orbax.checkpoint',
                'ml_collections', 'ml_collections.config_flags', 'absl.app', 'absl.flags',
                'tokenizers', 'jaxspec', 'jaxspec.engine', 'jaxspec.decoding', 'jaxspec.kernels',
                'jaxspec.hydration', 'jaxspec.training', 'experiments.common',
                'experiments.records')


def _child(args, cwd, out_fd, err_fd) -> None:
  """In the forked child: run `args` as `python ARGS` would, in `cwd`; never returns."""
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # not the server's requests
  os.dup2(out_fd, 1)
  os.dup2(err_fd, 2)
  os.chdir(cwd)
  code = 1
  try:
    if args[0] == '-m':
      sys.argv = [args[1], *args[2:]]     # runpy sets argv[0] to the module's file
      sys.path[:2] = [cwd]                # was [repository root, tests/] (`__main__` below)
      runpy.run_module(args[1], run_name='__main__', alter_sys=True)
    elif args[0] == '-c':
      sys.argv = ['-c', *args[2:]]
      sys.path[:2] = ['']
      program = compile(args[1], '<string>', 'exec')
      exec(program, {'__name__': '__main__'})  # pylint: disable=exec-used
    else:
      sys.argv = list(args)
      sys.path[:2] = [os.path.dirname(os.path.abspath(args[0]))]
      runpy.run_path(args[0], run_name='__main__')
    code = 0
  except SystemExit as exit_:
    if exit_.code is None:
      code = 0
    elif isinstance(exit_.code, int):
      code = exit_.code
    else:                                  # sys.exit('message'): printed, status 1
      print(exit_.code, file=sys.stderr)
      code = 1
  except BaseException:  # pylint: disable=broad-except  (what the interpreter does with it)
    traceback.print_exc()
    code = 1
  finally:
    try:
      atexit._run_exitfuncs()  # pylint: disable=protected-access
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(code)  # pylint: disable=protected-access


def _run(request) -> dict:
  """Fork a child for one request and wait for it (killed at its timeout)."""
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    pid = os.fork()
    if pid == 0:
      _child(request['args'], request['cwd'], out.fileno(), err.fileno())
    deadline = time.monotonic() + request.get('timeout', 120)
    timed_out = False
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        timed_out = True
        break
      time.sleep(0.01)
    texts = []
    for f in (out, err):
      f.seek(0)
      texts.append(f.read().decode(errors='replace'))
  return {'returncode': os.waitstatus_to_exitcode(status), 'stdout': texts[0],
          'stderr': texts[1], 'timed_out': timed_out}


class CliServer:
  """The tests' side: starts the server at the first `run` (~4 s of imports, once per test
  process) and sends it runs."""

  def __init__(self):
    self._proc = None
    self._log = None

  def run(self, args, cwd=ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python ARGS` (ARGS: ['-m', MODULE, ...], [SCRIPT, ...] or ['-c', CODE, ...]) in
    `cwd` with the test process's environment; like `subprocess.run(..., capture_output=True,
    text=True, timeout=timeout)`: subprocess.TimeoutExpired past `timeout` seconds."""
    if self._proc is None or self._proc.poll() is not None:
      self._start()
    request = {'args': [str(a) for a in args], 'cwd': str(cwd), 'timeout': timeout}
    self._proc.stdin.write(json.dumps(request) + '\n')
    self._proc.stdin.flush()
    answer = self._read()
    argv = [sys.executable, *request['args']]
    if answer['timed_out']:
      raise subprocess.TimeoutExpired(argv, timeout, answer['stdout'], answer['stderr'])
    return subprocess.CompletedProcess(argv, answer['returncode'], answer['stdout'],
                                       answer['stderr'])

  def _start(self) -> None:
    self.close()
    self._log = tempfile.TemporaryFile()
    self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._log, text=True)
    line = self._proc.stdout.readline()
    if line.strip() != 'ready':
      self._fail(f'did not start ({line!r})')

  def _read(self) -> dict:
    line = self._proc.stdout.readline()
    if not line:
      self._fail('ended')
    return json.loads(line)

  def _fail(self, what: str) -> None:
    self._log.seek(0)
    log = self._log.read().decode(errors='replace')[-3000:]
    self.close()
    raise RuntimeError(f'tests/cli_server.py {what}: {log}')

  def close(self) -> None:
    if self._proc is not None:
      try:
        self._proc.stdin.close()              # the server's loop ends
        self._proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        self._proc.kill()
        self._proc.wait()
      self._proc = None
    if self._log is not None:
      self._log.close()
      self._log = None


def main() -> None:
  import importlib  # pylint: disable=import-outside-toplevel
  for name in WARM_MODULES:
    importlib.import_module(name)
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if xla_bridge._backends:  # pylint: disable=protected-access
    sys.exit('cli_server: a JAX backend started while importing; forking it is unsafe')
  channel = os.fdopen(os.dup(1), 'w')    # answers; the children's fd 1 goes to their files
  print('ready', file=channel, flush=True)
  for line in sys.stdin:
    print(json.dumps(_run(json.loads(line))), file=channel, flush=True)


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main()
