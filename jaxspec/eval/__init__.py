"""Measurements: memory-bandwidth utilisation and the speculative-decoding cost model."""

from jaxspec.eval.bandwidth import (decode_step_bytes, expected_speedup, expected_tokens_per_round,
                                    mbu, measure_bandwidth)

__all__ = ['decode_step_bytes', 'expected_speedup', 'expected_tokens_per_round', 'mbu',
           'measure_bandwidth']
