"""The hydration pipeline: schemas, state store and JSON Patch replay, fallbacks, rendering, and the
big model's context session (prefix reuse gives the same logits as a full prefill)."""

import copy
import json
import types

import jsonschema
import numpy as np
import pytest

from jaxspec.data import Tokenizer
from jaxspec.data.tool_calls import ToolEpisode, operation_texts, tool_episodes
from jaxspec.decoding import ContextOverflowError
from jaxspec.hydration import (INITIAL_STATE, RECORD_SCHEMA, STATE_SCHEMA, ContextSession,
                               Extraction, ModelExtractor, OracleExtractor, StateError,
                               StateStore, hydrate, record_schema, truth_record,
                               with_record)
from jaxspec.models import load_model, shipped


@pytest.fixture(scope='module')
def tok():
  return Tokenizer.load(shipped('tokenizer.json'))


@pytest.fixture(scope='module')
def episode(tok):
  return tool_episodes(tok, 1, 6, max_result_tokens=400)[0]


def test_tool_results_are_the_files_records(episode):
  from jaxspec.data import corpus  # pylint: disable=import-outside-toplevel
  doc = next(d for d in corpus.documents('json', 'test') if d.name == episode.name)
  ops = json.loads(doc.text)['operations']
  for call in episode.turns:
    assert call.value == ops[call.argument] and call.result in doc.text.replace('\n    ', '\n')
  for text in ('{"shapes": {}}', '[1, 2]'):            # a list was an AttributeError
    with pytest.raises(ValueError, match='operations'):
      operation_texts(text)


def test_tool_episodes_checks_max_result_tokens(tok):
  for bad in ('512', None, 0):
    with pytest.raises(ValueError, match=f'max_result_tokens must be an int >= 1, got {bad!r}'):
      tool_episodes(tok, 1, 2, max_result_tokens=bad)


def test_true_records_validate_against_their_schemas(episode):
  for call in episode.turns:
    record = truth_record(call.value)
    jsonschema.validate(record, record_schema(call.value))
    jsonschema.validate(record, RECORD_SCHEMA)
    wrong = copy.deepcopy(record)
    wrong['name'] = 'NotInTheResult'
    with pytest.raises(jsonschema.ValidationError):
      jsonschema.validate(wrong, record_schema(call.value))


def test_a_true_record_with_a_long_string_satisfies_its_schema():
  uri = '/' + 'segment/' * 40 + '{Id}'                    # 330 characters: past the enum cap
  result = {'name': 'GetThing', 'http': {'method': 'HEAD', 'requestUri': uri},
            'input': {'shape': 'GetThingInput'}, 'documentation': 'x' * 300}
  jsonschema.validate(truth_record(result), record_schema(result))
  assert 'x' * 300 not in record_schema(result)['properties']['name']['enum']
  with pytest.raises(ValueError, match=r"http.method 'OPTIONS' is not one of \('GET'"):
    truth_record({'name': 'GetThing', 'http': {'method': 'OPTIONS', 'requestUri': '/'}})


class _Flaky:
  """Oracle records, except: turn 2 fails, turn 4 gets a wrong method (valid, but not true)."""

  def __init__(self):
    self.n = 0

  def __call__(self, call):
    self.n += 1
    record = truth_record(call.value)
    if self.n == 2:
      return Extraction(None, 3, 0.0)
    if self.n == 4:
      record['http']['method'] = 'DELETE' if record['http']['method'] != 'DELETE' else 'GET'
    return Extraction(record, 1, 0.0)


def test_replaying_the_patches_reproduces_the_last_state(episode):
  for extractor in (OracleExtractor(), _Flaky()):
    turns, store = hydrate(episode, extractor)
    assert store.replay() == turns[-1].state == store.state
    assert len(store.patches) == sum(not t.fallback for t in turns)


