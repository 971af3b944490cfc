"""scripts/trace_k_policy.py: a policy's rounds as runs of one K, with its probes between them."""

import importlib.util
import pathlib
import sys

from jaxspec.engine.goodput import GoodputK

_DIR = pathlib.Path(__file__).parent.parent / 'scripts'
sys.path.insert(0, str(_DIR))           # the script imports its sibling policy_host_time
_SPEC = importlib.util.spec_from_file_location('trace_k_policy', _DIR / 'trace_k_policy.py')
trace_k_policy = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(trace_k_policy)


def test_rounds_are_run_length_coded_with_probes_between():
  events = [0, 0, 0, '[1/2 g0.60]', 0, 2, 2, '[3/4]', '[0/1]', 2, 0]
  assert trace_k_policy.runs_of(events) == 'K0x3 [1/2 g0.60] K0x1 K2x2 [3/4] [0/1] K2x1 K0x1'
  assert trace_k_policy.runs_of([]) == ''


def test_traced_policy_records_choices_holds_and_probes_and_keeps_its_answers():
  policy = GoodputK(costs={k: 1.0 + k for k in range(3)})
  policy.setup(2)
  events = []
  trace_k_policy._traced(policy, events)
  k, ks = policy.choose(['a'])                 # α at its prior 0.5 with these costs: K = 0
  assert (k, ks) == (0, [0]) and events == [0]
  held = policy.repeat(['a'], policy.rows, policy.queued)
  assert held == (0, [0]) and events == [0, 0]
  assert policy.repeat(['b'], policy.rows, policy.queued) is None and events == [0, 0]
  policy.observe_probe('a', 3.0, 4.0, 2.0, 3.0)
  assert events == [0, 0, '[3/4 g0.50]']
  assert policy.tracker.alpha('a') > 0.5      # the probe reached the tracker


def test_a_catch_up_before_a_round_at_k_ge_1_is_put_before_that_round():
  """The engine chooses K, then catches the draft up (`DraftSync.before_round`), whose scores
  reach the policy as probes do: the trace shows them apart and ahead of the round."""
  policy = GoodputK(costs={k: 1.0 + k for k in range(3)})
  policy.setup(2)

  class Sync:
    def before_round(self, decodes, k):
      policy.observe_probe('a', 1.0, 2.0, 0.0, 1.0)
  sync, events = Sync(), []
  trace_k_policy._traced(policy, events, sync)
  policy.choose(['a'])                          # K = 0 at the prior
  events.append(2)                              # as if the next choice were K = 2
  sync.before_round([], 2)
  policy.observe_probe('a', 1.0, 1.0, 0.0, 0.0)  # a probe: after the round
  assert trace_k_policy.runs_of(events) == 'K0x1 {1/2 g0.50} K2x1 [1/1 g0.50]'


def test_scores_lists_each_scoring_of_a_choice_and_not_the_probes_what_ifs():
  """--scores: a choice's scoring is listed with its inputs and each K's goodput over K = 0's,
  the same numbers the policy compared; `worth_probing`'s raised what-ifs are left out."""
  policy = GoodputK(costs={0: 1.0, 1: 1.5, 2: 3.0})
  policy.setup(2)
  events, scores = [], []
  trace_k_policy._traced(policy, events, scores=scores)
  policy.choose(['a'])
  assert len(scores) == 1
  goodput = policy._scores(*policy._alphas(['a']))         # the wrapper: a call outside choose
  assert len(scores) == 1                                  # is not listed
  line = scores[0]
  assert line.startswith('q0 n1 rooms- round a0.50 b') and 't0 1000.00ms t2/t0 3.00' in line
  assert line.endswith(f'| 1:{goodput[1] / goodput[0]:.3f} 2:{goodput[2] / goodput[0]:.3f}')
  policy.worth_probing(['a'])
  assert len(scores) == 1


def test_a_scoring_line_prices_as_the_scoring_did():
  """Without K = 0 the ratios are over the smallest K (a run with candidates 1, 2 once crashed
  here); while requests wait, the full batch's table is shown, the one the scoring priced."""
  policy = GoodputK(costs={1: 1.5, 2: 3.0}, candidates=(1, 2))
  policy.setup(2)
  line = trace_k_policy.scoring_line(policy, [0.5], [[0.5, 0.5]], {1: 2.0, 2: 1.0})
  assert 't1 1500.00ms t2/t1 2.00' in line and line.endswith('| 2:0.500')
  policy = GoodputK()
  policy.setup(2)
  policy.set_costs({0: 1.0, 1: 1.5, 2: 3.0}, by_rows={1: {0: 0.2, 1: 0.4, 2: 0.9}})
  policy.rows, policy.queued, policy.slots, policy.rooms, policy.queue_rooms = 1, 3, 2, [10], [20]
  scores = []
  trace_k_policy._traced(policy, [], scores=scores)
  policy.choose(['a'])
  assert scores[0].startswith('q3 n1 rooms10 queue ') and ' t0 1000.00ms t2/t0 3.00 ' in scores[0]
  policy.queued = 0                               # nothing waits: the round's bucket's table
  policy.choose(['a'])
  assert scores[-1].startswith('q0 n1 rooms10 finish ') and ' t0 200.00ms t2/t0 4.50 ' in \
      scores[-1]


def test_a_scoring_line_lists_only_the_rows_the_scoring_kept():
  """Finished rows (room < 1) are left out as `_scores` leaves them; with none left every score
  is 0 and the ratios are '-' (they once divided by that 0)."""
  policy = GoodputK(costs={0: 1.0, 1: 1.5, 2: 3.0})
  policy.setup(2)
  policy.rooms, policy.queued = [0, 6], 0
  line = trace_k_policy.scoring_line(policy, [0.9, 0.3], [[0.9, 0.9], [0.3, 0.3]],
                                     {0: 1.0, 1: 1.2, 2: 0.9})
  assert line.startswith('q0 n1 rooms6 finish a0.30 b0.30 ') and line.endswith('| 1:1.200 2:0.900')
  policy.rooms = [0, -1]
  scores = []
  trace_k_policy._traced(policy, [], scores=scores)
  assert policy.choose(['a', 'b'])[0] == 0
  assert scores[0].startswith('q0 n0 rooms0 finish a- b- ') and scores[0].endswith('| 1:- 2:-')
