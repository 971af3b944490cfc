"""Temperature, top-k and top-p processing, and parameter validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import SamplingParams, probabilities

LOGITS = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))


def test_temperature_one_is_softmax():
  np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(1.0)), [0.4, 0.3, 0.2, 0.1],
                             rtol=1e-6)


def test_top_k_keeps_k_most_likely_renormalised():
  np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(1.0, top_k=2)),
                             [4 / 7, 3 / 7, 0, 0], rtol=1e-6)


@pytest.mark.parametrize('top_p, expected', [(0.5, [4 / 7, 3 / 7, 0, 0]), (0.4, [1, 0, 0, 0]),
                                             (0.75, [4 / 9, 3 / 9, 2 / 9, 0]),
                                             (1.0, [0.4, 0.3, 0.2, 0.1])])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
  np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(1.0, top_p=top_p)), expected,
                             rtol=1e-5, atol=1e-7)


def test_greedy_is_one_hot_argmax():
  np.testing.assert_array_equal(probabilities(LOGITS[None], SamplingParams(0.0)), [[1, 0, 0, 0]])


@pytest.mark.parametrize('kwargs, bad', [(dict(temperature=-0.1), '-0.1'),
                                         (dict(top_p=0.0), '0.0'), (dict(top_p=1.5), '1.5'),
                                         (dict(top_k=-1), '-1')])
def test_bad_sampling_params_name_the_value(kwargs, bad):
  with pytest.raises(ValueError, match=bad.replace('.', r'\.')):
    SamplingParams(**kwargs)


@pytest.mark.parametrize('top_p', [0.01, 0.3, 0.9, 0.99])
def test_nucleus_is_the_smallest_set_reaching_top_p(top_p):
  import jax
  from jaxspec.decoding import nucleus_mask
  probs = jax.nn.softmax(3 * jax.random.normal(jax.random.PRNGKey(0), (200, 4096)), axis=-1)
  keep = np.asarray(nucleus_mask(probs, top_p))
  probs = np.asarray(probs, np.float64)
  for row, kept in zip(probs, keep):
    kept_mass = row[kept].sum()
    smallest_kept = row[kept].min()
    assert kept.any() and kept[row.argmax()]
    assert (row[~kept] <= smallest_kept).all()                 # a top set, not any set
    assert kept_mass >= top_p - 1e-6                           # reaches top_p ...
    assert kept_mass - smallest_kept < top_p + 1e-6            # ... and no smaller top set does
