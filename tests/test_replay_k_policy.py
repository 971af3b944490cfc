"""scripts/replay_k_policy.py: greedy rounds replayed from a teacher-forced draft pass are the
rounds the engine runs, alone and batched."""

import importlib.util
import pathlib

import pytest

from jaxspec.engine import Engine
from jaxspec.engine import rounds as step_rounds
from jaxspec.engine.k_policy import FixedK, KPolicy, ScheduleK

_PATH = pathlib.Path(__file__).parent.parent / 'scripts' / 'replay_k_policy.py'
_SPEC = importlib.util.spec_from_file_location('replay_k_policy', _PATH)
replay_k_policy = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay_k_policy)


def _fixed(k):
  policy = FixedK()
  policy.setup(k)
  return policy


def _alone(policy, sequences, k_costs, max_tokens):
  """[(K, tokens emitted)] per round of a one-slot replay."""
  rounds, _, _ = replay_k_policy.replay(policy, sequences, {1: k_costs}, max_tokens)
  return [(k, e) for k, _, out in rounds for e in out.values()]


@pytest.mark.parametrize('k', [1, 3])
def test_replayed_rounds_are_the_engines(tiny, tiny_draft, k):
  """Per round, the tokens the engine emits at fixed K (greedy, one slot) equal the replay's
  from the draft's teacher-forced guesses on the target's output."""
  (config, params), (draft, draft_params) = tiny, tiny_draft
  prompts, max_tokens = [[5, 9, 12, 3, 40, 7], [17, 2, 33, 33, 8]], 20
  base = Engine(config, params, num_slots=1, num_pages=32, page_size=4, chunk_size=8)
  spec = Engine(config, params, num_slots=1, num_pages=32, page_size=4, chunk_size=8,
                draft=draft, draft_params=draft_params, k=k)
  sequences, engine_rounds = [], []
  for prompt in prompts:
    rid = base.add_request(prompt, max_tokens=max_tokens)
    output = base.run()[rid].tokens
    sequences.append(replay_k_policy.acceptance_sequence(draft, draft_params, prompt, output))
    rid = spec.add_request(prompt, max_tokens=max_tokens)
    done = spec.run()[rid]
    assert done.tokens == output                  # greedy speculation keeps the target's tokens
    engine_rounds.extend(done.metrics.accepted_lengths)
  assert 0 < sum(map(sum, sequences)) < sum(map(len, sequences))   # some accepted, not all
  assert _alone(_fixed(k), sequences, {k: 1.0}, max_tokens) == [(k, e) for e in engine_rounds]


def test_replay_accepts_runs_of_the_sequence_up_to_k_and_the_room():
  ones, alternating = [1] * 9, [1, 0] * 4 + [1]   # 10 tokens each (the prefill's first)
  assert _alone(_fixed(4), [ones], {4: 1.0}, 10) == [(4, 5), (4, 4)]
  assert _alone(_fixed(4), [alternating], {4: 1.0}, 10) == [(4, 2)] * 4 + [(4, 1)]
  schedule = ScheduleK(initial=1)
  schedule.setup(4)
  # K_i: 1 (all accepted) -> 3 (all) -> 4, of which the room leaves 2 (not all accepted).
  assert _alone(schedule, [ones], {1: 1.0, 3: 1.0, 4: 1.0}, 10) == [(1, 2), (3, 4), (4, 3)]


def test_a_round_cut_by_the_outputs_end_invents_no_rejection():
  """A request that stopped early (a stop token) ends inside a run: the replay observes the
  round capped where the output ends, with no rejection the sequence cannot show."""
  seen = []

  class Recording(FixedK):
    def observe(self, request_id, k, accepted, successes, trials):
      seen.append((k, accepted, successes, trials))

  policy = Recording()
  policy.setup(4)
  assert _alone(policy, [[1, 1, 1]], {4: 1.0}, 10) == [(4, 3)]
  assert seen == [(2, 2, 2.0, 2.0)]


def test_k0_rounds_in_a_row_observe_pairs_as_the_engines_probes():
  """A K = 0 round scores its position and, when the round before scored the one before it,
  the pair (`KPolicy.observe_probe`: later trials s_j, later successes s_j s_{j+1}), as a lazy
  draft's probe scores neighbouring tokens."""
  seen = []

  class Zero(KPolicy):
    def choose(self, request_ids):
      return 0, [0] * len(request_ids)

    def observe_probe(self, request_id, successes, trials, later_successes, later_trials,
                      confidence=None):
      seen.append((successes, trials, later_successes, later_trials))

  policy = Zero()
  policy.setup(4)
  assert _alone(policy, [[1, 1, 0, 1, 1]], {0: 1.0}, 10) == [(0, 1)] * 5
  assert seen == [(1.0, 1.0, 0.0, 0.0), (1.0, 1.0, 1.0, 1.0), (0.0, 1.0, 0.0, 1.0),
                  (1.0, 1.0, 0.0, 0.0), (1.0, 1.0, 1.0, 1.0)]


