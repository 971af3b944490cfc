"""`jaxspec.engine.timing.fastest`, the timer behind the engine's cost tables: the call order
(one untimed call per key, then per round an untimed call and a block of timed ones per key, the
keys in alternating order), warm prices, the minimum kept, bad arguments refused."""

import time

import pytest

from jaxspec.engine.timing import fastest


def test_fastest_times_each_call_after_an_untimed_one():
  order = []

  def call(key):
    return lambda: order.append(key)

  times = fastest({'a': call('a'), 'b': call('b')}, repeats=3, block=2)
  assert set(times) == {'a', 'b'} and all(t >= 0 for t in times.values())
  # One untimed call each, then per round and key an untimed call and `block` timed ones back
  # to back, the keys in alternating order.
  assert order == ['a', 'b'] + ['a'] * 3 + ['b'] * 3 + ['b'] * 3 + ['a'] * 3 + \
      ['a'] * 3 + ['b'] * 3
  with pytest.raises(ValueError, match='repeats must be an int >= 1, got 0'):
    fastest({'a': call('a')}, repeats=0)
  with pytest.raises(ValueError, match='block must be an int >= 1, got 0'):
    fastest({'a': call('a')}, repeats=1, block=0)


def test_fastest_prices_a_call_warm_not_right_after_another_one():
  # A call that runs slow right after a different call (as a device step does after another
  # executable) is timed at its warm speed: every timed call follows a call of its own key, the
  # middle key's too (with one call per key in turn, 'b' would always follow 'a' or 'c').
  last = [None]

  def call(key):
    def run():
      time.sleep(0.03 if last[0] not in (None, key) else 0.001)
      last[0] = key
    return run

  times = fastest({'a': call('a'), 'b': call('b'), 'c': call('c')}, repeats=2, block=1)
  assert max(times.values()) < 0.02, times


def test_fastest_keeps_the_minimum_of_a_keys_timed_calls():
  # Timing noise only adds: of calls taking 30, 1, 30, 1, ... ms the 1 ms is kept, not a mean.
  count = [0]

  def run():
    count[0] += 1
    time.sleep(0.03 if count[0] % 2 else 0.001)

  seconds = fastest({'a': run}, repeats=2, block=3)['a']
  assert 0.001 <= seconds < 0.02, seconds


