"""scripts/replay_k_policy.py: greedy rounds replayed from a teacher-forced draft pass are the
rounds the engine runs."""

import importlib.util
import pathlib

import pytest

from jaxspec.engine import Engine
from jaxspec.engine.k_policy import FixedK, ScheduleK

_PATH = pathlib.Path(__file__).parent.parent / 'scripts' / 'replay_k_policy.py'
_SPEC = importlib.util.spec_from_file_location('replay_k_policy', _PATH)
replay_k_policy = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay_k_policy)


def _fixed(k):
  policy = FixedK()
  policy.setup(k)
  return policy


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
  rounds = replay_k_policy.replay(_fixed(k), sequences, {k: 1.0}, max_tokens)
  assert rounds == [(k, e) for e in engine_rounds]


def test_replay_accepts_runs_of_the_sequence_up_to_k_and_the_room():
  ones, alternating = [1] * 9, [1, 0] * 4 + [1]   # 10 tokens each (the prefill's first)
  assert replay_k_policy.replay(_fixed(4), [ones], {4: 1.0}, 10) == [(4, 5), (4, 4)]
  assert replay_k_policy.replay(_fixed(4), [alternating], {4: 1.0}, 10) == \
      [(4, 2)] * 4 + [(4, 1)]
  schedule = ScheduleK(initial=1)
  schedule.setup(4)
  # K_i: 1 (all accepted) -> 3 (all) -> 4, of which the room leaves 2 (not all accepted).
  assert replay_k_policy.replay(schedule, [ones], {1: 1.0, 3: 1.0, 4: 1.0}, 10) == \
      [(1, 2), (3, 4), (4, 3)]


def test_a_round_cut_by_the_outputs_end_invents_no_rejection():
  """A request that stopped early (a stop token) ends inside a run: the replay observes the
  round capped where the output ends, with no rejection the sequence cannot show."""
  seen = []

  class Recording(FixedK):
    def observe(self, request_id, k, accepted, successes, trials):
      seen.append((k, accepted, successes, trials))

  policy = Recording()
  policy.setup(4)
  assert replay_k_policy.replay(policy, [[1, 1, 1]], {4: 1.0}, 10) == [(4, 3)]
  assert seen == [(2, 2, 2.0, 2.0)]
