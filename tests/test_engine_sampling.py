"""Per-request sampling in the engine: each request draws from its own distribution (greedy,
temperature, top-k side by side in one batch), through prefill and speculative rounds."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import perturbed
from jaxspec.decoding import SamplingParams, generate, prefill_logits, probabilities
from jaxspec.engine import Engine
from jaxspec.models import cache_for

PROMPT = [5, 17, 33, 2, 41]
TOP2 = SamplingParams(temperature=1.0, top_k=2)


def _target_probs(config, params, context, sampling):
  """The target's processed next-token distribution after `context` (the reference)."""
  cache = cache_for(config, np.array([[1, 2]]), 3, 8)
  logits, _ = prefill_logits(config, params, cache, jnp.asarray([context], jnp.int32),
                             jnp.array([len(context)], jnp.int32))
  return np.asarray(probabilities(logits, sampling))[0]


def test_each_request_samples_its_own_distribution(tiny):
  """Top-2 sampled requests interleaved with greedy ones, speculative K=2 with a draft that
  disagrees often: the greedy requests equal greedy decoding; the sampled ones' first token
  (prefill) and second token (speculative round: draft and target both under top-2, rejection
  sampling) follow the target's top-2 distributions (χ², per first token)."""
  config, params = tiny
  draft_params = perturbed(params, 0.5, 3)
  engine = Engine(config, params, num_slots=8, num_pages=40, page_size=8, chunk_size=8,
                  draft=config, draft_params=draft_params, k=2, seed=1)
  n = 240
  sampled = [engine.add_request(PROMPT, max_tokens=2, sampling=TOP2) for _ in range(n)]
  greedy = [engine.add_request(PROMPT, max_tokens=2) for _ in range(n // 8)]
  outs = engine.run()
  expected = generate(config, params, [PROMPT], max_new_tokens=2, page_size=8).tokens[0]
  assert all(outs[i].tokens == expected for i in greedy)

  pairs = np.array([outs[i].tokens for i in sampled])
  p1 = _target_probs(config, params, PROMPT, TOP2).astype(np.float64)
  support = np.flatnonzero(p1)
  assert len(support) == 2 and set(pairs[:, 0]) <= set(support)
  counts = np.array([(pairs[:, 0] == t).sum() for t in support])
  assert stats.chisquare(counts, p1[support] / p1[support].sum() * n).pvalue > 1e-3
  rejected = sum(outs[i].metrics.proposed - outs[i].metrics.accepted for i in sampled)
  assert rejected > 0                     # the second token went through real rejections
  for first in support:
    second = pairs[pairs[:, 0] == first, 1]
    p2 = _target_probs(config, params, PROMPT + [int(first)], TOP2).astype(np.float64)
    support2 = np.flatnonzero(p2)
    assert set(second) <= set(support2)
    counts2 = np.array([(second == t).sum() for t in support2])
    assert stats.chisquare(counts2, p2[support2] / p2[support2].sum() * len(second)).pvalue > 1e-3


def test_sampling_must_be_sampling_params(tiny):
  config, params = tiny
  engine = Engine(config, params, num_slots=2, num_pages=8, page_size=8, chunk_size=8)
  with pytest.raises(ValueError, match="request 0: sampling must be a SamplingParams, got 0.7"):
    engine.add_request(PROMPT, max_tokens=2, sampling=0.7)
  assert not engine.has_unfinished()


def test_timing_calls_leave_the_sampled_outputs_of_a_seed_as_they_were(tiny):
  """`warm_up` and `measure_costs` time device calls that draw PRNG keys too; the requests' key
  stream is put back, so a seed samples the same tokens with or without them, whenever run."""
  config, params = tiny
  hot = SamplingParams(temperature=1.0)

  def sampled(timed: str):
    engine = Engine(config, params, num_slots=1, num_pages=12, page_size=8, chunk_size=8, seed=7)
    if timed == 'warm_up':
      engine.warm_up(1, decode_rounds=1)
    rid = engine.add_request(PROMPT, max_tokens=8, sampling=hot)
    engine.step()
    engine.step()
    if timed == 'between':
      engine.measure_costs(1)
    return engine.run()[rid].tokens

  plain = sampled('none')
  assert sampled('warm_up') == plain and sampled('between') == plain
  assert len(set(plain)) > 2                     # really sampled (a flat tiny model at T = 1)
