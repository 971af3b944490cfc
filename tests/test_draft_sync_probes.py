"""The lazy draft cache's probes (`DraftSync`): the doubling gap before it asks the policy's
`worth_probing` again, the probe budget (a refused probe is not asked about, nor looked for
until affordable; a `cold` policy is probed outside it), `probe_new` (unscored requests probed
first, unasked), and a forced K = 0 round that keeps the draft's prefill eager. Host-side, no
model."""

import types

import numpy as np
import pytest

from jaxspec.engine.draft_sync import DraftSync
from jaxspec.engine.drafters import ModelDrafter


def test_a_forced_k0_round_keeps_the_draft_prefill_eager():
  """When every request has one token left, K = 0 is forced (any K emits just that token): the
  requests admitted next still get their prompts through the draft if the engine was
  speculating; an unforced K = 0 round stops that."""
  engine = types.SimpleNamespace(policy=None, chunk_size=8, prefill_rows=2)
  drafter = ModelDrafter(probe_every=None, probe_budget=None)
  sync = DraftSync(engine, drafter)
  req = lambda room: types.SimpleNamespace(id=room, room=room, num_computed=5, draft_computed=5)
  sync.before_choice([req(3)])
  sync.after_round([req(3)], 2, 1.0)
  assert sync.eager
  sync.before_choice([req(1), req(1)])
  sync.after_round([req(1), req(1)], 0, 1.0)
  assert sync.eager                             # forced: as the engine was going
  sync.before_choice([req(1), req(2)])
  sync.after_round([req(1), req(2)], 0, 1.0)
  assert not sync.eager                         # chosen


def _lagging_request():
  """A decoding request whose draft cache is 40 tokens behind, with drawn tokens to score."""
  return types.SimpleNamespace(id='a', room=50, num_computed=40, draft_computed=0,
                               token_p=[0.5])


def test_probe_questions_back_off_while_the_answer_is_no():
  asked = []

  class Never:            # a `KPolicy` stand-in: what DraftSync reads of one
    cold = False

    def worth_probing(self, ids):
      asked.append(rounds)
      return False
  engine = types.SimpleNamespace(policy=Never(), chunk_size=8, prefill_rows=2)
  drafter = ModelDrafter(probe_every=4, probe_budget=0.03)
  sync = DraftSync(engine, drafter)
  decodes = [_lagging_request()]
  for rounds in range(400):
    sync.before_choice(decodes)
    sync.after_round(decodes, 0, 1.0)
  # First asked after one K = 0 round, then after 2, 4, ... rounds up to QUIET x probe_every.
  gaps = np.diff(asked).tolist()
  quiet = DraftSync.QUIET * 4
  assert asked[0] == 1 and gaps[:4] == [2, 4, 8, 16] and set(gaps[4:]) == {quiet}
  sync.before_round([], 1)                      # a round at K >= 1 restarts the early gaps
  sync.after_round([], 1, 1.0)
  asked.clear()
  for rounds in range(8):
    sync.before_choice(decodes)
    sync.after_round(decodes, 0, 1.0)
  assert asked == [1, 3, 7]


def _budgeted_sync(policy):
  """A lazy draft cache probing every 4 K = 0 rounds within a 3 % budget, a catch-up pass
  costing 10 s (one row) or 12 s (two), for a policy with `worth_probing`."""
  engine = types.SimpleNamespace(policy=policy, chunk_size=8, prefill_rows=2,
                                 prefill_buckets=(1, 2))
  drafter = ModelDrafter(probe_every=4, probe_budget=0.03)
  sync = DraftSync(engine, drafter)
  sync.costs = {1: 10.0, 2: 12.0}
  return sync


def test_a_probe_the_budget_refuses_is_not_asked_about():
  """Past the early probes, a probe costing more than `probe_budget` of the K = 0 rounds since
  the last catch-up is not asked about (asking scores the batch): here 5 chunk passes of 10 s
  against 3 % of 1 s per round."""
  asked = []

  class Never:            # a `KPolicy` stand-in: what DraftSync reads of one
    cold = False

    def worth_probing(self, ids):
      asked.append(rounds)
      return False
  sync = _budgeted_sync(Never())
  decodes = [_lagging_request()]
  assert sync.pending_s(decodes) == pytest.approx(50.0)
  for rounds in range(400):
    sync.before_choice(decodes)
    sync.after_round(decodes, 0, 1.0)
  assert asked == [1, 3]                        # the early ones only (budget: 0.03 x 400 < 50)
  assert not sync.probe_due(decodes) and sync.num_calls == 0
  sync.zero_s = 50.0 / 0.03                     # enough K = 0 time behind it: due and asked
  assert sync.probe_due(decodes)
  sync.before_choice(decodes)
  assert asked == [1, 3, 399]


