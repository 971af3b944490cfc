"""Re-timing idle rounds while the goodput policy stays at K = 0 (`GoodputK.retime_k`,
`LiveCosts.retimed`, `timing.retime`): a start-up table that priced K >= 1 too dear no longer
holds K = 0 for a whole run. Policy tests are host-side, no model; the engine's, the tiny model."""

import math

import numpy as np
import pytest

from jaxspec.decoding.sampling import SamplingParams
from jaxspec.engine import Engine
from jaxspec.engine.goodput import AlphaTracker, GoodputK
from jaxspec.engine.k_policy import KPolicy

IDS = ['a', 'b']


def _policy(alpha, costs, **kwargs):
  kwargs.setdefault('cold_rounds', 0)
  kwargs.setdefault('switch_rounds', 0)
  policy = GoodputK(tracker=AlphaTracker(prior=alpha, prior_trials=1e9), costs=costs,
                    spec_margin=0.0, **kwargs)
  policy.setup(1)
  return policy


def _zero_rounds(policy, n, seconds=1.0):
  for _ in range(n):
    policy.round_timing(0, seconds, 0.0)


def test_a_table_too_dear_for_k1_is_reshaped_by_retimings_and_k1_comes_back():
  """α = 0.5: K = 1 emits 1.5 tokens a round, so it pays below 1.5x K = 0's seconds. The
  start-up table says 1.7x (K = 0 chosen); idle rounds timed now say 1.3x. The first sample
  moves the K >= 1 entries halfway (median with 1.0), the second all the way."""
  policy = _policy(0.5, {0: 1.0, 1: 1.7}, retime_budget=0.05)
  assert policy.choose(IDS)[0] == 0
  _zero_rounds(policy, GoodputK.STALE_ROUNDS - 1)
  assert policy.retime_k is None                   # not yet long at K = 0
  _zero_rounds(policy, 1)
  assert policy.retime_k == 1                      # the first: at once
  policy.retimed(None, {0: 2.0, 1: 2.6}, spent_s=1.0)
  assert policy.live.shape == pytest.approx((1.3 / 1.7 + 1) / 2)
  assert policy.costs[1] == pytest.approx(1.5)     # K = 1 only level with K = 0: K = 0
  assert policy.retime_k is None                   # the budget starts again: 1 s at 5 %
  assert policy.choose(IDS)[0] == 0
  _zero_rounds(policy, 19)
  assert policy.retime_k is None
  _zero_rounds(policy, 1)
  assert policy.retime_k == 1
  policy.retimed(None, {0: 1.0, 1: 1.3}, spent_s=1.0)
  assert policy.costs[1] == pytest.approx(1.3)
  assert policy.choose(IDS)[0] == 1 and policy.retime_k is None     # not at K = 0


def test_retimings_that_agree_with_the_table_come_ever_more_rarely():
  """Each re-timing whose sample is within RETIME_AGREE of the shape priced doubles the K = 0
  time the next one waits for; one that disagrees sets it back."""
  policy = _policy(0.5, {0: 1.0, 1: 1.7}, retime_budget=0.1)
  assert policy.choose(IDS)[0] == 0
  _zero_rounds(policy, 200)
  waits = []
  for ratio in (1.75, 1.65, 1.7, 1.3):           # 3 agree with 1.7 (within 10 %), then not
    policy.retimed(None, {0: 1.0, 1: ratio}, spent_s=1.0)
    rounds = 0
    while policy.retime_k is None:
      _zero_rounds(policy, 1)
      rounds += 1
    waits.append(rounds)
  assert waits == [20, 40, 80, 10]               # 1 s x gap at 10 %; the gap back to 1


def test_no_retiming_out_of_reach_off_or_while_speculating():
  # α = 0.1: K = 1 would need to cost under 1.1x K = 0's; at 1.6x a 20 % cheaper round is
  # still out of reach (1.28x), so re-timing could not change the choice.
  far = _policy(0.1, {0: 1.0, 1: 1.6}, retime_budget=1.0)
  assert far.choose(IDS)[0] == 0
  _zero_rounds(far, 1000)
  assert far.retime_k is None
  off = _policy(0.5, {0: 1.0, 1: 1.6}, retime_budget=None)
  assert off.choose(IDS)[0] == 0
  _zero_rounds(off, 1000)
  assert off.retime_k is None
  spec = _policy(0.5, {0: 1.0, 1: 1.2}, retime_budget=1.0)
  assert spec.choose(IDS)[0] == 1
  _zero_rounds(spec, 1000)                         # rounds at K = 0 told, but K = 1 chosen
  assert spec.retime_k is None


