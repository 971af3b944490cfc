"""Tests for jaxspec.data: corpus splits, tokenizer, workloads, batches."""

import json
import pathlib

import numpy as np
import pytest

from jaxspec.data import (WORKLOADS, Tokenizer, code_files, documents, json_files, make_prompts,
                          random_windows, split_of, token_stream, train_mixture)
from jaxspec.data import corpus

SPLITS = ('train', 'val', 'test')


@pytest.fixture(scope='session')
def tok() -> Tokenizer:
  docs = documents('code', 'train')[:25] + documents('json', 'train')[:25]
  return Tokenizer.train((d.text for d in docs), vocab_size=512)


# --- corpus -------------------------------------------------------------------------------------

@pytest.mark.parametrize('kind', corpus.KINDS)
def test_splits_are_disjoint_cover_all_files_and_nonempty(kind):
  names = {s: {d.name for d in documents(kind, s)} for s in SPLITS}
  assert all(names[s] for s in SPLITS), {s: len(v) for s, v in names.items()}
  assert not names['train'] & names['val']
  assert not names['train'] & names['test']
  assert not names['val'] & names['test']
  all_files = code_files() if kind == 'code' else json_files()
  assert sum(len(v) for v in names.values()) == len(all_files)
  assert len(names['train']) > 5 * len(names['test'])


def test_split_of_is_a_fixed_function_of_the_relative_path():
  # Pinned values: SHA-256 based, so identical on every machine and Python version.
  assert split_of('/r/os.py', '/r') == 'val'
  assert split_of('/elsewhere/os.py', '/elsewhere') == 'val'
  assert split_of(pathlib.Path('/r/ast.py'), pathlib.Path('/r')) == 'test'
  assert split_of('/r/json/__init__.py', '/r') == 'train'
  with pytest.raises(ValueError):
    split_of('/a/x.py', '/b')


def test_json_services_never_straddle_splits():
  service_splits = {}
  for s in SPLITS:
    for d in documents('json', s):
      service_splits.setdefault(d.name.split('/')[0], set()).add(s)
  assert all(len(v) == 1 for v in service_splits.values())


def test_files_respect_filters_and_gz_is_decoded():
  code = code_files()
  assert code == sorted(code) and all(p.suffix == '.py' for p in code)
  for p in code:
    assert not {'site-packages', 'test', 'tests', 'idlelib'} & set(p.parts)
  docs = documents('json', 'val')
  gz = [d for d in docs if d.name.endswith('.gz')]
  assert gz and all(d.text.lstrip().startswith('{') for d in gz)
  assert all(200 <= len(d.text.encode()) <= 300_000 for d in docs)


@pytest.mark.parametrize('kind, split', [('yaml', 'train'), ('code', 'dev')])
def test_documents_rejects_unknown_kind_or_split(kind, split):
  with pytest.raises(ValueError, match='yaml' if kind == 'yaml' else 'dev'):
    documents(kind, split)


# --- tokenizer ----------------------------------------------------------------------------------

def test_tokenizer_round_trips_real_code_and_json(tok):
  for kind in corpus.KINDS:
    for d in documents(kind, 'test')[:5]:
      ids = tok.encode(d.text)
      assert tok.decode(ids) == d.text, d.name
      assert min(ids) > tok.eos_id and max(ids) < tok.vocab_size


def test_tokenizer_round_trips_whitespace_unicode_and_special_text(tok):
  text = '\tx = {"a":  [1,\r\n 2]}  \n\n\n    # é 漢字 🙂 \x00<|eos|><|pad|>'
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert not {tok.pad_id, tok.bos_id, tok.eos_id} & set(ids)  # Literal text is not special.
  assert tok.encode(' a') != tok.encode('a')  # No prefix space is added.


def test_tokenizer_special_ids(tok):
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 512
  assert tok.decode([1, 2]) == '<|bos|><|eos|>'


