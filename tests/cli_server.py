"""Runs the command-line programs for the CLI tests from one warm process.

A CLI test that starts `python -m experiments.run ...` spends ~3-4 s of its ~4 s importing jax,
flax, optax, orbax and jaxspec before the program reads its first flag; tests/test_cli_errors.py
started ~90 of them (~400 s of a CI run's test time). This server imports those libraries once
and forks a child per run. The child leaves the server's loop and becomes the program: it sets
`sys.argv`, `sys.path[0]`, the working directory, `__main__` and fds 0-2 (stdin empty) as a
fresh interpreter would for `python -m MODULE ARGS`, `python SCRIPT ARGS` or `python -c CODE
ARGS`, runs the program, and lets its end (a return, `SystemExit`, an uncaught exception) reach
the top level of this script, so the interpreter's own shutdown runs as in a fresh process:
the traceback through `sys.excepthook`, the status, non-daemon threads waited for, atexit
handlers, finalizers ("Exception ignored in ..." reports) and the final flush. The fork happens
before any JAX backend exists (checked at start-up), so no XLA thread is forked; a program that
uses a device starts its own backend in the child.

What differs from a fresh interpreter: the modules of `WARM_MODULES` are imported already, so a
program finds them even where a fresh run from another directory, or a script without its own
`sys.path` entry for the repository, would not (the CLI tests run from the repository root), and
running one of them with `-m` warns that it is in sys.modules. The environment is the one the
server started with (`CliServer` copies the test process's when it is made): runs that need
another one (JAX_* or XLA_FLAGS read at import, another PYTHONPATH) start their own
`subprocess.run`.

Protocol (stdin/stdout of `python tests/cli_server.py`, one JSON object per line): request
{"args": ["-m", "experiments.run", "--config=..."], ["scripts/x.py", ...] or ["-c", CODE, ...],
"cwd": DIR, "timeout": SECONDS}; answer {"returncode": int, "stdout": str, "stderr": str,
"timed_out": bool} (a child still running at its timeout is killed: returncode -9, timed_out
true).
"""

import importlib
import importlib.util
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]

WARM_MODULES = ('numpy', 'jax', 'jax.numpy', 'flax.linen', 'optax', 'orbax.checkpoint',
                'ml_collections', 'ml_collections.config_flags', 'absl.app', 'absl.flags',
                'tokenizers', 'jaxspec', 'jaxspec.engine', 'jaxspec.decoding', 'jaxspec.kernels',
                'jaxspec.hydration', 'jaxspec.training', 'experiments.common',
                'experiments.records')


def _become(args, cwd, out_fd, err_fd, path) -> None:
  """In the forked child: set up as `python ARGS` in `cwd` would be (`path`: sys.path after its
  first entry) and run the program; its return, SystemExit or exception goes on up to the
  interpreter."""
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # not the server's requests
  os.dup2(out_fd, 1)
  os.dup2(err_fd, 2)
  sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # pylint: disable=R1732
  os.chdir(cwd)
  if args[0] == '-m':
    sys.argv = [args[1], *args[2:]]       # runpy sets argv[0] to the module's file
    sys.path[:] = [cwd, *path]
    try:
      found = importlib.util.find_spec(args[1])
    except ImportError as error:          # a parent package that is not there
      sys.exit(f'{sys.executable}: Error while finding module specification for {args[1]!r} '
               f'({type(error).__name__}: {error})')
    if found is None:
      sys.exit(f'{sys.executable}: No module named {args[1]}')
    runpy.run_module(args[1], run_name='__main__', alter_sys=True)
  elif args[0] == '-c':
    sys.argv = ['-c', *args[2:]]
    sys.path[:] = ['', *path]
    main_module = types.ModuleType('__main__')
    main_module.__dict__.update(__builtins__=__builtins__, __spec__=None)
    sys.modules['__main__'] = main_module
    exec(compile(args[1], '<string>', 'exec'), main_module.__dict__)  # pylint: disable=exec-used
  else:
    script = os.path.abspath(args[0])
    if not os.path.isfile(script):
      print(f"{sys.executable}: can't open file {script!r}: [Errno 2] No such file or "
            'directory', file=sys.stderr)
      sys.exit(2)
    sys.argv = list(args)
    sys.path[:] = [os.path.dirname(script), *path]
    runpy.run_path(script, run_name='__main__')


