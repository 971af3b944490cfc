"""jaxspec.eval: the speedup formulas at their edges, and named errors for values out of range."""

import math

import pytest

from jaxspec.eval import (decode_step_bytes, expected_speedup, expected_tokens_per_round, mbu,
                          measure_bandwidth)
from jaxspec.models import ModelConfig
from jaxspec.training import init_params


def test_formulas_at_their_edges():
  assert expected_tokens_per_round(0.0, 4) == 1.0                 # nothing accepted
  assert expected_tokens_per_round(1.0, 4) == 5.0                 # everything accepted
  assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
  assert expected_speedup(1.0, 4, 0.0) == 5.0                     # a free draft
  assert expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
  assert math.isnan(expected_speedup(math.nan, 4, 0.1))           # a run without rounds


@pytest.mark.parametrize('call, match', [
    (lambda: expected_speedup(1.5, 4, 0.1), r'alpha must be a finite number in \[0.0, 1.0\]'),
    (lambda: expected_tokens_per_round(-0.5, 4), 'alpha must be'),    # gave 0.69 tokens
    (lambda: expected_speedup(0.5, -1, 0.1), 'k must be an int >= 0, got -1'),
    (lambda: expected_speedup(0.5, 2.5, 0.1), 'k must be an int >= 0, got 2.5'),
    (lambda: expected_speedup(0.5, 1, -1.0), r'c must be a finite number in \[0.0, inf\)'),
    (lambda: mbu(1000, 0.0, 1e9), 'step_seconds must be > 0'),      # ZeroDivisionError
    (lambda: mbu(1000, 1e-3, 0.0), 'bandwidth must be > 0'),
    (lambda: measure_bandwidth(1000), 'num_bytes must be an int >= 32768'),   # gave 0.0 B/s
    (lambda: measure_bandwidth(2 ** 20, repeats=0), 'repeats must be an int >= 1'),
])
def test_values_out_of_range_are_named(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_step_bytes_count_the_cache_in_its_own_dtype():
  # The KV part was counted at 4 bytes per value for a bfloat16 model too.
  for dtype, itemsize in (('float32', 4), ('bfloat16', 2)):
    config = ModelConfig.from_name('test-tiny', dtype=dtype)
    params = init_params(config, 0)
    base = decode_step_bytes(config, params, 1, 0)
    assert decode_step_bytes(config, params, 1, 10) - base == 10 * config.kv_bytes_per_token(
        itemsize)
  with pytest.raises(ValueError, match='kv_slots must be an int >= 0, got -1'):
    decode_step_bytes(config, params, 1, -1)