def test_tokenizer_save_load_round_trip(tok, tmp_path):
  path = tmp_path / 'sub' / 'tok.json'
  tok.save(path)
  loaded = Tokenizer.load(path)
  text = documents('code', 'val')[0].text[:2000]
  assert loaded.encode(text) == tok.encode(text)
  assert loaded.vocab_size == tok.vocab_size


def test_tokenizer_load_missing_file_names_path(tmp_path):
  path = tmp_path / 'nope.json'
  with pytest.raises(FileNotFoundError, match='nope.json'):
    Tokenizer.load(path)


@pytest.mark.parametrize('content', ['{"model": ', '{}', 'not json at all'])
def test_tokenizer_load_corrupt_file_names_path(tmp_path, content):
  path = tmp_path / 'corrupt.json'
  path.write_text(content)
  with pytest.raises(ValueError, match='corrupt.json'):
    Tokenizer.load(path)


def test_encode_batch_checks_its_texts_and_a_config_that_is_not_an_object(tok, tmp_path):
  for texts, match in (('abc', 'takes a sequence of str, got a str'),   # was [[a], [b], [c]]
                       ([None], 'str texts, got NoneType at index 0'),
                       (['ok', '\ud800'], 'text 1 cannot be encoded as UTF-8')):
    with pytest.raises(ValueError, match=match):
      tok.encode_batch(texts)
  assert tok.encode_batch(['ab', 'c']) == [tok.encode('ab'), tok.encode('c')]
  fixture = pathlib.Path(__file__).parent / 'fixtures/hf/llama/tokenizer.json'
  (tmp_path / 'tokenizer.json').write_bytes(fixture.read_bytes())
  (tmp_path / 'config.json').write_text('[1, 2]')       # was an AttributeError
  with pytest.raises(ValueError, match='config.json must hold a JSON object, got a list'):
    Tokenizer.load(tmp_path)
  (tmp_path / 'config.json').unlink()
  for eos in ({'foo': 1}, {'content': 5}):             # was "TypeError: 'None' is not ... 'str'"
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': eos}))
    with pytest.raises(ValueError, match=r'tokenizer_config.json: eos_token must be a string or '
                                         r'an object with a string "content", got \{'):
      Tokenizer.load(tmp_path)


def test_tokenizer_train_rejects_tiny_vocab():
  with pytest.raises(ValueError, match='vocab_size must be an int >= 259, got 100'):
    Tokenizer.train(['abc'], vocab_size=100)
  with pytest.raises(ValueError, match='vocab_size must be an int >= 259, got 300.5'):
    Tokenizer.train(['abc'], vocab_size=300.5)        # was a TypeError inside tokenizers
  with pytest.raises(ValueError, match=rf'vocab_size must be <= 16777216 \(2\*\*24\), got '
                                       rf'{2 ** 40}'):
    Tokenizer.train(['abc'], vocab_size=2 ** 40)     # the trainer aborted the process (72 TB)
  with pytest.raises(ValueError, match='train takes an iterable of str texts, got a str'):
    Tokenizer.train('abc', vocab_size=300)            # trained on 'a', 'b', 'c'


def test_tokenizer_save_to_a_directory_names_it(tok, tmp_path):
  with pytest.raises(ValueError, match='a directory .give a file path'):
    tok.save(tmp_path)                                 # was a bare 'Is a directory' Exception
  (tmp_path / 'file').write_text('')
  with pytest.raises(ValueError, match=r'cannot save the tokenizer to .*file/tok.json: .*file is '
                                       'a file'):
    tok.save(tmp_path / 'file' / 'tok.json')           # was FileExistsError


# --- workloads ----------------------------------------------------------------------------------

@pytest.mark.parametrize('workload', WORKLOADS)
def test_make_prompts_is_deterministic_and_seed_dependent(tok, workload):
  a = make_prompts(workload, tok, num_prompts=4, prompt_len=128, seed=0)
  b = make_prompts(workload, tok, num_prompts=4, prompt_len=128, seed=0)
  c = make_prompts(workload, tok, num_prompts=4, prompt_len=128, seed=1)
  assert a == b
  assert a != c


