"""Contract 2: speculative sampling matches the target distribution (Leviathan et al. 2023, Thm 1).

Test: Pearson chi-square goodness of fit of N = 200k emitted tokens against N * p on V = 8, for
the first emitted token (accept or residual path) and the second (accepted-then-next or bonus
path). The correct sampler must give p-value > 1e-3; a sampler that uses the draft's unprocessed
logits as q while the draft sampled under top-k must give p-value < 1e-12. Seeds are fixed, so
the test is deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decoding import SamplingParams, probabilities, rejection_sample, sample

N = 200_000
PASS_P, FAIL_P = 1e-3, 1e-12


def _emitted(rng, p_logits, q_logits, k, sampling, q_override=None):
  """First and second emitted tokens of N independent rounds with fixed p and q."""
  v = p_logits.shape[-1]
  p = probabilities(jnp.broadcast_to(p_logits, (N, k + 1, v)), sampling)
  q = probabilities(jnp.broadcast_to(q_logits, (N, k, v)), sampling)
  rng_draft, rng_accept = jax.random.split(rng)
  drafts = sample(rng_draft, q)                                    # [N, K]
  q_used = q if q_override is None else jnp.broadcast_to(q_override, (N, k, v))
  n, nxt = jax.jit(rejection_sample)(rng_accept, drafts, q_used, p)
  window = jnp.where(jnp.arange(k + 1)[None] < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                     nxt[:, None])
  return np.asarray(window[:, 0]), np.asarray(window[:, 1]), np.asarray(n), p[0]


def _pvalue(tokens, probs):
  probs = np.asarray(probs, np.float64)
  counts = np.bincount(tokens, minlength=probs.size)
  support = probs > 0
  assert counts[~support].sum() == 0, 'sampled a token the target gives probability 0'
  expected = probs[support] / probs[support].sum() * len(tokens)
  return stats.chisquare(counts[support], expected).pvalue


# p and q chosen to disagree: q heavy where p is light, q zero where p is not, and the reverse.
# Every position has its own p and q, so a sampler that mixes up positions fails too.
P_LOGITS = jnp.log(jnp.array([[0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02],
                              [0.02, 0.04, 0.06, 0.08, 0.10, 0.15, 0.25, 0.30],
                              [0.05, 0.30, 0.05, 0.20, 0.05, 0.20, 0.05, 0.10]]))
Q_LOGITS = jnp.log(jnp.array([[0.01, 0.02, 0.05, 0.10, 0.30, 0.40, 0.12, 1e-30],
                              [0.30, 0.20, 0.20, 0.10, 0.10, 0.05, 0.05, 1e-30]]))


@pytest.mark.parametrize('sampling', [SamplingParams(1.0), SamplingParams(0.7, top_k=5),
                                      SamplingParams(1.3, top_p=0.8)])
def test_speculative_samples_follow_target(sampling):
  first, second, n, p = _emitted(jax.random.PRNGKey(0), P_LOGITS, Q_LOGITS, 2, sampling)
  assert 0.05 < n.mean() < 1.95                           # both accept and reject paths taken
  assert _pvalue(first, p[0]) > PASS_P
  # Rows that accepted x_1 emit a second token: from the residual at position 2 or accepted
  # x_2 (n = 1 or 2), both of which must follow p_2 (p is fixed, so not conditioned on x_1).
  assert _pvalue(second[n >= 1], p[1]) > PASS_P


def test_bonus_token_follows_target():
  # q close to p: most rounds accept both drafts and emit the bonus from p_3.
  q_logits = P_LOGITS[:2] + 0.05 * jnp.arange(8)
  sampling = SamplingParams(1.0)
  rng = jax.random.PRNGKey(3)
  v = 8
  p = probabilities(jnp.broadcast_to(P_LOGITS, (N, 3, v)), sampling)
  q = probabilities(jnp.broadcast_to(q_logits, (N, 2, v)), sampling)
  drafts = sample(jax.random.fold_in(rng, 1), q)
  n, nxt = jax.jit(rejection_sample)(jax.random.fold_in(rng, 2), drafts, q, p)
  bonus = np.asarray(nxt)[np.asarray(n) == 2]
  assert len(bonus) > N // 2
  assert _pvalue(bonus, p[0, 2]) > PASS_P


def test_wrong_q_from_unprocessed_logits_fails_the_test():
  # The draft samples under top-k = 3, but the broken sampler passes softmax(raw logits) as q.
  sampling = SamplingParams(1.0, top_k=3)
  q_raw = jax.nn.softmax(Q_LOGITS[0])
  first, _, _, p = _emitted(jax.random.PRNGKey(0), P_LOGITS, Q_LOGITS, 2, sampling,
                            q_override=q_raw)
  assert _pvalue(first, p[0]) < FAIL_P


def test_greedy_is_the_one_hot_case():
  p = probabilities(jnp.array([[[0.1, 2.0, 0.3], [1.0, 0.0, 3.0]]]), SamplingParams(0.0))
  q = probabilities(jnp.array([[[0.0, 5.0, 0.0]]]), SamplingParams(0.0))
  n, nxt = rejection_sample(jax.random.PRNGKey(0), jnp.array([[1]]), q, p)
  assert int(n[0]) == 1 and int(nxt[0]) == 2                # accepted, bonus = argmax p_2
  n, nxt = rejection_sample(jax.random.PRNGKey(0), jnp.array([[0]]),
                            jax.nn.one_hot(jnp.array([[0]]), 3), p)
  assert int(n[0]) == 0 and int(nxt[0]) == 1                # rejected, correction = argmax p_1


def test_shapes_that_do_not_fit_together_are_named():
  # A [B, K, 1] q broadcast against a [B, K+1, 4] p: token 0 came out at 0.64 instead of 0.4.
  xs = jnp.zeros((3, 1), jnp.int32)
  p = jnp.full((3, 2, 4), 0.25)
  for q, pp in ((jnp.ones((3, 1, 1)), p), (jnp.full((3, 1, 5), 0.2), p),
                (jnp.full((3, 1, 4), 0.25), p[:, :1]), (jnp.full((3, 2, 4), 0.25), p)):
    with pytest.raises(ValueError, match=r'rejection_sample needs draft_tokens \[B, K\], q '
                                         r'\[B, K, V\] and p \[B, K\+1, V\], got \(3, 1\)'):
      rejection_sample(jax.random.PRNGKey(0), xs, q, pp)


def test_bfloat16_probabilities_are_drawn_from_in_float32():
  # In bfloat16 the Gumbel noise was bfloat16 too and its ties went to the lowest id: a token
  # of probability 0.5 came out 0.62 of the time, in `sample` and in the residual draw.
  v, n = 64, 100_000
  probs = jnp.asarray(np.r_[0.5, np.full(v - 1, 0.5 / (v - 1))], jnp.bfloat16)
  drawn = np.asarray(sample(jax.random.PRNGKey(1), jnp.broadcast_to(probs, (n, v))))
  assert abs((drawn == 0).mean() - 0.5) < 0.01                   # sd 0.0016
  q = jax.nn.one_hot(jnp.full((n, 1), 5), v, dtype=jnp.bfloat16)  # p(5) small: mostly rejected
  p = jnp.broadcast_to(probs, (n, 2, v))
  count, nxt = rejection_sample(jax.random.PRNGKey(2), jnp.full((n, 1), 5, jnp.int32), q, p)
  first = np.where(np.asarray(count) == 1, 5, np.asarray(nxt))
  assert abs((first == 0).mean() - 0.5) < 0.01


def test_a_proposal_id_outside_the_vocabulary_is_never_accepted():
  # take_along_axis wrapped -1 round to V - 1: the padding id was accepted and emitted.
  n, v = 40_000, 4
  p = jnp.broadcast_to(jnp.asarray([0.1, 0.2, 0.3, 0.4]), (n, 2, v))
  for bad in (-1, v):
    count, nxt = rejection_sample(jax.random.PRNGKey(0), jnp.full((n, 1), bad, jnp.int32),
                                  jnp.full((n, 1, v), 0.25), p)
    assert int(np.asarray(count).sum()) == 0
    assert _pvalue(np.asarray(nxt), p[0, 0]) > PASS_P             # drawn from p itself
