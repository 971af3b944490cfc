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
