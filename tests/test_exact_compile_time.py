"""scripts/exact_compile_time.py, and what it guards: an exact-mode call is one traced body
whatever its token count (attention in a `lax.map`, norms in a fixed add tree), not T copies."""

import importlib.util
import os
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parent.parent / 'scripts' / 'exact_compile_time.py'
_SPEC = importlib.util.spec_from_file_location('exact_compile_time', _PATH)
exact_compile_time = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(exact_compile_time)


def test_exact_mode_traces_one_body_whatever_the_token_count():
  eqns = {t: exact_compile_time.compile_times('test-tiny', t, 1, True, compile_=False)['eqns']
          for t in (2, 9, 32)}
  assert len(set(eqns.values())) == 1, eqns       # unrolled per token: 1932 eqns at T = 16
  default = exact_compile_time.compile_times('test-tiny', 9, 1, False, compile_=False)['eqns']
  assert eqns[9] < 1.5 * default, (eqns, default)


def test_the_script_prints_both_modes_and_their_ratio(capsys, monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))   # main appends its level
  exact_compile_time.main(['--tokens', '2', '--opt_level', '0'])
  out = capsys.readouterr().out.splitlines()
  assert out[0] == 'test-tiny, batch 1, XLA:CPU -O0'
  assert out[2].split()[:2] == ['2', 'default'] and out[3].split()[:2] == ['2', 'exact']
  assert out[4].startswith('  2 exact / default compile: ')


@pytest.mark.parametrize('argv', [['--tokens', '0'], ['--tokens', 'a,b'], ['--batch', '0'],
                                  ['--batch', '100000000'], ['--tokens', '33'],
                                  ['--model', 'nope']])
def test_bad_arguments_are_named(argv, capsys):
  with pytest.raises(SystemExit):
    exact_compile_time.main(argv)
  assert argv[1] in capsys.readouterr().err