def _serve(request, channel):
  """Fork a child for one request; in the server, wait for it (killed at its timeout), answer
  on `channel` and return None; in the child, return the request's opened output files."""
  out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
  pid = os.fork()
  if pid == 0:
    return out, err
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
    texts.append(f.read().decode(errors='replace').replace('\r\n', '\n'))
    f.close()
  print(json.dumps({'returncode': os.waitstatus_to_exitcode(status), 'stdout': texts[0],
                    'stderr': texts[1], 'timed_out': timed_out}), file=channel, flush=True)
  return None


class CliServer:
  """The tests' side: starts the server at the first `run` (~4 s of imports, once per test
  process) with the environment the test process had when this was made, and sends it runs."""

  def __init__(self):
    self._env = dict(os.environ)
    self._proc = None
    self._log = None

  def run(self, args, cwd=ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python ARGS` (ARGS: ['-m', MODULE, ...], [SCRIPT, ...] or ['-c', CODE, ...]) in
    `cwd`; like `subprocess.run(..., capture_output=True, text=True, timeout=timeout)`:
    subprocess.TimeoutExpired past `timeout` seconds. Anything else going wrong on the way (an
    interrupt while waiting, a server that ended) stops the server and its children; the next
    run starts a new one."""
    if self._proc is None or self._proc.poll() is not None:
      self._start()
    request = {'args': [str(a) for a in args], 'cwd': str(cwd), 'timeout': timeout}
    try:
      self._proc.stdin.write(json.dumps(request) + '\n')
      self._proc.stdin.flush()
      answer = self._read()
    except BaseException:
      self.close(kill=True)
      raise
    argv = [sys.executable, *request['args']]
    if answer['timed_out']:
      raise subprocess.TimeoutExpired(argv, timeout, answer['stdout'], answer['stderr'])
    return subprocess.CompletedProcess(argv, answer['returncode'], answer['stdout'],
                                       answer['stderr'])

  def _start(self) -> None:
    self.close(kill=True)
    self._log = tempfile.TemporaryFile()
    self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._log, text=True,
                                  env=self._env, start_new_session=True)
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
    self.close(kill=True)
    raise RuntimeError(f'tests/cli_server.py {what}: {log}')

  def close(self, kill: bool = False) -> None:
    """Stop the server: let it finish (its loop ends with its stdin), or with `kill` (or when
    it does not end within 30 s) kill it and any child it left running (its process group)."""
    if self._proc is not None:
      try:
        if not kill:
          self._proc.stdin.close()
          self._proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        kill = True
      if kill:
        try:
          os.killpg(self._proc.pid, signal.SIGKILL)
        except OSError:
          pass
        self._proc.wait()
      for pipe in (self._proc.stdin, self._proc.stdout):
        try:
          pipe.close()
        except OSError:
          pass
      self._proc = None
    if self._log is not None:
      self._log.close()
      self._log = None


def main() -> None:
  path = sys.path[1:]                    # after tests/: a program's path starts with its own
  sys.path.insert(0, str(ROOT))
  for name in WARM_MODULES:
    importlib.import_module(name)
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if xla_bridge._backends:  # pylint: disable=protected-access
    sys.exit('cli_server: a JAX backend started while importing; forking it is unsafe')
  channel = os.fdopen(os.dup(1), 'w')    # answers; the children's fd 1 goes to their files
  print('ready', file=channel, flush=True)
  for line in sys.stdin:
    request = json.loads(line)
    files = _serve(request, channel)
    if files is not None:                # the child: become the program
      channel.close()
      _become(request['args'], request['cwd'], files[0].fileno(), files[1].fileno(), path)
      return


if __name__ == '__main__':
  main()