def test_retiming_keeps_the_price_live_k1_rounds_measured():
  """Live K >= 1 ratios, and the quotient carried past staleness, were measured against the
  table as it was: re-expressed against the re-shaped one they price K >= 1 as before (what
  the re-timing moves is the prior that stands in for unmeasured rounds)."""
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  for _ in range(3):
    policy.round_timing(1, 3.0, 0.0)               # K = 1 rounds at 2x the table
  assert policy.costs[1] == pytest.approx(3.0)
  policy.live.retimed(None, {0: 1.0, 1: 1.2})      # sample 0.8: shape 0.9
  assert policy.live.shape == pytest.approx(0.9)
  assert policy.costs[1] == pytest.approx(3.0)
  # Stale: the square root of the quotient to the re-shaped table (2 / 0.9) is carried.
  _zero_rounds(policy, GoodputK.STALE_ROUNDS)
  assert policy.costs[1] == pytest.approx(1.5 * 0.9 * math.sqrt(2.0 / 0.9))
  policy.live.retimed(None, {0: 1.0, 1: 1.2})      # shape 0.8: the quotient 2 / 0.8
  assert policy.live.shape == pytest.approx(0.8)
  assert policy.costs[1] == pytest.approx(1.5 * 0.8 * math.sqrt(2.0 / 0.8))
  policy.set_costs({0: 1.0, 1: 1.5})               # a new table drops the samples
  assert policy.live.shape == 1.0 and policy.costs[1] == pytest.approx(1.5)


@pytest.mark.parametrize('seconds,message', [
    ({1: 1.0}, 'must hold K = 0 and one K >= 1'),
    ({0: 1.0}, 'must hold K = 0 and one K >= 1'),
    ({0: 1.0, 1: 1.0, 2: 1.0}, 'must hold K = 0 and one K >= 1'),
    ({0: 1.0, 5: 1.0}, r'of the tables \[0, 1\]'),
    ({0: 1.0, 1: float('nan')}, 'must be finite and > 0'),
    ({0: 0.0, 1: 1.0}, 'must be finite and > 0')])
def test_bad_retimed_seconds_are_named(seconds, message):
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  with pytest.raises(ValueError, match=message):
    policy.retimed(None, seconds, 0.1)
  assert policy.live.shape == 1.0


@pytest.mark.parametrize('budget', [0, 0.0, -0.1, 1.5, float('nan'), True, '0.01'])
def test_retime_budget_must_be_in_0_1(budget):
  with pytest.raises(ValueError, match=r'retime_budget must be a finite number in \(0.0, 1.0\]'):
    GoodputK(retime_budget=budget)


def test_bad_spent_seconds_are_named():
  policy = _policy(0.5, {0: 1.0, 1: 1.5})
  with pytest.raises(ValueError, match='spent_s'):
    policy.retimed(None, {0: 1.0, 1: 1.2}, float('inf'))


class RetimeOnce(KPolicy):
  """K = 0 every round; asks for one re-timing of K = 1 before its `ask`-th round."""

  def __init__(self, ask):
    super().__init__()
    self.ask, self.rounds, self.retimes = ask, 0, []

  @property
  def candidates(self):
    return (0, 1)

  @property
  def retime_k(self):
    return 1 if self.rounds == self.ask and not self.retimes else None

  def choose(self, request_ids):
    self.rounds += 1
    return 0, [0] * len(request_ids)

  def retimed(self, rows, seconds, spent_s):
    self.retimes.append((rows, dict(seconds), spent_s))


def test_the_engine_retimes_between_rounds_and_leaves_the_outputs_alone(tiny, tiny_draft):
  """The engine times idle rounds of the last round's bucket at K = 0 and the asked K when the
  policy asks, between rounds; sampled outputs are those of an engine never asked (the timed
  calls draw no key from the requests' stream; idle rows write only the null page)."""
  config, params = tiny
  draft, draft_params = tiny_draft
  outputs = []
  for ask in (None, 3):
    policy = RetimeOnce(ask)
    engine = Engine(config, params, draft=draft, draft_params=draft_params, k=2,
                    k_policy=policy, num_slots=2, page_size=8, chunk_size=8, num_pages=32,
                    seed=5)
    rng = np.random.default_rng(0)
    for n in (5, 11):
      engine.add_request(rng.integers(3, 64, size=n).tolist(), max_tokens=9,
                         sampling=SamplingParams(temperature=1.0))
    outputs.append({rid: out.tokens for rid, out in engine.run().items()})
    if ask is None:
      assert not policy.retimes
      continue
    (rows, seconds, spent_s), = policy.retimes
    assert rows == 2 and set(seconds) == {0, 1}
    assert all(s > 0 for s in seconds.values()) and spent_s >= sum(seconds.values())
  assert outputs[0] == outputs[1]