@pytest.mark.parametrize('workload', ['json', 'code'])
def test_window_prompts_have_exact_length_and_distinct_files(tok, workload):
  prompts = make_prompts(workload, tok, num_prompts=6, prompt_len=200)
  assert all(len(p.tokens) == 200 and p.workload == workload for p in prompts)
  assert all(1 <= len(p.reference) <= 256 for p in prompts)
  assert len({p.name.split('@')[0] for p in prompts}) == 6
  test_names = {f'{workload}:{d.name}' for d in documents(workload, 'test')}
  assert all(p.name.split('@')[0] in test_names for p in prompts)


def test_window_prompt_is_a_real_slice_of_its_file(tok):
  (p,) = make_prompts('code', tok, num_prompts=1, prompt_len=64)
  name, offset = p.name.removeprefix('code:').split('@')
  doc = next(d for d in documents('code', 'test') if d.name == name)
  ids = tok.encode(doc.text)
  start = int(offset)
  assert tuple(ids[start:start + 64]) == p.tokens
  assert tuple(ids[start + 64:start + 64 + len(p.reference)]) == p.reference


@pytest.mark.parametrize('prompt_len', [96, 256, 512])
def test_retrieval_prompt_quotes_a_passage_of_its_document_portion(tok, prompt_len):
  for p in make_prompts('retrieval', tok, num_prompts=5, prompt_len=prompt_len):
    assert len(p.tokens) <= prompt_len
    text = tok.decode(p.tokens)
    sep = text.rindex('\n\n# Quote the passage that starts with: "')
    document, instruction = text[:sep], text[sep:]
    quote = instruction.split('\n')[-1]  # Prompt ends with the passage's first tokens.
    assert quote.strip() and quote.strip() in instruction.split('\n')[2]
    assert document.count(quote) == 1
    # The reference is what follows the quote in the document.
    after = document[document.index(quote) + len(quote):]
    assert after.startswith(tok.decode(p.reference))


def test_make_prompts_rejects_unknown_workload(tok):
  with pytest.raises(ValueError, match='chat'):
    make_prompts('chat', tok, num_prompts=1, prompt_len=64)


# --- batches ------------------------------------------------------------------------------------

def test_token_stream_joins_documents_with_eos(tok):
  docs = documents('json', 'val')[:3]
  stream = token_stream('json', 'val', tok, max_docs=3)
  assert stream.dtype == np.int32 and stream.ndim == 1
  assert stream[-1] == tok.eos_id and int((stream == tok.eos_id).sum()) == 3
  assert tok.decode(stream) == ''.join(d.text + '<|eos|>' for d in docs)


def test_a_tokenizer_without_eos_is_named_by_the_stream_builders(tmp_path):
  fixture = pathlib.Path(__file__).parent / 'fixtures/hf/llama/tokenizer.json'
  (tmp_path / 'tokenizer.json').write_bytes(fixture.read_bytes())
  (tmp_path / 'generation_config.json').write_text('{"bos_token_id": 0}')
  no_eos = Tokenizer.load(tmp_path)
  with pytest.raises(ValueError, match='names no end-of-sequence id'):   # was int(None)
    train_mixture(no_eos, split='val', max_docs=1)


def test_train_mixture_holds_both_kinds(tok):
  stream = train_mixture(tok, split='val', max_docs=4)
  assert int((stream == tok.eos_id).sum()) == 8
  text = tok.decode(stream)
  assert 'def ' in text and '":' in text


@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.bool_])
def test_random_windows_refuses_ids_that_are_not_integers(dtype):
  tokens = (np.arange(64) + 0.7).astype(dtype)
  with pytest.raises(ValueError, match=f'dtype {np.dtype(dtype)}'):
    random_windows(tokens, batch=2, seq_len=8, rng=np.random.default_rng(0))


