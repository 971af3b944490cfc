"""Temperature, top-k and top-p processing, and parameter validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import RowSampling, SamplingParams, probabilities

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


ROW_SETTINGS = [SamplingParams(), SamplingParams(1.0), SamplingParams(0.7, top_k=5),
                SamplingParams(1.3, top_p=0.8), SamplingParams(0.9, top_k=40, top_p=0.6),
                SamplingParams(1.0, top_k=1), SamplingParams(0.5, top_k=4096)]


@pytest.mark.parametrize('shape', [(64,), (3, 64)])
def test_row_sampling_gives_each_row_its_own_static_distribution(shape):
  """One call with per-row parameters equals, row by row, `probabilities` with that row's
  static `SamplingParams` (greedy, temperature, top-k, top-p and mixes in one batch; logits
  [B, V] and [B, K+1, V])."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(len(ROW_SETTINGS),) + shape) * 3, jnp.float32)
  rows = probabilities(logits, RowSampling.stack(ROW_SETTINGS))
  for b, params in enumerate(ROW_SETTINGS):
    np.testing.assert_allclose(rows[b], probabilities(logits[b], params), rtol=2e-5, atol=1e-7,
                               err_msg=str(params))


@pytest.mark.parametrize('settings', [[SamplingParams()] * 3, [SamplingParams(1.0)] * 3,
                                      [SamplingParams(), SamplingParams(1.0, top_k=2),
                                       SamplingParams(1.0, top_p=0.5)]])
def test_row_sampling_batches_that_skip_work_still_match(settings):
  """All-greedy and no-top-k/top-p batches take the skipping branches; results unchanged."""
  logits = jnp.stack([LOGITS] * len(settings))
  rows = jax.jit(probabilities)(logits, RowSampling.stack(settings))
  for b, params in enumerate(settings):
    np.testing.assert_allclose(rows[b], probabilities(LOGITS, params), rtol=1e-5, atol=1e-7)


def test_row_sampling_respects_the_constraint_mask():
  mask = jnp.array([[False, True, True, True], [False, True, True, True]])
  rows = probabilities(jnp.stack([LOGITS] * 2), RowSampling.stack(
      [SamplingParams(), SamplingParams(1.0, top_k=2)]), mask=mask)
  np.testing.assert_allclose(rows, [[0, 1, 0, 0], [0, 3 / 5, 2 / 5, 0]], rtol=1e-6, atol=1e-7)


def test_row_sampling_stack_refuses_other_values():
  with pytest.raises(ValueError, match='0.5'):
    RowSampling.stack([SamplingParams(), 0.5])


def test_row_top_k_cuts_on_logits_like_the_static_path():
  """Logits closer than float32 resolution after softmax (high temperature) are still cut by
  rank, not kept as probability ties."""
  logits = jnp.asarray(np.linspace(0.0, 1e-5, 64)[None], jnp.float32)
  params = SamplingParams(100.0, top_k=10)
  rows = probabilities(logits, RowSampling.stack([params]))
  assert int((rows[0] > 0).sum()) == 10
  np.testing.assert_allclose(rows[0], probabilities(logits[0], params), rtol=1e-6)


@pytest.mark.parametrize('kwargs', [dict(temperature=True), dict(top_p=True)])
def test_bools_are_not_sampling_numbers(kwargs):
  with pytest.raises(ValueError, match='True'):
    SamplingParams(**kwargs)


@pytest.mark.parametrize('kwargs, expected', [
    (dict(temperature=np.float32(0.5)), (0.5, 0, 1.0)),
    (dict(temperature=np.float64(0.7), top_k=np.int64(5), top_p=np.float32(0.25)), (0.7, 5, 0.25)),
    (dict(temperature=np.int32(2), top_k=np.uint8(3), top_p=np.int64(1)), (2.0, 3, 1.0)),
    (dict(temperature=1, top_k=4, top_p=1), (1.0, 4, 1.0)),
    (dict(temperature=np.array(0.5), top_k=np.array(3), top_p=jnp.array(0.25)), (0.5, 3, 0.25))])
