"""K = 0 rounds of a lazy draft that run while the policy chooses (`DraftSync.overlaps`): once
the policy has stayed at K = 0, the device call is dispatched before the policy is asked and its
results are read after; a request new to the batch, or a K >= 1 chosen meanwhile, makes the next
round ask first; outputs stay those of each request decoded alone; an error of the overlapped
choice is raised by the next round, before it runs."""

import numpy as np
import pytest

from jaxspec.decoding import generate
from jaxspec.engine import Engine, device
from jaxspec.engine.draft_sync import DraftSync
from test_engine_draft_sync import K, SHAPES, Record, _prompts


class Logged(Record):
  """Record's K cycle, with every choice, round run and device dispatch in one log."""

  def __init__(self, ks, log):
    super().__init__(ks)
    self.log = log

  def choose(self, request_ids):
    k, caps = super().choose(request_ids)
    self.log.append(('choose', k))
    return k, caps

  def round_timing(self, k, device_s, host_s):
    self.log.append(('ran', k))


class _Read:
  """A device result whose read (`np.asarray`) is logged."""

  def __init__(self, value, log):
    self.value, self.log = value, log

  def __array__(self, dtype=None, copy=None):
    self.log.append(('read',))
    return np.asarray(self.value, dtype)


def _logged_engine(monkeypatch, tiny, ks, overlap=True):
  log = []
  real = device.decode_round

  def dispatch(*args, **kwargs):
    log.append(('dispatch',))
    window, *rest = real(*args, **kwargs)
    return (_Read(window, log), *rest)

  monkeypatch.setattr(device, 'decode_round', dispatch)
  config, params = tiny
  engine = Engine(config, params, draft=config, draft_params=params, k=K,
                  k_policy=Logged(ks, log), **SHAPES)
  engine.draft_sync.probe_every = None           # no probes: every round's order is the rule's
  engine.draft_sync.overlap_choice = overlap
  return engine, log


def _rounds(log):
  """[(events of one decode round)] split at each 'ran'."""
  rounds, current = [], []
  for event in log:
    current.append(event)
    if event[0] == 'ran':
      rounds.append(current)
      current = []
  return rounds


@pytest.mark.parametrize('overlap', [True, False])
def test_k0_rounds_dispatch_before_the_choice_once_the_policy_stayed_at_k0(monkeypatch, tiny,
                                                                         overlap):
  engine, log = _logged_engine(monkeypatch, tiny, [0], overlap)
  engine.add_request(_prompts([5], seed=0)[0], max_tokens=12)
  engine.run()
  rounds = _rounds(log)
  after = DraftSync.OVERLAP_AFTER
  assert len(rounds) == 11 and all(r[-1] == ('ran', 0) for r in rounds)
  for i, events in enumerate(rounds):
    ahead = overlap and i >= after
    order = [('dispatch',), ('choose', 0), ('read',)] if ahead else \
        [('choose', 0), ('dispatch',), ('read',)]
    assert events[:-1] == order, (i, events)


def test_a_request_new_to_the_batch_is_chosen_for_first(monkeypatch, tiny):
  engine, log = _logged_engine(monkeypatch, tiny, [0])
  first, second = _prompts([5, 6], seed=3)
  engine.add_request(first, max_tokens=20)
  for _ in range(DraftSync.OVERLAP_AFTER + 2):      # prefill + rounds: overlapping by now
    engine.step()
  engine.add_request(second, max_tokens=8)
  engine.step()                                    # its prefill; the first's round overlaps
  joined = len(log)
  engine.step()                                    # both decode: priced before the round
  engine.step()
  assert _rounds(log[joined:])[0][:2] == [('choose', 0), ('dispatch',)]
  assert _rounds(log[joined:])[1][:2] == [('dispatch',), ('choose', 0)]


def test_a_k_chosen_during_a_k0_round_makes_the_next_round_ask_first(monkeypatch, tiny):
  # Choices 1-5 (rounds 1-5) are K = 0; round 5 is the first to overlap (after 4), so choice 6
  # comes during round 6, which runs K = 0; round 7 asks first (choice 7) and runs its K = 2,
  # round 8 asks first too. A self-draft accepts every proposal, and the output is the
  # request's greedy decoding alone.
  config, params = tiny
  ks = [0] * 5 + [2, 2, 0]
  engine, log = _logged_engine(monkeypatch, tiny, ks)
  prompt = _prompts([5], seed=1)[0]
  rid = engine.add_request(prompt, max_tokens=20)
  out = engine.run()[rid]
  rounds = _rounds(log)
  assert [e[1] for e in log if e[0] == 'ran'][:8] == [0, 0, 0, 0, 0, 0, 2, 0]
  assert [e for e in rounds[5] if e[0] == 'choose'] == [('choose', 2)]
  assert rounds[6] == [('choose', 2), ('ran', 2)]
  assert rounds[7][:2] == [('choose', 0), ('dispatch',)]
  assert out.metrics.proposed == out.metrics.accepted > 0
  assert out.tokens == generate(config, params, [prompt], max_new_tokens=20, page_size=8).tokens[0]


def test_a_choice_that_fails_during_a_k0_round_is_raised_by_the_next_round(monkeypatch, tiny):
  engine, log = _logged_engine(monkeypatch, tiny, [0])
  rid = engine.add_request(_prompts([5], seed=2)[0], max_tokens=12)
  for _ in range(DraftSync.OVERLAP_AFTER + 1):       # prefill + K = 0 rounds: overlap is due
    engine.step()
  policy = engine.policy
  policy.ks = [K + 1]                               # a K the engine cannot run: refused
  emitted = len(engine._live[rid].output)
  streamed = engine.step()                          # the round ran and streams its token
  assert streamed == [(rid, engine._live[rid].output[-1:])]
  assert len(engine._live[rid].output) == emitted + 1
  assert log[-4:] == [('dispatch',), ('choose', K + 1), ('read',), ('ran', 0)]
  before = len(log)
  with pytest.raises(ValueError, match=f'chose K={K + 1}'):
    engine.step()
  assert log[before:] == []                          # raised before the round ran anything
  policy.ks = [0]
  out = engine.run()[rid]                            # the engine keeps serving
  assert len(out.tokens) == 12