def test_oracle_pipeline_is_faithful_and_a_failed_extraction_falls_back(episode, tok):
  turns, _ = hydrate(episode, OracleExtractor())
  assert all(t.fidelity and t.record_correct and not t.fallback for t in turns)
  turns, _ = hydrate(episode, _Flaky())
  assert [t.fallback for t in turns] == [False, True, False, False, False, False]
  assert [t.fidelity for t in turns] == [True] + [False] * 5
  raw = episode.turns[1].result
  # The failed turn's raw result is in the big model's context from that turn on, not dropped.
  assert raw not in turns[0].hydrated_prompt
  assert all(raw in t.hydrated_prompt for t in turns[1:])
  assert episode.turns[2].argument in turns[2].state['operations']
  # Hydrated contexts are shorter than stuffed ones by the last turn.
  assert len(tok.encode(turns[-1].hydrated_prompt)) < len(tok.encode(turns[-1].stuffing_prompt))


def test_state_store_validates_and_records_rfc6902_patches(episode):
  store = StateStore(STATE_SCHEMA, INITIAL_STATE)
  record = truth_record(episode.turns[0].value)
  patch = store.update(with_record(store.state, record))
  assert {'op': 'add', 'path': f'/operations/{record["name"]}',
          'value': {k: v for k, v in record.items() if k != 'name'}} in patch
  before = copy.deepcopy(store.state)
  bad = copy.deepcopy(store.state)
  bad['operations'][record['name']]['http']['method'] = 'FETCH'
  with pytest.raises(StateError, match='method'):
    store.update(bad)
  assert store.state == before and len(store.patches) == 1
  with pytest.raises(StateError):
    StateStore(STATE_SCHEMA, {'operations': []})


def test_state_store_history_survives_edits_in_place_and_states_must_be_json(episode):
  store = StateStore(STATE_SCHEMA, INITIAL_STATE)
  state = copy.deepcopy(INITIAL_STATE)          # one working dict, edited in place every turn
  record = truth_record(episode.turns[0].value)
  state['operations'][record['name']] = {k: v for k, v in record.items() if k != 'name'}
  state['last_operation'] = record['name']
  first = copy.deepcopy(store.update(state))
  state['operations'][record['name']]['errors'] = [{'shape': 'NotFound'}]
  store.update(state)
  assert store.patches[0] == first and store.replay() == store.state == state
  store.state['operations'][record['name']]['http']['method'] = 'PUT'   # nor through the store
  assert store.patches[0] == first and store.replay() == state
  store.state = copy.deepcopy(state)
  bad = copy.deepcopy(state)
  bad['operations'][None] = bad['operations'].pop(record['name'])
  with pytest.raises(StateError, match=r"at \['operations'\]: key None is not a string"):
    store.update(bad)
  assert store.state == state and len(store.patches) == 2
  # NaN was stored (every later update then replaced the whole state) and bytes failed only when
  # the state was rendered; a bad schema raised jsonschema's own errors.
  for value, why in [(float('nan'), 'nan is not a JSON number'),
                     (b'x', r"b'x' \(bytes\) is not a JSON value"),
                     ({1, 2}, r'\{1, 2\} \(set\) is not a JSON value')]:
    with pytest.raises(StateError, match=rf"at \['last_operation'\]: {why}"):
      store.update(dict(state, last_operation=value))
  assert store.state == state and len(store.patches) == 2
  for schema in ({'type': 'bogus'}, 'x'):
    with pytest.raises(StateError, match='schema is not a valid JSON schema'):
      StateStore(schema, {})


def test_a_malformed_record_from_a_custom_extractor_is_a_fallback(episode):
  true = truth_record(episode.turns[0].value)
  malformed = [{k: v for k, v in true.items() if k != 'name'}, [1], 'record',
               dict(true, http='GET /'), dict(true, name=None)]
  records = iter(malformed + [true])
  turns, store = hydrate(episode, lambda call: Extraction(next(records, None), 1, 0.0))
  assert [t.fallback for t in turns] == [True] * 5 + [False]
  assert all(t.patch == [] and t.fields_correct == 0 for t in turns[:5])
  assert len(store.patches) == 1 and store.replay() == store.state