def test_numpy_scalars_are_stored_as_python_numbers(kwargs, expected):
  params = SamplingParams(**kwargs)
  values = (params.temperature, params.top_k, params.top_p)
  assert values == expected
  assert [type(v) for v in values] == [float, int, float]
  python = SamplingParams(*expected)
  assert params == python and hash(params) == hash(python)   # one static jit key, not two


def test_a_traced_number_is_named_not_a_jax_conversion_error():
  def build(t):
    SamplingParams(temperature=t)
    return t
  with pytest.raises(ValueError, match='temperature must be a number >= 0, got .*Tracer'):
    jax.jit(build)(jnp.float32(0.5))


def test_numpy_scalar_params_share_one_compilation_with_python_ones():
  traces = []

  def traced(logits, params):
    traces.append(params)                                       # runs once per compilation
    return probabilities(logits, params)

  probs = jax.jit(traced, static_argnums=1)
  python = probs(LOGITS, SamplingParams(0.5, top_k=2))
  numpy = probs(LOGITS, SamplingParams(np.float32(0.5), top_k=np.int64(2)))
  assert len(traces) == 1
  np.testing.assert_array_equal(python, numpy)


@pytest.mark.parametrize('kwargs, bad', [
    (dict(temperature=np.bool_(True)), 'True'), (dict(top_p=np.bool_(True)), 'True'),
    (dict(top_k=np.bool_(True)), 'True'), (dict(top_k=True), 'True'),
    (dict(temperature=np.float32('nan')), 'nan'), (dict(temperature=float('nan')), 'nan'),
    (dict(top_p=np.float64('nan')), 'nan'), (dict(temperature=np.float32('inf')), 'inf'),
    (dict(top_p=np.float32('inf')), 'inf'), (dict(temperature=np.float32(-0.5)), '-0.5'),
    (dict(top_p=np.float32(1.5)), '1.5'), (dict(top_k=np.int64(-3)), '-3'),
    (dict(top_k=np.float64(5.0)), '5.0'), (dict(top_k=5.0), '5.0'),
    (dict(temperature='0.5'), "'0.5'"), (dict(temperature=None), 'None'),
    (dict(temperature=np.array([0.5])), r'\[0\.5\]'), (dict(top_k=np.array(2.0)), r'array\(2\.\)'),
    (dict(top_p=0.5 + 0j), r'0\.5\+0j')])
def test_bad_numbers_and_non_numbers_name_the_value(kwargs, bad):
  with pytest.raises(ValueError, match=bad):
    SamplingParams(**kwargs)


@pytest.mark.parametrize('top_p', [1e-40, 1e-300, 1e-7])
def test_a_vanishing_top_p_keeps_the_argmax(top_p):
  # 1e-40 is 0 (or subnormal) in float32: every cut had "enough" mass above it, the mask kept
  # nothing and sampling drew token 0. The nucleus always holds the most likely token.
  logits = jnp.array([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.2, 2.9]])
  expected = jax.nn.one_hot(jnp.argmax(logits, axis=-1), 4)
  static = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
  rows = probabilities(logits, RowSampling.stack([SamplingParams(1.0, 0, top_p)] * 2))
  np.testing.assert_allclose(static, expected)
  np.testing.assert_allclose(rows, expected)


def test_a_top_k_past_int32_keeps_every_token():
  # 2**31 overflowed int32 in RowSampling.stack and failed every engine step of its batch.
  logits = jnp.array([[0.1, 2.0, -1.0, 0.5]])
  rows = RowSampling.stack([SamplingParams(temperature=1.0, top_k=2 ** 31)])
  assert int(rows.top_k[0]) == 2 ** 31 - 1
  np.testing.assert_allclose(probabilities(logits, rows),
                             probabilities(logits, SamplingParams(temperature=1.0)), rtol=1e-6)


@pytest.mark.parametrize('params', [None, {'temperature': 1.0}])
def test_probabilities_names_params_of_another_type(params):
  with pytest.raises(ValueError, match='params must be a SamplingParams or a RowSampling, got'):
    probabilities(jnp.zeros((1, 4)), params)       # was: no attribute 'greedy'