def test_a_cold_policy_is_probed_outside_the_budget():
  """While the policy is `cold` (few observations behind its estimates) the probes past the
  early ones go on every `probe_every` rounds whatever they cost; once it is warm the budget
  refuses them again (here 5 chunk passes of 10 s against 3 % of 1 s per round)."""
  class Cold:
    cold = True

    def worth_probing(self, ids):
      return True

    def observe(self, *args):
      pass
  policy = Cold()
  sync = _budgeted_sync(policy)
  sync.engine.caches, sync.engine.draft, sync.engine.draft_params = [None, None], None, None
  caught = []
  sync.catch_up = lambda requests: caught.append(rounds) or setattr(sync, 'rounds_since', 0)
  decodes = [_lagging_request()]
  for rounds in range(40):
    sync.before_choice(decodes)
    sync.after_round(decodes, 0, 1.0)
  assert caught == [1, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39]   # early gaps 1, 2, 4, then 4
  policy.cold = False
  for rounds in range(40, 400):
    sync.before_choice(decodes)
    sync.after_round(decodes, 0, 1.0)
  assert caught[-1] == 39                      # budget: 0.03 x 360 s < 50 s


def test_a_refused_probe_is_not_looked_for_until_affordable():
  """Once the budget refuses a probe, the lagging requests are not sorted and priced again
  every round: not until the K = 0 rounds since have cost what affords the refused probe."""
  class Never:            # a `KPolicy` stand-in: what DraftSync reads of one
    cold = False

    def worth_probing(self, ids):
      return False
  sync = _budgeted_sync(Never())
  priced = []
  pending = sync.pending_s
  sync.pending_s = lambda requests: priced.append(len(requests)) or pending(requests)
  decodes = [_lagging_request(), _lagging_request()]     # a probe takes one of the two
  for _ in range(400):
    sync.probe_due(decodes)                      # as `speculation.choose` asks before the choice
    sync.before_choice(decodes)                  # reuses probe_due's answer: priced once
    sync.after_round(decodes, 0, 1.0)
  assert priced.count(1) == 1                    # refused once (round 7), then not looked for
  sync.zero_s = 50.0 / 0.03                      # the refused probe's cost / budget: due again
  assert sync.probe_due(decodes) and priced.count(1) == 2


@pytest.mark.parametrize('probe_new', [False, True])
def test_probe_new_probes_a_request_joining_unscored_first_and_unasked(probe_new):
  """After a long stretch of answers 'no' (gap QUIET x probe_every), a request joins the batch
  that the draft has never scored: with `probe_new` the next probe is due within probe_every
  rounds and scores it, not the scored request less behind, without asking the policy; without
  it the policy is asked (and says no: nothing is caught up)."""
  asked, caught = [], []

  class Never:            # a `KPolicy` stand-in: what DraftSync reads of one
    cold = False

    def worth_probing(self, ids):
      asked.append(ids)
      return False
  engine = types.SimpleNamespace(policy=Never(), chunk_size=8, prefill_rows=2,
                                 prefill_buckets=(1, 2))
  sync = DraftSync(engine, ModelDrafter(probe_every=4, probe_budget=None, probe_new=probe_new))

  def catch_up(requests):
    caught.append([r.id for r in requests])
    for r in requests:
      r.draft_computed = r.num_computed
    sync.rounds_since = 0
  sync.catch_up = catch_up
  scored = types.SimpleNamespace(id='a', room=50, num_computed=40, draft_computed=38,
                                 token_p=[0.5])
  for _ in range(200):
    sync.before_choice([scored])
    sync.after_round([scored], 0, 1.0)
  assert sync.backoff == DraftSync.QUIET * 4 and caught == []
  before = len(asked)
  new = types.SimpleNamespace(id='b', room=50, num_computed=70, draft_computed=0, token_p=[0.5])
  for _ in range(5):      # the last 'no' may have been the last round: due 4 rounds after it
    sync.before_choice([scored, new])
    sync.after_round([scored, new], 0, 1.0)
    if caught:
      break
  if probe_new:
    assert caught == [['b']] and len(asked) == before      # unasked, the unscored one
    assert sync.backoff == 4
  else:
    assert caught == [] and sync.backoff == DraftSync.QUIET * 4
