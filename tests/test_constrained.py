"""Constrained decoding: masks in the sampler, llguidance constraints, the host-stepped loops, and
constrained speculative sampling's distribution (chi-square, as in test_rejection_sampling)."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import tokenizers
from scipy import stats
from tokenizers import decoders, models, pre_tokenizers

from jaxspec.data import Tokenizer
from jaxspec.decoding import (ContextOverflowError, NonFiniteLogitsError, SamplingParams,
                              probabilities, rejection_sample, sample)
from jaxspec.decoding.constrained import constrained_generate
from jaxspec.decoding.constraint import ConstraintError, TokenConstraint
from jaxspec.models import load_model, shipped

TOKENIZER = shipped('tokenizer.json')
SCHEMAS = [
    # nested objects, an enum, bounded strings
    {'type': 'object', 'properties': {
        'name': {'type': 'string', 'maxLength': 12},
        'http': {'type': 'object', 'properties': {'method': {'enum': ['GET', 'POST', 'PUT']},
                                                  'uri': {'type': 'string', 'maxLength': 8}},
                 'required': ['method', 'uri'], 'additionalProperties': False}},
     'required': ['name', 'http'], 'additionalProperties': False},
    # arrays of objects, numbers with bounds
    {'type': 'object', 'properties': {
        'items': {'type': 'array', 'minItems': 1, 'maxItems': 3, 'items': {
            'type': 'object', 'properties': {'id': {'type': 'integer', 'minimum': 0,
                                                    'maximum': 999},
                                             'score': {'type': 'number', 'minimum': -1,
                                                       'maximum': 1}},
            'required': ['id', 'score'], 'additionalProperties': False}}},
     'required': ['items'], 'additionalProperties': False},
    # a top-level array of enums and a boolean/null union
    {'type': 'object', 'properties': {
        'tags': {'type': 'array', 'maxItems': 4, 'items': {'enum': ['a', 'bb', 'ccc']}},
        'flag': {'type': ['boolean', 'null']}},
     'required': ['tags', 'flag'], 'additionalProperties': False},
]


@pytest.fixture(scope='module')
def models_():
  """(target, target_params, draft, draft_params, tokenizer): the shipped draft as a cheap
  target, and the same weights with noise as its draft (so α is strictly between 0 and 1).
  Exact-verify numerics, so that greedy verification rounds bit for bit like decode."""
  from conftest import perturbed  # pylint: disable=import-outside-toplevel
  config, params = load_model(shipped('draft'))
  config = dataclasses.replace(config, exact_verify=True)
  return config, params, config, perturbed(params, 0.3, 1), Tokenizer.load(TOKENIZER)


def _constraint(schema):
  return TokenConstraint.json_schema(schema, TOKENIZER, vocab_size=4096)


def test_mask_conditions_every_sampler_on_the_allowed_set():
  logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
  mask = jnp.array([[False, True, True, False]])
  np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0), mask)[0],
                             [0, 0.6, 0.4, 0], atol=1e-6)
  # greedy: the argmax among allowed tokens; top-k counts allowed tokens only
  assert int(jnp.argmax(probabilities(logits, SamplingParams(0.0), mask))) == 1
  np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0, top_k=1), mask)[0],
                             [0, 1, 0, 0], atol=1e-6)
  np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0, top_p=0.5), mask)[0],
                             [0, 1, 0, 0], atol=1e-6)


@pytest.mark.parametrize('schema', SCHEMAS, ids=['nested-enum', 'array-numbers', 'enum-array'])
def test_every_constrained_output_parses_and_validates(models_, schema):
  _, _, draft, draft_params, tok = models_
  prompt = tok.encode('{\n  "version":"2.0",\n  "operations":{\n')
  for seed in range(3):
    constraint = _constraint(schema)
    out = constrained_generate(draft, draft_params, prompt, constraint, max_new_tokens=160,
                               stop_token=tok.eos_id, sampling=SamplingParams(1.0), seed=seed)
    assert out.finished and constraint.done, tok.decode(out.tokens)
    jsonschema.validate(json.loads(tok.decode(out.tokens[:-1])), schema)


def test_constrained_speculative_greedy_equals_constrained_autoregressive(models_):
  target, target_params, draft, draft_params, tok = models_
  prompt = tok.encode('{\n  "operations":{\n    "GetQuery":')
  outs = [constrained_generate(target, target_params, prompt, _constraint(SCHEMAS[0]),
                               max_new_tokens=64, stop_token=tok.eos_id, **spec)
          for spec in ({}, dict(draft=draft, draft_params=draft_params, k=3))]
  assert outs[0].tokens == outs[1].tokens and outs[0].finished
  assert outs[1].proposed > 0 and 0 < outs[1].accepted <= outs[1].proposed


def _ab_tokenizer(path):
  """A byte-level BPE vocabulary of only 'a', 'b', 'ab' (+ specials): no token spells 'c'."""
  vocab = {'<|pad|>': 0, '<|bos|>': 1, '<|eos|>': 2, 'a': 3, 'b': 4, 'ab': 5}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[('a', 'b')]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(['<|pad|>', '<|bos|>', '<|eos|>'])
  tok.save(str(path))
  return path


def test_a_constraint_that_cannot_continue_raises(tmp_path):
  path = _ab_tokenizer(tmp_path / 'ab.json')
  c = TokenConstraint.regex('a(b|c)c', path, vocab_size=8)
  np.testing.assert_array_equal(np.flatnonzero(c.allowed()), [3, 5])   # 'a' or 'ab'
  c.advance(3)
  c.advance(4)                            # 'ab': only 'c' may follow, and no token spells it
  with pytest.raises(ConstraintError, match='cannot be continued'):
    c.allowed()
  c = _constraint({'type': 'integer'})
  with pytest.raises(ConstraintError, match='not allowed'):
    c.advance(Tokenizer.load(TOKENIZER).encode('x')[0])
  with pytest.raises(ConstraintError, match='invalid constraint'):
    _constraint({'type': 'string', 'minLength': 5, 'maxLength': 2})


def test_rollback_restores_the_allowed_set():
  tok = Tokenizer.load(TOKENIZER)
  c = _constraint(SCHEMAS[2])
  before = c.allowed()
  ids = tok.encode('{"tags":["bb"],"flag":true}')
  for t in ids:
    c.advance(t)
  assert c.done
  c.advance(tok.eos_id)
  c.rollback(len(ids) + 1)
  np.testing.assert_array_equal(c.allowed(), before)
  assert c.consumed == 0


def test_constraint_arguments_and_a_used_constraint_are_named(models_):
  target, target_params, draft, draft_params, tok = models_
  c = _constraint(SCHEMAS[2])
  for token in (2.9, -1, 10 ** 10):           # 2.9 was truncated to EOS; the others overflowed
    with pytest.raises(ConstraintError, match=r'token must be an int in \[0, 4096\)'):
      c.advance(token)
  c.advance(tok.encode('{')[0])
  for n in (-1, 2):                           # -1 grew the EOS count; 2 broke the matcher
    with pytest.raises(ConstraintError, match=f'cannot roll back {n} tokens: 1 consumed'):
      c.rollback(n)
  c.rollback(1)
  np.testing.assert_array_equal(c.allowed(), _constraint(SCHEMAS[2]).allowed())
  prompt = tok.encode('{')
  c = _constraint({'enum': ['GET', 'POST']})
  constrained_generate(draft, draft_params, prompt, c, max_new_tokens=8, stop_token=tok.eos_id)
  with pytest.raises(ValueError, match='the constraint has already consumed'):   # gave [eos]
    constrained_generate(draft, draft_params, prompt, c, max_new_tokens=8, stop_token=tok.eos_id)
  # A stop_token that could never match used to be accepted and never stop an unconstrained run.
  for stop, match in (('7', "stop token ids must be ints, got '7'"),
                      ([7], r'stop_token must be one token id \(or None\), got \[7\]'),
                      (tok.eos_ids, 'stop_token must be one token id'),
                      (99999, r'stop token id 99999 outside the vocabulary \[0, 4096\)'),
                      (-1, 'stop token id -1 outside')):
    with pytest.raises(ValueError, match=match):
      constrained_generate(draft, draft_params, prompt, None, max_new_tokens=8, stop_token=stop)
  context = draft.max_seq_len           # a prompt that leaves no room is a ContextOverflowError
  with pytest.raises(ContextOverflowError, match=rf'prompt of 1 token \+ max_new_tokens='
                                                 rf'{context} \+ 1 token of decoding slack = '
                                                 rf'{context + 2} exceeds the context'):
    constrained_generate(draft, draft_params, prompt, None, max_new_tokens=context,
                         stop_token=tok.eos_id)
  with pytest.raises(ValueError, match=r'speculation length K must be an int in \[1, 16\], '
                                       r'got 17'):
    constrained_generate(target, target_params, prompt, _constraint(SCHEMAS[2]),
                         max_new_tokens=8, stop_token=tok.eos_id, draft=draft,
                         draft_params=draft_params, k=17)
  with pytest.raises(ConstraintError, match='regex parse error: .*error: '):   # the reason kept
    _constraint({'type': 'string', 'maxLength': 10 ** 12})
  deep = {}
  node = deep
  for _ in range(2000):                       # RecursionError / TypeError from json.dumps before
    node['items'] = {}
    node = node['items']
  for schema, match in ((deep, 'RecursionError'), ({'enum': {1, 2}}, 'set is not JSON')):
    with pytest.raises(ConstraintError, match=f'the schema is not JSON: .*{match}'):
      _constraint(schema)
  with pytest.raises(ConstraintError, match='eos_id an int in .0, vocab_size., got '
                                            'vocab_size=4096, eos_id=99999'):
    TokenConstraint.json_schema({'type': 'string'}, TOKENIZER, vocab_size=4096, eos_id=99999)
  # An ordinary token as the end: it would be text and the end at once ('"' ends and opens a
  # JSON string), so a finished run's text could be invalid.
  quote = Tokenizer.load(TOKENIZER).encode('"')[0]
  with pytest.raises(ConstraintError, match=f'eos_id={quote} is not a special token of .* '
                                            r'\(its special ids: \[0, 1, 2\]\)'):
    TokenConstraint.json_schema({'type': 'string'}, TOKENIZER, vocab_size=4096, eos_id=quote)
  with pytest.raises(ConstraintError, match='eos_id=4000 is not a special token'):
    TokenConstraint.regex('a+', TOKENIZER, vocab_size=4096, eos_id=4000)


def test_an_eos_marked_special_by_tokenizer_config_is_accepted(tmp_path):
  # transformers also reads special tokens from tokenizer_config.json (added_tokens_decoder,
  # eos_token), as Tokenizer.load does: such an eos ends the text and is never text.
  from jaxspec.decoding import constraint  # pylint: disable=import-outside-toplevel
  fixture = pathlib.Path(__file__).parent / 'fixtures/hf/llama/tokenizer.json'
  data = json.loads(fixture.read_text())
  for token in data['added_tokens']:
    if token['id'] == 297:
      token['special'] = False
      text = token['content']
  (tmp_path / 'tokenizer.json').write_text(json.dumps(data))
  with pytest.raises(ConstraintError, match='eos_id=297 is not a special token'):
    TokenConstraint.json_schema({'type': 'string'}, tmp_path / 'tokenizer.json', vocab_size=300,
                                eos_id=297)
  for config in ({'eos_token': text},
                 {'added_tokens_decoder': {'297': {'content': text, 'special': True}}}):
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
    constraint._special_ids.cache_clear()    # (cached per path) read the new config
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / 'tokenizer.json'))
    c = TokenConstraint.json_schema({'type': 'string'}, tmp_path / 'tokenizer.json',
                                    vocab_size=300, eos_id=297)
    for t in tok.encode('"ab"', add_special_tokens=False).ids:
      assert c.allowed()[t] and not c.allowed()[297]
      c.advance(t)
    assert c.allowed()[297]


# Constrained speculative sampling on V = 8 (same test as test_rejection_sampling, with masks).
N = 200_000
V = 8
P_LOGITS = jnp.log(jnp.array([[0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02],
                              [0.02, 0.04, 0.06, 0.08, 0.10, 0.15, 0.25, 0.30],
                              [0.05, 0.30, 0.05, 0.20, 0.05, 0.20, 0.05, 0.10]]))
Q_LOGITS = jnp.log(jnp.array([[0.01, 0.02, 0.05, 0.10, 0.30, 0.40, 0.12, 1e-30],
                              [0.30, 0.20, 0.20, 0.10, 0.10, 0.05, 0.05, 1e-30]]))
MASK_1 = np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)
# The mask at position 2 depends on x_1 (as a grammar state does): row a = allowed after token a.
MASK_2 = np.random.default_rng(0).random((V, V)) < 0.6
MASK_2[np.arange(V), (np.arange(V) + 1) % V] = True          # never empty
MASK_3 = np.ones(V, bool)


def _constrained_rounds(sampling, mask_target=True):
  """First and second emitted tokens of N rounds (K = 2) with masks on q and (optionally) p."""
  rng_1, rng_2, rng_accept = jax.random.split(jax.random.PRNGKey(0), 3)
  q1 = probabilities(jnp.broadcast_to(Q_LOGITS[0], (N, V)), sampling, MASK_1)
  x1 = sample(rng_1, q1)
  m2 = jnp.asarray(MASK_2)[x1]                                               # [N, V]
  q2 = probabilities(jnp.broadcast_to(Q_LOGITS[1], (N, V)), sampling, m2)
  x2 = sample(rng_2, q2)
  masks = jnp.stack([jnp.broadcast_to(MASK_1, (N, V)), m2,
                     jnp.asarray(MASK_2)[x2] | MASK_3], axis=1)              # [N, 3, V]
  p = probabilities(jnp.broadcast_to(P_LOGITS, (N, 3, V)), sampling,
                    masks if mask_target else None)
  drafts = jnp.stack([x1, x2], axis=1)
  n, nxt = jax.jit(rejection_sample)(rng_accept, drafts, jnp.stack([q1, q2], axis=1), p)
  window = jnp.where(jnp.arange(3)[None] < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                     nxt[:, None])
  return np.asarray(window[:, 0]), np.asarray(window[:, 1]), np.asarray(n)


def _target(sampling):
  """The constrained target: p_1 under MASK_1, and p_2 under MASK_2[x_1] for each x_1."""
  p1 = np.asarray(probabilities(P_LOGITS[0], sampling, MASK_1), np.float64)
  p2 = np.asarray(probabilities(jnp.broadcast_to(P_LOGITS[1], (V, V)), sampling,
                                jnp.asarray(MASK_2)), np.float64)
  return p1 / p1.sum(), p2 / p2.sum(axis=1, keepdims=True)


def _pvalues(first, second, n, sampling):
  p1, p2 = _target(sampling)
  counts = np.bincount(first, minlength=V)
  assert counts[p1 == 0].sum() == 0, 'emitted a token the constraint forbids'
  pv1 = stats.chisquare(counts[p1 > 0], p1[p1 > 0] * len(first)).pvalue
  # Rows that accepted x_1 emit a second token, which must follow p_2 under the mask of x_1.
  obs, exp, groups = [], [], 0
  for a in range(V):
    rows = (n >= 1) & (first == a)
    if rows.sum() == 0:
      continue
    c = np.bincount(second[rows], minlength=V)
    assert c[p2[a] == 0].sum() == 0, 'emitted a token the constraint forbids'
    obs += list(c[p2[a] > 0])
    exp += list(p2[a][p2[a] > 0] * rows.sum())
    groups += 1
  pv2 = stats.chisquare(obs, exp, ddof=groups - 1).pvalue
  return pv1, pv2


@pytest.mark.parametrize('sampling', [SamplingParams(1.0), SamplingParams(0.8, top_k=4)])
def test_constrained_speculative_samples_follow_the_constrained_target(sampling):
  first, second, n = _constrained_rounds(sampling)
  assert 0.05 < n.mean() < 1.95                   # both accept and reject paths taken
  pv1, pv2 = _pvalues(first, second, n, sampling)
  assert pv1 > 1e-3 and pv2 > 1e-3


def test_masking_only_the_draft_fails_the_test():
  first, second, n = _constrained_rounds(SamplingParams(1.0), mask_target=False)
  with pytest.raises(AssertionError, match='forbids'):
    _pvalues(first, second, n, SamplingParams(1.0))


def test_the_device_steps_compile_once_per_shape(models_):
  from jaxspec.decoding import constrained  # pylint: disable=import-outside-toplevel
  _, _, draft, draft_params, tok = models_
  run = lambda text, seed: constrained_generate(
      draft, draft_params, tok.encode(text), _constraint(SCHEMAS[2]), max_new_tokens=40,
      stop_token=tok.eos_id, sampling=SamplingParams(1.0), seed=seed)
  run('{"a":', 0)
  sizes = (constrained._step._cache_size(), constrained._prefill_chunk._cache_size())
  run('{\n  "tags":', 1)                       # another prompt and output length, same shapes
  assert (constrained._step._cache_size(), constrained._prefill_chunk._cache_size()) == sizes


def test_a_draft_whose_logits_turn_nan_is_served_the_targets_tokens(models_):
  """From the step that reads one token on, the draft's logits are NaN (its embedding is): the
  rounds verify the proposals before it (none once that token is in the draft's cache), so the
  greedy output is the target's, where the draft used to raise NonFiniteLogitsError."""
  target, target_params, draft, draft_params, tok = models_
  prompt = tok.encode('{\n  "operations":{\n    "GetQuery":')
  alone = constrained_generate(target, target_params, prompt, _constraint(SCHEMAS[0]),
                               max_new_tokens=48, stop_token=tok.eos_id)
  bad = alone.tokens[6]
  embed = draft_params['params']['embed']['embedding']
  broken = {'params': {**draft_params['params'],
                       'embed': {'embedding': embed.at[bad].set(jnp.nan)}}}
  out = constrained_generate(target, target_params, prompt, _constraint(SCHEMAS[0]),
                             max_new_tokens=48, stop_token=tok.eos_id, draft=draft,
                             draft_params=broken, k=3)
  assert out.tokens == alone.tokens
  assert 0 < out.accepted and out.target_calls > len(alone.tokens) - 6
  assert 0 < out.draft_failed <= out.target_calls        # counted, and refused for measurement
  with pytest.raises(NonFiniteLogitsError, match=rf"in {out.draft_failed} of {out.target_calls} "
                                                 r'rounds'):
    out.check_draft()
  assert alone.draft_failed == 0 and alone.check_draft() is alone