def test_model_extraction_that_cannot_finish_falls_back_and_is_counted(episode, tok):
  draft, params = load_model(shipped('draft'))
  for kwargs, match in ((dict(retries=1.5), 'retries must be an int >= 0, got 1.5'),
                        (dict(retries=True), 'retries must be an int >= 0, got True'),
                        (dict(max_new_tokens=0), 'max_new_tokens must be an int >= 1, got 0'),
                        (dict(seed=2 ** 70), f'seed must be a 64-bit int, got {2 ** 70}'),
                        (dict(constrained='yes'), "constrained must be True or False"),
                        (dict(demos=[1]), 'demos must be ToolCalls, got int 1')):
    with pytest.raises(ValueError, match=match):        # were first-call TypeErrors, or taken
      ModelExtractor(draft, params, tok, shipped('tokenizer.json'), **kwargs)
  extractor = ModelExtractor(draft, params, tok, shipped('tokenizer.json'), max_new_tokens=4,
                             retries=1)
  ex = extractor(episode.turns[0])
  assert ex.record is None and ex.attempts == 2 and ex.new_tokens == 8
  extractor.max_new_tokens = 256
  ex = extractor(episode.turns[0])          # with room, the constrained output always validates
  assert ex.record is not None and ex.attempts == 1
  jsonschema.validate(ex.record, record_schema(episode.turns[0].value))


def test_prefix_reuse_gives_the_logits_of_a_full_prefill(tiny):
  config, params = tiny
  rng = np.random.default_rng(0)
  first = rng.integers(3, config.vocab_size, 70).tolist()
  second = first[:53] + rng.integers(3, config.vocab_size, 20).tolist()
  cached = ContextSession(config, params, max_tokens=128, page_size=8, prefix_cache=True,
                          width_step=4)
  fresh = ContextSession(config, params, max_tokens=128, page_size=8, width_step=4)
  cached.prefill(first)
  fresh.prefill(first)
  trial = cached.prefill(second, commit=False)       # a timing repeat: the cache is unchanged
  a, b = cached.prefill(second), fresh.prefill(second)
  # The full pages of the common prefix of 53 tokens are hit; everything else is computed.
  assert (a.cached_tokens, a.prefill_tokens) == (48, 25) == (trial.cached_tokens,
                                                              trial.prefill_tokens)
  assert (b.cached_tokens, b.prefill_tokens) == (0, 73)
  # A context that is wholly cached still computes its last token (its logits are needed).
  assert cached.prefill(second).prefill_tokens == 73 - 72
  assert a.first_token == b.first_token and a.kv_bytes == b.kv_bytes
  np.testing.assert_allclose(a.logits, b.logits, atol=1e-4, rtol=1e-4)
  with pytest.raises(ValueError, match='exceeds'):
    fresh.prefill([3] * 200)


def test_context_session_refuses_bad_ids_and_gives_pages_back_when_prefill_fails(tiny,
                                                                                monkeypatch):
  config, params = tiny
  with pytest.raises(ValueError, match="prefix_cache must be True or False, got 'yes'"):
    ContextSession(config, params, max_tokens=64, prefix_cache='yes')
  session = ContextSession(config, params, max_tokens=64, page_size=8, width_step=4)
  with pytest.raises(ValueError, match="commit must be True or False, got 'no'"):
    session.prefill([3, 4], commit='no')
  for tokens, match in (([3, 2 ** 40], 'token id 1099511627776 outside the vocabulary'),
                        ([3, 64], r'token id 64 outside the vocabulary \[0, 64\)'),
                        ([3, -1], 'token id -1'), ([3, 3.9], 'flat sequence of int token ids'),
                        ([3, True], 'holds the bool True')):
    with pytest.raises(ValueError, match=match):
      session.prefill(tokens)
  def broken(*args, **kwargs):
    raise RuntimeError('device lost')
  monkeypatch.setattr('jaxspec.hydration.context.prefill_chunked', broken)
  with pytest.raises(RuntimeError, match='device lost'):
    session.prefill(list(range(3, 60)))
  assert session.prefix.num_held == 0           # the pages it took are free again
  monkeypatch.undo()
  assert session.prefill([3 + i % 50 for i in range(64)]).prefill_tokens == 64   # the whole pool
  wide = ContextSession(config, params, max_tokens=40, page_size=48, width_step=16)  # pool: 768
  with pytest.raises(ValueError, match="context of 41 tokens exceeds the session's max_tokens=40"):
    wide.prefill([3] * 41)
  with pytest.raises(ValueError, match=r'max_tokens must be an int in \[1, max_seq_len='):
    ContextSession(config, params, max_tokens=config.max_seq_len + 1)


