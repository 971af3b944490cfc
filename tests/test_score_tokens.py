"""`score_tokens` (scoring every next-token prediction, the full cache or under eviction): its
arguments and the cache's size are checked, `score_tokens.lower` alike."""

import jax.numpy as jnp
import numpy as np
import pytest


def test_score_tokens_names_bad_arguments_and_a_cache_too_small(tiny):
  # It checked nothing: a cache of 8 slots scored 20 tokens (logprobs off by up to 0.78 and
  # `live` 20), token 999 gave a NaN logprob, a length past T was taken.
  from jaxspec.cache import init_eviction, make_policy  # pylint: disable=import-outside-toplevel
  from jaxspec.decoding import score_tokens  # pylint: disable=import-outside-toplevel
  from jaxspec.models import cache_for  # pylint: disable=import-outside-toplevel
  config, params = tiny

  def cache(slots):
    return cache_for(config, np.arange(1, slots // 4 + 1)[None], slots // 4 + 1, 4)

  tokens = jnp.arange(1, 21, dtype=jnp.int32)[None] % config.vocab_size
  for eviction in (None, 'full'):
    c = cache(8)
    e = None if eviction is None else init_eviction(make_policy('full'), c)
    with pytest.raises(ValueError, match='rows scored with the full cache need 20 cache slots '
                                         'per sequence, the cache holds 8'):
      score_tokens(config, params, c, e, tokens, jnp.array([20]))
  for bad_tokens, lengths, match in (
      (tokens.at[0, 5].set(999), [20], 'tokens holds token id 999 outside the vocabulary'),
      (tokens, [21], r'lengths must lie in \[0, T=20\], got 21'),
      (tokens.astype(jnp.float32), [20], 'tokens must be an integer array .B, T.'),
      (tokens, [20.0], 'lengths must be an integer array .B.')):
    with pytest.raises(ValueError, match=match):
      score_tokens(config, params, cache(20), None, bad_tokens, jnp.asarray(lengths))
  out = score_tokens(config, params, cache(20), None, tokens.at[0, 19].set(999), jnp.array([19]))
  assert np.isfinite(np.asarray(out['logprob'])).all()          # padding past a length is free
  # score_tokens.lower (the eviction experiment times the compiled step) checks alike.
  with pytest.raises(ValueError, match='rows scored with the full cache need 20'):
    score_tokens.lower(config, params, cache(8), None, tokens, jnp.array([20]))
  compiled = score_tokens.lower(config, params, cache(20), None, tokens, jnp.array([20])).compile()
  np.testing.assert_array_equal(
      compiled(params, cache(20), None, tokens, jnp.array([20]))['argmax'],
      score_tokens(config, params, cache(20), None, tokens, jnp.array([20]))['argmax'])
  h2o = cache(8)
  out = score_tokens(config, params, h2o, init_eviction(make_policy('h2o', 8), h2o), tokens,
                     jnp.array([20]))                            # a budget: 8 slots suffice
  assert int(np.asarray(out['live']).max()) <= 8