def _fake_clock(monkeypatch, seconds_of):
  """Calls that advance a fake perf_counter by seconds_of(key, round) (round -1: the first,
  untimed call of each key; two keys, block = 1, so four calls a round)."""
  from jaxspec.engine import timing
  now, count = [0.0], [0]
  monkeypatch.setattr(timing.time, 'perf_counter', lambda: now[0])

  def call(key):
    def run():
      now[0] += seconds_of(key, (count[0] - 2) // 4 if count[0] >= 2 else -1)
      count[0] += 1
    return run
  return call


def test_base_of_prices_a_key_by_its_median_ratio_to_the_base_in_the_same_round(monkeypatch):
  # The machine's load moves both keys of a round alike (x1, x3, x0.5 ...); 'b' costs twice
  # 'a' except for one lucky round (0.6 where a took 1). The minimum takes each key's luckiest
  # moment on its own (b's fluke against a's light-load round 0.5: b = 1.2 a); the median of
  # the rounds' ratios keeps b at twice a, scaled to a's fastest round.
  load = [1.0, 3.0, 0.5, 1.0, 2.0]

  def seconds_of(key, r):
    if key == 'a':
      return load[r] if r >= 0 else 1.0
    return 0.6 if r == 3 else 2 * (load[r] if r >= 0 else 1.0)

  call = _fake_clock(monkeypatch, seconds_of)
  mins = fastest({'a': call('a'), 'b': call('b')}, repeats=5, block=1)
  assert mins == pytest.approx({'a': 0.5, 'b': 0.6})
  call = _fake_clock(monkeypatch, seconds_of)
  ratios = fastest({'a': call('a'), 'b': call('b')}, repeats=5, block=1, base_of={'b': 'a'})
  assert ratios['a'] == pytest.approx(0.5) and ratios['b'] == pytest.approx(1.0)   # median ratio 2
  call = _fake_clock(monkeypatch, lambda key, r: 3.0 if key == 'b' and r in (1, 2, 3) else 1.0)
  ratios = fastest({'a': call('a'), 'b': call('b')}, repeats=5, block=1, base_of={'b': 'a'})
  assert ratios == pytest.approx({'a': 1.0, 'b': 3.0})   # 3 of 5 rounds at 3x: the median, not the minimum 1


def test_base_of_must_name_keys_of_calls_and_a_base_that_is_not_priced_itself():
  calls = {'a': lambda: None, 'b': lambda: None, 'c': lambda: None}
  with pytest.raises(ValueError, match="base_of 'b': 'z' must be keys of calls"):
    fastest(calls, repeats=1, base_of={'b': 'z'})
  with pytest.raises(ValueError, match="base_of 'z'"):
    fastest(calls, repeats=1, base_of={'z': 'a'})
  with pytest.raises(ValueError, match="base_of 'c': 'b' must be keys of calls, and 'b' not"):
    fastest(calls, repeats=1, base_of={'b': 'a', 'c': 'b'})
  assert set(fastest(calls, repeats=1, base_of={'a': 'a'})) == {'a', 'b', 'c'}   # itself: min


def test_decode_costs_price_k_above_the_smallest_by_their_median_ratio_per_round(monkeypatch):
  # An engine's decode table: each row count's smallest K at its fastest round, the others at
  # that times their median ratio to it in the same round (as the fake decode calls below: a
  # round at K costs rows x (1 + K / 2) x the load, and one timed call at rows 1, K = 1 in the
  # first round is lucky, 0.1 s); with
  # ratios=False each K keeps its own fastest call.
  from types import SimpleNamespace
  from jaxspec.engine import timing
  now, calls = [0.0], []
  monkeypatch.setattr(timing.time, 'perf_counter', lambda: now[0])
  load = [1.0, 2.0, 4.0, 3.0]

  def call_decode(table, lengths, *args, k, caps):
    calls.append((table.shape[0], k))
    r = max(len(calls) - 7, 0) // 24    # 6 untimed calls, then 6 keys x (1 + 3 timed) a round
    now[0] += 0.1 if len(calls) == 13 else table.shape[0] * (1 + k / 2) * load[r]

  engine = SimpleNamespace(policy=SimpleNamespace(candidates=(0, 1, 2)), pages_per_seq=3,
                           max_stop_tokens=2, _call_decode=call_decode)
  table = timing.decode_costs(engine, 3, (1, 2))
  assert calls[12] == (1, 1) and set(calls) == {(r, k) for r in (1, 2) for k in (0, 1, 2)}
  assert len(table) == 6
  for rows in (1, 2):
    assert table[rows, 0] == pytest.approx(rows * 1.0)                 # its fastest round
    for k in (1, 2):
      assert table[rows, k] == pytest.approx(rows * (1 + k / 2)), (rows, k)
  calls.clear()
  assert timing.decode_costs(engine, 3, (1, 2), ratios=False)[1, 1] == pytest.approx(0.1)


@pytest.mark.parametrize('repeats,budget_s,rounds', [
    (40, 10.0, 5),      # past the budget after 3 rounds: still the 5 every table gets
    (40, 30.0, 8),      # rounds start at 0, 4, ..., 28 s; the 9th would start at 32
    (3, 1.0, 3),        # fewer rounds asked than the minimum: those
    (8, None, 8)])      # no budget: every round
def test_a_time_budget_stops_new_rounds_after_the_minimum(monkeypatch, repeats, budget_s,
                                                          rounds):
  from jaxspec.engine.timing import BUDGET_MIN_ROUNDS
  assert BUDGET_MIN_ROUNDS == 5
  calls = []
  call = _fake_clock(monkeypatch, lambda key, r: calls.append(key) or 1.0)   # 1 s a call
  fastest({'a': call('a'), 'b': call('b')}, repeats=repeats, block=1, budget_s=budget_s)
  assert len(calls) == 2 + 4 * rounds


@pytest.mark.parametrize('bad', [0, -1.0, float('inf'), float('nan'), True, '5'])
def test_a_time_budget_must_be_a_finite_number_above_zero(bad):
  with pytest.raises(ValueError, match=r'budget_s must be a finite number in \(0.0, inf\)'):
    fastest({'a': lambda: None}, repeats=1, budget_s=bad)
