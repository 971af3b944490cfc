"""scripts/policy_host_time.py: the per-(setting, workload) counters its wrapped engine calls
add to."""

import collections
import importlib.util
import pathlib
import sys
import types

_DIR = pathlib.Path(__file__).parent.parent / 'scripts'
sys.path.insert(0, str(_DIR))
_SPEC = importlib.util.spec_from_file_location('policy_host_time', _DIR / 'policy_host_time.py')
policy_host_time = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(policy_host_time)


def _fake_engine():
  probes = []
  policy = types.SimpleNamespace(observe_probe=lambda rid, s, t, *a, **k: probes.append(rid))
  engine = types.SimpleNamespace(
      num_slots=4, policy=policy, draft_sync=types.SimpleNamespace(num_calls=0, seconds=0.0),
      _call_decode=lambda table, *a, **k: 'round', _call_prefill=lambda *a: ('first', None),
      _decode_layout=lambda decodes: (4, list(range(len(decodes)))), step=lambda: [])
  return engine, probes


def test_counters_go_to_the_workload_being_run_and_the_wrapped_calls_still_answer():
  engine, probes = _fake_engine()
  totals, calls = collections.defaultdict(collections.Counter), collections.defaultdict(list)
  current = [None, 'json']
  policy_host_time._instrument(engine, 'gp', totals, current, calls)
  assert engine.step() == [] and current[0] == 'gp'
  assert engine._call_prefill(None) == ('first', None)
  assert engine._call_decode([[0]] * 4, k=2) == 'round'        # the full row bucket: timed per K
  assert engine._decode_layout([1, 2]) == (4, [0, 1])          # an idle row
  current[1] = 'code'
  engine._call_decode([[0]] * 2)                               # a smaller bucket: not per K
  engine.policy.observe_probe('r', 1.0, 3.0, 0.0, 1.0)
  json, code = totals[('gp', 'json')], totals[('gp', 'code')]
  assert json['prefills'] == 1 and json['prefill'] > 0 and json['part_rounds'] == 1
  assert json['device'] > 0 and list(calls) == [2] and len(calls[2]) == 1
  assert code['device'] > 0 and code['probe_tokens'] == 3.0 and probes == ['r']
  assert 'probe_tokens' not in json


def test_sync_marks_without_a_lazy_draft_are_zero():
  assert policy_host_time._sync_marks(types.SimpleNamespace(draft_sync=None)) == (0, 0.0)
  sync = types.SimpleNamespace(num_calls=3, seconds=0.5)
  assert policy_host_time._sync_marks(types.SimpleNamespace(draft_sync=sync)) == (3, 0.5)


def test_set_refuses_what_picks_a_compiled_variant_and_sets_the_rest():
  # spec_confidence picks the draft step's variant that warm_up compiled: a --set of it after
  # warm-up would compile inside timed rounds, so it is fixed at construction (give it in the
  # settings: k_policy.spec_confidence:true); a plain attribute such as spec_margin is set.
  import argparse
  import pytest
  from jaxspec.engine.goodput import GoodputK
  engines = {'gp': (types.SimpleNamespace(policy=GoodputK()), None)}
  parser = argparse.ArgumentParser()
  with pytest.raises(SystemExit):
    policy_host_time._override(engines, 'gp.policy.wants_spec_confidences=True', parser)
  assert not engines['gp'][0].policy.wants_spec_confidences
  policy_host_time._override(engines, 'gp.policy.spec_margin=0.1', parser)
  assert engines['gp'][0].policy.spec_margin == 0.1


def test_parts_time_each_call_of_the_policy_and_the_lazy_draft_per_workload():
  calls = []
  policy = types.SimpleNamespace(repeat=lambda *a: calls.append(a) or (0, [0]))
  sync = types.SimpleNamespace(overlaps=lambda decodes: False)
  engine = types.SimpleNamespace(policy=policy, draft_sync=sync)
  totals, current = collections.defaultdict(collections.Counter), [None, 'json']
  policy_host_time._instrument_parts(engine, 'gp', totals, current)
  assert policy.repeat('a', 4) == (0, [0]) and calls == [('a', 4)]   # still answers
  current[1] = 'code'
  assert sync.overlaps([]) is False and policy.repeat('b', 2) == (0, [0])
  json, code = totals[('gp', 'json')], totals[('gp', 'code')]
  assert json['calls policy.repeat'] == 1 and json['part policy.repeat'] > 0
  assert code['calls policy.repeat'] == 1 and code['calls draft_sync.overlaps'] == 1
  assert not hasattr(policy, 'choose')                 # a part the owner lacks: left alone
  line = policy_host_time._parts_line(code, rounds=2)
  assert 'policy.repeat' in line and '(1 calls)' in line and 'draft_sync.overlaps' in line
  assert policy_host_time._parts_line(collections.Counter(), rounds=3) == ''
  policy_host_time._instrument_parts(types.SimpleNamespace(policy=None, draft_sync=None), 'k0',
                                     totals, current)       # no policy, no lazy draft: nothing