def test_bad_experiment_config_fails_before_loading_models():
  from configs.hydration import get_config  # pylint: disable=import-outside-toplevel
  from experiments import hydration  # pylint: disable=import-outside-toplevel
  config = get_config()
  config.strategies = 'stuffing,bogus'
  with pytest.raises(ValueError, match='bogus'):
    hydration.run(config, None)
  config = get_config()
  config.extractor = 'big'
  with pytest.raises(ValueError, match='extractor'):
    hydration.run(config, None)
  config = get_config()
  config.extractor, config.constrained = 'oracle', False     # was ignored without a word
  with pytest.raises(ValueError, match='constrained=False has no effect with config.extractor'):
    hydration.run(config, None)
  with pytest.raises(ValueError, match='variant'):
    get_config('nope')


def test_an_extraction_budget_past_the_models_context_names_the_field(tok):
  """config.max_extract_tokens at or past the extracting model's context: refused naming the
  field when the extractor is built (was: an error naming sizes at its first call)."""
  from configs.hydration import get_config  # pylint: disable=import-outside-toplevel
  from experiments import hydration  # pylint: disable=import-outside-toplevel
  config = get_config()
  config.extractor, config.shots = 'draft', 0
  draft = types.SimpleNamespace(max_seq_len=512)
  config.max_extract_tokens = 512
  with pytest.raises(ValueError, match=r"config.max_extract_tokens=512 leaves no room for a tool "
                                       r"result in the draft model's context of 512 tokens"):
    hydration.make_extractor(config, None, None, draft, None, tok)
  config.max_extract_tokens = 500
  extractor = hydration.make_extractor(config, None, None, draft, None, tok)
  assert extractor.max_new_tokens == 500


def test_a_prompt_the_extraction_budget_leaves_no_room_for_names_the_field(episode):
  """Below the context but past what a prompt leaves, the decoder's error (per prompt) is
  named with config.max_extract_tokens (was: 'prompt of 560 + max_new_tokens=600 ...' alone);
  other errors pass through as they are, a ValueError that mentions max_new_tokens= too (the
  test was a match on that text)."""
  from configs.hydration import get_config  # pylint: disable=import-outside-toplevel
  from experiments import hydration  # pylint: disable=import-outside-toplevel
  config = get_config()
  config.max_extract_tokens = 600

  def too_long(turn):
    raise ContextOverflowError('prompt of 560 + max_new_tokens=600 + 1 slack token exceeds the '
                               'context of 1024')
  with pytest.raises(ContextOverflowError, match=r'^config.max_extract_tokens=600 \(tool '
                                                 r'results up to config.max_result_tokens=400\): '
                                                 r'prompt of 560'):
    hydration.extract_all(config, too_long, [episode])
  with pytest.raises(ValueError, match=r'^config.max_extract_tokens=600 .*prompt of 560'):
    hydration.extract_all(config, too_long, [], warm=episode.turns[0])     # the warm-up call

  def broken(turn):
    raise ValueError('something else')
  with pytest.raises(ValueError, match='^something else$'):
    hydration.extract_all(config, broken, [episode])

  def other(turn):
    raise ValueError('max_new_tokens=600 is not what failed')
  with pytest.raises(ValueError, match='^max_new_tokens=600 is not what failed$'):
    hydration.extract_all(config, other, [episode])


@pytest.mark.parametrize('result', [[1], 'name', {'name': 'A', 'http': 'GET /'}, {'name': 'A'}])
def test_truth_record_names_a_result_that_is_not_an_operation(result):
  with pytest.raises(ValueError, match='not an operation record'):
    truth_record(result)