def test_batched_replay_schedules_as_the_engine(tiny, tiny_draft, monkeypatch):
  """Two slots at fixed K: the engine's prefill calls (requests per call), decode rounds and each
  request's tokens per round are the replay's; finishes apart admit one request a call."""
  (config, params), (draft, draft_params) = tiny, tiny_draft
  prompts = [[5, 9, 12, 3, 40, 7], [17, 2, 33, 33, 8], [4, 4, 21, 9], [11, 30, 6, 2, 19, 8, 3]]
  max_tokens, k = 14, 2
  base = Engine(config, params, num_slots=1, num_pages=32, page_size=4, chunk_size=8)
  sequences = []
  for prompt in prompts:
    rid = base.add_request(prompt, max_tokens=max_tokens)
    sequences.append(replay_k_policy.acceptance_sequence(draft, draft_params, prompt,
                                                         base.run()[rid].tokens))
  engine = Engine(config, params, num_slots=2, num_pages=64, page_size=4, chunk_size=8,
                  draft=draft, draft_params=draft_params, k=k)
  calls = []
  prefill = step_rounds.prefill_chunks     # one engine step's prefill call
  monkeypatch.setattr(step_rounds, 'prefill_chunks', lambda engine, prefills, emitted: calls.append(
      len(prefills)) or prefill(engine, prefills, emitted))
  ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
  done = engine.run()
  rounds, prefills, seconds = replay_k_policy.replay(
      _fixed(k), sequences, {2: {k: 1.0}}, max_tokens, slots=2, prefill_costs={1: 5.0, 2: 7.0})
  assert prefills == calls and sum(calls) == len(prompts)
  assert len(rounds) == engine.k_rounds[k]
  for i, rid in enumerate(ids):
    assert [out[i] for _, _, out in rounds if i in out] == done[rid].metrics.accepted_lengths
  assert seconds == len(rounds) + sum(5.0 if n == 1 else 7.0 for n in prefills)
  assert 1 in prefills          # some finishes came apart


def test_live_table_takes_the_studys_median_round_seconds_per_k():
  """Fixed draft-model settings (and K = 0) at the batch size, medians per K, linear between
  the measured K and flat past the last; other settings, batch sizes and drafters are not used;
  without K = 0 and some K >= 1 it refuses."""
  def rec(k, seconds, batch=2, drafter='model', policy='fixed'):
    return dict(batch_size=batch, k=k, round_s=seconds, k_policy=policy,
                drafter='none' if k == 0 else drafter)
  records = [rec(0, 1.0), rec(0, 3.0), rec(1, 2.0), rec(2, 2.5), rec(4, 3.5), rec(2, 9.0, batch=4),
             rec(4, 9.0, drafter='ngram'), rec(8, 9.0, policy='goodput')]
  table = replay_k_policy.live_table(records, 2, 6)
  assert table == pytest.approx({0: 2.0, 1: 2.0, 2: 2.5, 3: 3.0, 4: 3.5, 5: 3.5, 6: 3.5})
  with pytest.raises(ValueError, match='batch size 8'):
    replay_k_policy.live_table(records, 8, 6)


def test_summarize_takes_the_best_static_mean_over_prompt_sets_and_each_sets_own():
  """Over prompt sets, a policy's fraction is its mean speedup over the best static mean speedup
  (K = 0 included); per set, over that set's best static: a static setting that wins one set
  by luck does not set the bar for every set."""
  seconds = {'k0': [10.0, 10.0], 'k1': [5.0, 10.0], 'k2': [8.0, 6.0], 'goodput': [6.0, 7.0]}
  summary = replay_k_policy.summarize(seconds, ['k0', 'k1', 'k2'])
  k1, k2, gp = 1.5, (10 / 8 + 10 / 6) / 2, (10 / 6 + 10 / 7) / 2       # mean speedups
  assert summary['k1'][:2] == pytest.approx((k1, k1 / k1))
  assert summary['k2'][:2] == pytest.approx((k2, k2 / k1))
  assert summary['goodput'][:2] == pytest.approx((gp, gp / k1))
  assert summary['goodput'][2] == pytest.approx([(10 / 6) / 2.0, (10 / 7) / (10 / 6)])
  assert replay_k_policy.summarize({'k0': [4.0]}, ['k0']) == {'k0': (1.0, 1.0, [1.0])}
