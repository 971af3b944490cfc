"""Shared fixtures: a tiny target and drafts that agree with it to different degrees."""

import jax
import jax.numpy as jnp
import pytest

from jaxspec.models import ModelConfig
from jaxspec.training import init_params


@pytest.fixture(scope='session')
def tiny():
  """(config, params) of a tiny random target (V = 64). Projections are scaled up 3x so its
  greedy output wanders over the vocabulary instead of repeating one token. Exact-verify numerics,
  so that verification rounds bit for bit like decode (see ModelConfig.exact_verify)."""
  config = ModelConfig.from_name('test-tiny', exact_verify=True)
  params = jax.tree_util.tree_map_with_path(
      lambda path, w: w * 3.0 if 'kernel' in jax.tree_util.keystr(path) else w,
      init_params(config, 0))
  return config, params


def perturbed(params, scale: float, seed: int):
  """params + scale * N(0, |w|) noise: a draft that agrees with the target only partly."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [w + scale * jnp.std(w) * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(tree, noisy)


@pytest.fixture(scope='session')
def tiny_draft(tiny):
  """(config, params): the tiny target with noise added, so α is strictly between 0 and 1."""
  config, params = tiny
  return config, perturbed(params, 0.02, 1)