def test_the_true_record_satisfies_its_schema_when_shapes_are_not_strings():
  # record_schema promises the true record always validates; a null shape used to be copied in.
  import jsonschema  # pylint: disable=import-outside-toplevel
  result = {'name': 'Op', 'http': {'method': 'GET', 'requestUri': '/'},
            'input': {'shape': None}, 'output': {'shape': 'Out'},
            'errors': [{'shape': 3}, {'shape': 'Oops'}]}
  record = truth_record(result)
  assert record == {'name': 'Op', 'http': {'method': 'GET', 'requestUri': '/'},
                    'output': {'shape': 'Out'}, 'errors': [{'shape': 'Oops'}]}
  jsonschema.validate(record, record_schema(result))


@pytest.mark.parametrize('old, new', [([0], [False]), ([1], [True]), ([False], [0])])
def test_a_change_between_false_and_0_inside_a_list_is_recorded(old, new):
  # jsonpatch compares list items with ==, so the patch was empty and replay() lost the change.
  store = StateStore({}, {'v': old})
  assert store.update({'v': new})
  assert json.dumps(store.replay()) == json.dumps(store.state) == json.dumps({'v': new})


@pytest.mark.parametrize('old, new', [({'-': 1}, {'-': 2}), ({'k': {'-': 1}}, {'k': {'-': [1]}})])
def test_a_change_under_an_object_key_named_dash_is_recorded(old, new):
  # jsonpatch wrote a replace at '/-' and refused to apply it: update raised InvalidJsonPatch.
  store = StateStore({'type': 'object'}, old)
  assert store.update(new)
  assert store.state == store.replay() == new


def test_the_experiment_finishes_when_every_extraction_falls_back(tmp_path):
  # A hydrated prompt of fallbacks (headers + every raw result) outgrows the stuffed one: the
  # sessions were sized from the stuffed prompts and the run died before its summaries.
  from configs.hydration import get_config  # pylint: disable=import-outside-toplevel
  from experiments import hydration  # pylint: disable=import-outside-toplevel
  from experiments.records import Results  # pylint: disable=import-outside-toplevel
  config = get_config('smoke')
  config.update(dict(max_extract_tokens=1, retries=0, alpha_prompts=0, strategies='hydration'))
  results = Results(tmp_path / 'run', config, verbose=False)
  hydration.run(config, results)
  turns = [r for r in results.records if r['kind'] == 'turn']
  assert turns and all(r['fallback'] for r in turns)
  assert [r['strategy'] for r in results.records if r['kind'] == 'summary'] == ['hydration']


def test_a_failed_extraction_scores_no_field(tok):
  # A call whose record has no input or output: the empty fallback record's missing fields
  # equalled the truth's (None == None), and a fallback scored 1 of 11 fields correct.
  episodes = tool_episodes(tok, 5, 6, max_result_tokens=400)
  call = next(c for e in episodes for c in e.turns
              if {'input', 'output'} - set(truth_record(c.value)))
  turns, _ = hydrate(ToolEpisode('x', (call,)), lambda c: Extraction(None, 3, 0.0))
  assert turns[0].fallback and turns[0].fields_correct == 0 and turns[0].fields_total >= 5
  turns, _ = hydrate(ToolEpisode('x', (call,)),
                     lambda c: Extraction(truth_record(c.value), 3, 0.0))
  assert turns[0].fields_correct == turns[0].fields_total      # absent in both: matched


def test_hydrate_names_bad_arguments(episode):
  with pytest.raises(ValueError, match='episode must be a ToolEpisode, got list'):
    hydrate([1], lambda c: Extraction(None, 1, 0.0))
  with pytest.raises(ValueError, match='extractor must be a function of a ToolCall, got None'):
    hydrate(episode, None)
  with pytest.raises(ValueError, match='turn 1: the extractor returned str, not an Extraction'):
    hydrate(episode, lambda c: 'record')


def test_with_record_names_a_record_or_state_of_the_wrong_shape(episode):
  # Each was a KeyError or AttributeError; a name of 3 made an int key in the state.
  record = truth_record(episode.turns[0].value)
  for bad in ({'http': {}}, None, dict(record, name=3)):
    with pytest.raises(ValueError, match="a record must be a dict with a string 'name'"):
      with_record(INITIAL_STATE, bad)
  with pytest.raises(ValueError, match="a state must be a dict with an 'operations' dict"):
    with_record({}, record)
  assert with_record(INITIAL_STATE, record)['last_operation'] == record['name']