def test_random_windows_shape_dtype_and_contiguity():
  tokens = np.arange(1000, dtype=np.int32)
  w = random_windows(tokens, batch=16, seq_len=32, rng=np.random.default_rng(0))
  assert w.shape == (16, 33) and w.dtype == np.int32
  np.testing.assert_array_equal(np.diff(w, axis=1), 1)
  assert w.max() < 1000
  w2 = random_windows(tokens, batch=16, seq_len=32, rng=np.random.default_rng(0))
  np.testing.assert_array_equal(w, w2)
  edge = random_windows(tokens[:33], batch=4, seq_len=32, rng=np.random.default_rng(0))
  np.testing.assert_array_equal(edge, np.tile(tokens[:33], (4, 1)))
  with pytest.raises(ValueError, match='32'):
    random_windows(tokens[:32], batch=1, seq_len=32, rng=np.random.default_rng(0))
  for kwargs, match in ((dict(batch=2.5), 'batch must be an int >= 1, got 2.5'),
                        (dict(seq_len=2.5), 'seq_len must be an int >= 1, got 2.5'),
                        (dict(rng=0), 'rng must be a numpy Generator')):
    with pytest.raises(ValueError, match=match):
      random_windows(tokens, **{**dict(batch=1, seq_len=8, rng=np.random.default_rng(0)),
                                **kwargs})


def test_agent_conversations_share_an_exact_prefix_and_use_real_distinct_files(tok):
  from jaxspec.data import make_conversations, turn_prompt
  convs = make_conversations(tok, num_conversations=3, num_turns=4, prefix_tokens=200,
                             tool_tokens=24, seed=1)
  again = make_conversations(tok, num_conversations=3, num_turns=4, prefix_tokens=200,
                             tool_tokens=24, seed=1)
  assert convs == again                                        # deterministic
  assert all(len(c.prefix) == 200 and c.prefix == convs[0].prefix for c in convs)
  sources = [s for c in convs for s in c.sources]
  assert len(set(s.split('@')[0] for s in sources)) == len(sources)  # distinct files
  name, off = sources[0].rsplit('@', 1)
  doc = next(d for d in documents('json', 'test') if d.name == name)
  window = tok.encode(doc.text)[int(off):int(off) + 24]
  result = list(convs[0].tool_results[0])
  assert any(result[i:i + 24] == window for i in range(len(result)))  # a real slice
  replies = [[7, 8], [9]]
  prompt = turn_prompt(convs[0], 2, replies)
  assert prompt == (list(convs[0].prefix) + list(convs[0].tool_results[0]) + [7, 8]
                    + list(convs[0].tool_results[1]) + [9] + list(convs[0].tool_results[2]))
  with pytest.raises(ValueError, match='needs 2 earlier replies'):
    turn_prompt(convs[0], 2, [[7]])
  with pytest.raises(ValueError, match='turn 4 outside'):
    turn_prompt(convs[0], 4, replies * 2)
  with pytest.raises(ValueError, match='prefix_tokens=10'):
    make_conversations(tok, num_conversations=1, num_turns=1, prefix_tokens=10, tool_tokens=8)
  for turn, reps, match in ((1.0, replies, 'turn must be an int >= 0, got 1.0'),
                            (True, replies, 'turn must be an int >= 0, got True'),   # was turn 1
                            (1, ['hello'], r'replies\[0\] must be a list')):  # was spliced
    with pytest.raises(ValueError, match=match):
      turn_prompt(convs[0], turn, reps)


