"""Sampling, autoregressive and speculative decoding."""

from jaxspec.decoding.constrained import ConstrainedResult, constrained_generate
from jaxspec.decoding.constraint import ConstraintError, TokenConstraint
from jaxspec.decoding.autoregressive import (decode_autoregressive, decode_step, prefill,
                                            prefill_logits)
from jaxspec.decoding.evicting import (decode_autoregressive_evicting, decode_speculative_evicting,
                                       decode_step_evicting, prefill_evicting, score_tokens)
from jaxspec.decoding.generate import MAX_K, ContextOverflowError, GenerationResult, generate
from jaxspec.decoding.output import (NonFiniteLogitsError, Output, check_valid, commit,
                                     cut_lengths)
from jaxspec.decoding.prefix_generate import PrefixCachedGenerator
from jaxspec.decoding.rejection import rejection_sample
from jaxspec.decoding.sampling import (INVALID_TOKEN, RowSampling, SamplingParams, nucleus_mask,
                                       probabilities, sample)
from jaxspec.decoding.speculative import (SpecStats, decode_speculative, draft_tokens,
                                         speculative_round, verify)

__all__ = ['ConstrainedResult', 'ConstraintError', 'ContextOverflowError', 'INVALID_TOKEN',
           'MAX_K', 'NonFiniteLogitsError', 'TokenConstraint', 'check_valid',
           'constrained_generate', 'GenerationResult', 'Output', 'PrefixCachedGenerator',
           'RowSampling', 'SamplingParams', 'SpecStats', 'commit', 'cut_lengths',
           'decode_autoregressive', 'decode_speculative', 'decode_step', 'draft_tokens',
           'generate', 'nucleus_mask', 'prefill', 'prefill_logits', 'probabilities',
           'rejection_sample', 'sample', 'speculative_round', 'verify',
           'decode_autoregressive_evicting', 'decode_speculative_evicting', 'decode_step_evicting',
           'prefill_evicting', 'score_tokens']
