"""tests/cli_server.py, which runs the CLI tests' programs from one warm process, gives what a
fresh `python ARGS` gives: exit status, stdout, stderr, sys.argv, sys.path[0], working
directory, no stdin, `__main__`, what runs at exit (atexit handlers, threads, finalizers), the
one-line errors for a missing script or module, a timeout."""

import subprocess
import sys

import pytest

PROGRAM = '''import atexit, os, sys
atexit.register(lambda: print('atexit ran'))
print(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), os.getcwd())
print('stdin:', repr(sys.stdin.read()))
print('to stderr', file=sys.stderr)
if sys.argv[1] == 'message':
  sys.exit('FATAL: a message')
if sys.argv[1] == 'raise':
  raise KeyError('a key')
sys.exit(int(sys.argv[1]))
'''


@pytest.mark.parametrize('how', ['0', '3', 'message', 'raise'])
def test_a_script_run_by_the_server_is_as_a_fresh_interpreter_runs_it(tmp_path, cli, how):
  script = tmp_path / 'program.py'
  script.write_text(PROGRAM)
  fresh = subprocess.run([sys.executable, str(script), how], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
  served = cli([str(script), how], cwd=tmp_path)
  assert served.returncode == fresh.returncode == {'0': 0, '3': 3}.get(how, 1)
  assert served.stdout == fresh.stdout and 'atexit ran' in served.stdout
  if how == 'raise':         # the traceback's first frames differ (runpy's under the server)
    assert served.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "KeyError: 'a key'"
  else:
    assert served.stderr == fresh.stderr


LATE = '''import pickle, threading, time
class Late:
  def __del__(self):
    raise RuntimeError('late')
keep = Late()
print(len(pickle.dumps(Late())) > 0, __name__, __spec__)   # a class of __main__ pickles
threading.Thread(target=lambda: (time.sleep(0.3), print('from a thread'))).start()
'''


@pytest.mark.parametrize('how', ['script', '-c'])
def test_what_runs_at_exit_runs_as_in_a_fresh_interpreter(tmp_path, cli, how):
  # The thread's line and the finalizer's "Exception ignored" report come after the program's
  # code has run (was: lost to os._exit after the atexit handlers).
  script = tmp_path / 'late.py'
  script.write_text(LATE)
  args = [str(script)] if how == 'script' else ['-c', LATE]
  fresh = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
  served = cli(args, cwd=tmp_path)
  assert served.returncode == fresh.returncode == 0, served.stderr
  assert served.stdout == fresh.stdout == 'True __main__ None\nfrom a thread\n'
  for text in (served.stderr, fresh.stderr):
    assert 'Exception ignored in' in text and 'RuntimeError: late' in text, text


@pytest.mark.parametrize('args', [['nowhere.py'], ['-m', 'no_such_module'],
                                  ['-m', 'no_such_package.module']])
def test_a_missing_program_is_the_interpreters_one_line(tmp_path, cli, args):
  fresh = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
  served = cli(args, cwd=tmp_path)
  assert (served.returncode, served.stderr) == (fresh.returncode, fresh.stderr)
  assert served.returncode in (1, 2) and len(served.stderr.splitlines()) == 1


def test_a_module_run_by_the_server_gets_the_working_directory_first_on_its_path(tmp_path, cli):
  (tmp_path / 'a_module.py').write_text('import os, sys\nprint(sys.path[0] == os.getcwd(), '
                                        'sys.argv[1:])\n')
  served = cli(['-m', 'a_module', '--x=1'], cwd=tmp_path)
  assert (served.returncode, served.stdout) == (0, "True ['--x=1']\n"), served.stderr


def test_a_run_past_its_timeout_is_killed_and_the_server_goes_on(tmp_path, cli):
  (tmp_path / 'slow.py').write_text('import time\ntime.sleep(60)\n')
  with pytest.raises(subprocess.TimeoutExpired):
    cli([str(tmp_path / 'slow.py')], cwd=tmp_path, timeout=1)
  (tmp_path / 'quick.py').write_text('print("next")\n')
  assert cli([str(tmp_path / 'quick.py')], cwd=tmp_path).stdout == 'next\n'