def test_wrapped_tool_results_take_new_windows_when_offsets_collide(tok, monkeypatch):
  from jaxspec.data import agent  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(agent, '_hash', lambda *salt: 0)   # every window at offset 0: all collide
  # Few files hold >= 20000 tokens: 12 results wrap round them.
  convs = agent.make_conversations(tok, num_conversations=4, num_turns=3, prefix_tokens=200,
                                   tool_tokens=20000)
  sources = [s for c in convs for s in c.sources]
  assert len(set(sources)) == len(sources) == 12
  assert len({s.split('@')[0] for s in sources}) < 12            # they did wrap
  # A file with no window left moves the round robin on (it refused the whole split before):
  # two tool files, 'short' with exactly one 40-token window, 'long' with several.
  real = agent.corpus.documents
  text = lambda n: ' '.join(f'w{i}' for i in range(n))
  short = next(n for n in range(10, 200) if len(tok.encode(text(n))) >= 40)
  files = [corpus.Document('json', 'x/service-2.json', real('json', 'test')[0].text * 4),
           corpus.Document('json', 'long.json', text(3 * short)),
           corpus.Document('json', 'short.json', text(short))]
  monkeypatch.setattr(agent.corpus, 'documents',
                      lambda kind, split: files if kind == 'json' else real(kind, split))
  width = len(tok.encode(text(short)))
  convs = agent.make_conversations(tok, num_conversations=4, num_turns=1, prefix_tokens=200,
                                   tool_tokens=width)
  sources = [s for c in convs for s in c.sources]
  assert len(set(sources)) == 4 and sum(s.startswith('short.json@') for s in sources) == 1
  files.pop(1)                      # 'short' alone: one window for two results
  with pytest.raises(ValueError, match=f'has 1 distinct {width}-token windows, fewer than the '
                                       r'2 x 1 tool results'):
    agent.make_conversations(tok, num_conversations=2, num_turns=1, prefix_tokens=200,
                             tool_tokens=width)


def test_a_numpy_seed_draws_what_the_same_python_seed_draws_and_floats_are_refused(tok):
  # The hashed repr of np.int64(0) is 'np.int64(0)' under numpy 2, '0' under numpy 1: numpy
  # seeds drew other prompts (and other ones again across numpy versions).
  from jaxspec.data import make_conversations  # pylint: disable=import-outside-toplevel
  from jaxspec.data.tool_calls import tool_episodes  # pylint: disable=import-outside-toplevel
  assert make_prompts('json', tok, 2, 64, seed=np.int64(3)) == make_prompts('json', tok, 2, 64,
                                                                            seed=3)
  conv = dict(num_conversations=1, num_turns=1, prefix_tokens=256, tool_tokens=32)
  assert (make_conversations(tok, **conv, seed=np.int64(3))[0].prefix ==
          make_conversations(tok, **conv, seed=3)[0].prefix)
  assert tool_episodes(tok, 1, 2, seed=np.int32(3))[0].name == tool_episodes(tok, 1, 2,
                                                                             seed=3)[0].name
  for seed in (3.0, True):
    with pytest.raises(ValueError, match='seed must be a 64-bit int'):
      make_prompts('json', tok, 2, 64, seed=seed)
  with pytest.raises(ValueError, match='prompt_len must be an int >= 1 for .json., got 8.5'):
    make_prompts('json', tok, 2, 8.5)


def test_decode_refuses_ids_outside_the_vocabulary(tok):
  assert tok.decode(np.array([100, 200])) == tok.decode([100, 200])
  for ids, match in (([tok.vocab_size], 'outside the vocabulary'), ([-1], 'token id -1'),
                     ([1.7], 'got 1.7 at position 0'),        # was '', OverflowError, '<|bos|>'
                     (5, 'ids must be a sequence of int token ids, got 5'),   # was a TypeError
                     (np.array(5), 'ids must be a sequence of int token ids')):
    with pytest.raises(ValueError, match=match):
      tok.decode(ids)


@pytest.mark.parametrize('max_docs', [0, -1, 1.5])
def test_max_docs_must_be_a_positive_int(tok, max_docs):
  # -1 silently kept all but the last document, 0 none.
  from jaxspec.data import token_stream, train_mixture  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=f'max_docs must be an int >= 1, got {max_docs}'):
    token_stream('json', 'val', tok, max_docs=max_docs)
  with pytest.raises(ValueError, match=f'max_docs must be an int >= 1, got {max_docs}'):
    train_mixture(tok, 'val', max_docs=max_docs)


def test_encode_names_text_it_cannot_take(tok):
  with pytest.raises(ValueError, match='surrogates not allowed'):    # was tokenizers' TypeError
    tok.encode('ab\ud800c')
  with pytest.raises(ValueError, match='encode takes a str, got bytes'):
    tok.encode(b'abc')
