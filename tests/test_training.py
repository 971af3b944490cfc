"""Training's argument checks, its refusal to return diverged params, and resuming from its
checkpoint."""

import importlib
import json
import math
import shutil

import jax
import numpy as np
import pytest

from jaxspec.models import CheckpointError, ModelConfig
from jaxspec.training import init_params, train

TOKENS = np.random.default_rng(0).integers(3, 64, 4096).astype(np.int32)
SIZES = dict(steps=2, batch_size=2, seq_len=16, learning_rate=1e-3, warmup_steps=1)


@pytest.mark.parametrize('change, match', [
    (dict(learning_rate=math.nan),
     r'learning_rate must be a finite number in \[0.0, inf\), got nan'),
    (dict(learning_rate=math.inf), 'learning_rate must be a finite number'),
    (dict(learning_rate=-1.0), 'learning_rate must be a finite number .* got -1.0'),
    (dict(learning_rate=0.0), 'learning_rate must be > 0'),
    (dict(weight_decay=math.nan), 'weight_decay must be a finite number'),
    (dict(grad_clip=0.0), 'grad_clip must be > 0'),
    (dict(warmup_steps=-1), 'warmup_steps must be an int >= 0, got -1'),
    (dict(warmup_steps=2), 'warmup_steps=2 must be below steps=2: the learning rate would'),
    (dict(eval_batches=0), 'eval_batches must be an int >= 1, got 0'),
    (dict(steps=2.5), 'steps must be an int >= 1, got 2.5'),
    (dict(seed=-1), r'seed must be an int in \[0, 2\*\*63\), got -1'),   # numpy's, unnamed
    (dict(seed=1.5), r'seed must be an int in \[0, 2\*\*63\), got 1.5'),  # a jit tracer error
    (dict(seed=True), 'seed must be an int'),                              # was seed 1
])
def test_bad_hyperparameters_are_named_before_training(change, match):
  config = ModelConfig.from_name('test-tiny')
  with pytest.raises(ValueError, match=match):
    train(config, TOKENS, TOKENS, **{**SIZES, **change}, progress=False)


@pytest.mark.parametrize('which, bad, match', [
    ('train', 99, r'train_tokens\[7\] = 99 is outside the vocabulary \[0, 64\)'),
    ('val', -1, r'val_tokens\[7\] = -1 is outside the vocabulary \[0, 64\)'),
    ('train', 64, r'train_tokens\[7\] = 64 is outside'),
    ('val', None, r'val_tokens must be a 1-D integer array of token ids, got shape \(4096,\) '
                  r'dtype float32')])
def test_token_ids_outside_the_vocabulary_are_named_before_training(which, bad, match):
  # 99 trained every step and then reported divergence; -1 wrapped to the last embedding rows
  # (as input and as target) and trained without a word.
  config = ModelConfig.from_name('test-tiny')
  tokens = TOKENS.astype(np.float32) if bad is None else TOKENS.copy()
  if bad is not None:
    tokens[7] = bad
  train_tokens, val_tokens = (tokens, TOKENS) if which == 'train' else (TOKENS, tokens)
  with pytest.raises(ValueError, match=match):
    train(config, train_tokens, val_tokens, **SIZES, progress=False)


def test_a_stream_shorter_than_one_window_is_named_before_training(monkeypatch):
  # A short val_tokens used to fail in `evaluate`, after every step, without its name.
  monkeypatch.setattr(importlib.import_module('jaxspec.training.train'), 'init_params',
                      lambda *a: pytest.fail('training started'))
  for which in ('train_tokens', 'val_tokens'):
    streams = {'train_tokens': TOKENS, 'val_tokens': TOKENS, which: TOKENS[:10]}
    with pytest.raises(ValueError, match=f'{which} holds 10 ids, shorter than one window of '
                                         r'seq_len \+ 1 = 17'):
      train(ModelConfig.from_name('test-tiny'), streams['train_tokens'], streams['val_tokens'],
            **SIZES, progress=False)


def test_diverged_training_raises_instead_of_returning_nan_params():
  config = ModelConfig.from_name('test-tiny')
  poisoned = jax.tree.map(lambda x: x * np.nan, init_params(config, 0))
  with pytest.raises(FloatingPointError, match='training diverged: final train loss nan'):
    train(config, TOKENS, TOKENS, **SIZES, params=poisoned, progress=False)
  params, info = train(config, TOKENS, TOKENS, **SIZES, progress=False)
  assert math.isfinite(info['train_loss']) and math.isfinite(info['val_loss'])


def test_an_interrupted_run_resumed_from_its_checkpoint_equals_an_uninterrupted_one(
    tmp_path, monkeypatch):
  config = ModelConfig.from_name('test-tiny')
  sizes = dict(SIZES, steps=5)
  straight, info = train(config, TOKENS, TOKENS, **sizes, progress=False)
  train_module = importlib.import_module('jaxspec.training.train')   # the module, not train()
  windows, calls = train_module.random_windows, []

  def interrupted(*args):
    calls.append(1)
    if len(calls) == 4:                    # during step 4, after the state of step 2 was saved
      raise KeyboardInterrupt
    return windows(*args)

  monkeypatch.setattr(train_module, 'random_windows', interrupted)
  with pytest.raises(KeyboardInterrupt):
    train(config, TOKENS, TOKENS, **sizes, progress=False, checkpoint_dir=tmp_path / 'ckpt',
          checkpoint_every=2)
  monkeypatch.undo()
  resumed, again = train(config, TOKENS, TOKENS, **sizes, progress=False,
                         checkpoint_dir=tmp_path / 'ckpt', checkpoint_every=2)
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)
  assert again['train_loss'] == info['train_loss'] and again['val_loss'] == info['val_loss']
  assert (info['resumed_at_step'], again['resumed_at_step']) == (0, 2)
  done, _ = train(config, TOKENS, TOKENS, **sizes, progress=False,      # finished: no step runs
                  checkpoint_dir=tmp_path / 'ckpt')
  jax.tree.map(np.testing.assert_array_equal, done, straight)
  with pytest.raises(CheckpointError, match=r'other arguments \(learning_rate: 0.001 -> 0.002\)'):
    train(config, TOKENS, TOKENS, **dict(sizes, learning_rate=2e-3), progress=False,
          checkpoint_dir=tmp_path / 'ckpt')
  # The model's config and the tokens count too (a changed rope_theta was resumed silently).
  import dataclasses  # pylint: disable=import-outside-toplevel
  with pytest.raises(CheckpointError, match=r'other arguments \(model.rope_theta: 10000.0 -> '
                                            r'50.0\)'):
    train(dataclasses.replace(config, rope_theta=50.0), TOKENS, TOKENS, **sizes, progress=False,
          checkpoint_dir=tmp_path / 'ckpt')
  with pytest.raises(CheckpointError, match=r'other arguments \(train_tokens_sha256: '):
    train(config, TOKENS[::-1].copy(), TOKENS, **sizes, progress=False,
          checkpoint_dir=tmp_path / 'ckpt')


def test_a_damaged_training_state_is_refused(tmp_path):
  config = ModelConfig.from_name('test-tiny')
  train(config, TOKENS, TOKENS, **SIZES, progress=False, checkpoint_dir=tmp_path / 'ckpt')
  files = [f for f in (tmp_path / 'ckpt' / 'state').rglob('*')
           if f.is_file() and f.parent.name == 'd']
  data = max(files, key=lambda f: f.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  data.write_bytes(bytes(raw))
  with pytest.raises(CheckpointError, match='does not match its checksum'):
    train(config, TOKENS, TOKENS, **SIZES, progress=False, checkpoint_dir=tmp_path / 'ckpt')


def test_a_truncated_state_metadata_file_is_named_without_event_loop_tracebacks(tmp_path, capfd):
  # orbax failed on it with its array reads in flight, and each of them printed an 'Event loop
  # is closed' traceback around the one error.
  config = ModelConfig.from_name('test-tiny')
  train(config, TOKENS, TOKENS, **SIZES, progress=False, checkpoint_dir=tmp_path / 'ckpt')
  meta = tmp_path / 'ckpt' / 'state' / 'array_metadatas' / 'process_0'
  meta.write_bytes(meta.read_bytes()[:len(meta.read_bytes()) // 2])
  capfd.readouterr()
  with pytest.raises(CheckpointError, match=r'array_metadatas/process_0 is damaged \(not JSON'):
    train(config, TOKENS, TOKENS, **SIZES, progress=False, checkpoint_dir=tmp_path / 'ckpt')
  assert 'Event loop' not in capfd.readouterr().err


@pytest.mark.parametrize('tokenizer', ['', 'tests/fixtures/hf/llama/tokenizer.json',
                                       'config_only'])
def test_a_trained_model_directory_carries_its_tokenizer(tmp_path, tokenizer):
  # Pairing checks (experiments.common.load_tokenizer) compare a model's own tokenizer.json with
  # the one in use, so the train experiment writes it beside the weights, with a Hugging Face
  # tokenizer's special ids (they live in the files beside its tokenizer.json).
  import pathlib  # pylint: disable=import-outside-toplevel
  from configs.train import get_config  # pylint: disable=import-outside-toplevel
  from experiments import train as train_experiment  # pylint: disable=import-outside-toplevel
  from experiments.common import load_tokenizer  # pylint: disable=import-outside-toplevel
  from experiments.records import Results  # pylint: disable=import-outside-toplevel
  from jaxspec.data import Tokenizer  # pylint: disable=import-outside-toplevel
  from jaxspec.models import shipped  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(__file__).resolve().parent.parent
  config = get_config('smoke')
  config.out = str(tmp_path / 'model')
  config.tokenizer = str(root / tokenizer) if tokenizer else ''
  if tokenizer == 'config_only':   # special ids only in a config.json (the model's is ours)
    (tmp_path / 'tok').mkdir()
    shutil.copyfile(root / 'tests/fixtures/hf/llama/tokenizer.json',
                    tmp_path / 'tok/tokenizer.json')
    (tmp_path / 'tok/config.json').write_text(json.dumps(json.loads(
        (root / 'tests/fixtures/hf/llama/generation_config.json').read_text())))
    config.tokenizer = str(tmp_path / 'tok')       # used to fail after saving: run lost
  train_experiment.run(config, Results(tmp_path / 'run', config, verbose=False))
  own, used = Tokenizer.load(tmp_path / 'model'), Tokenizer.load(config.tokenizer or
                                                                  shipped('tokenizer.json'))
  assert own.vocabulary_difference(used) is None
  assert (own.pad_id, own.bos_id, own.eos_ids) == (used.pad_id, used.bos_id, used.eos_ids)
  assert load_tokenizer('', config.out).vocab_size == used.vocab_size


@pytest.mark.parametrize('cut', ['orbax', 'first_rename', 'second_rename'])
def test_a_save_cut_short_anywhere_leaves_a_whole_state(tmp_path, monkeypatch, cut):
  # save(force=True) deleted the old state before writing the new one: a kill in between lost
  # the run. Now the old state survives until the new one is whole, under one of two names.
  import pathlib  # pylint: disable=import-outside-toplevel
  from jaxspec.training import resume  # pylint: disable=import-outside-toplevel
  params = {'w': np.arange(6, dtype=np.float32)}
  opt = {'m': np.zeros(6, np.float32)}
  state = resume.TrainState(tmp_path / 'ckpt', {'lr': 1.0})
  state.save(params, opt, step=1, loss=2.0)
  renames = []
  rename = pathlib.Path.rename

  def killed_rename(self, target):
    renames.append(self.name)
    if (cut, len(renames)) in (('first_rename', 1), ('second_rename', 2)):
      raise KeyboardInterrupt
    return rename(self, target)

  def killed_save(*args, **kwargs):
    raise KeyboardInterrupt

  if cut == 'orbax':
    monkeypatch.setattr(resume.ocp.StandardCheckpointer, 'save', killed_save)
  else:
    monkeypatch.setattr(pathlib.Path, 'rename', killed_rename)
  with pytest.raises(KeyboardInterrupt):
    state.save({'w': params['w'] + 1}, opt, step=2, loss=1.0)
  monkeypatch.undo()
  got = resume.TrainState(tmp_path / 'ckpt', {'lr': 1.0}).restore(params, opt)
  assert got[2] == 1 and got[3] == 2.0
  np.testing.assert_array_equal(got[0]['w'], params['w'])
  state.save({'w': params['w'] + 1}, opt, step=2, loss=1.0)      # and saving goes on
  assert resume.TrainState(tmp_path / 'ckpt', {'lr': 1.0}).restore(params, opt)[2] == 2
  assert sorted(p.name for p in (tmp_path / 'ckpt').iterdir()) == ['args.json', 'state']


@pytest.mark.parametrize('text', ['[]', '"lr"', 'not json'])
def test_an_args_file_that_is_not_an_object_is_a_checkpoint_error(tmp_path, text):
  # '[]' raised AttributeError ('list' object has no attribute 'get') from restore.
  from jaxspec.training import resume  # pylint: disable=import-outside-toplevel
  params, opt = {'w': np.arange(6, dtype=np.float32)}, {'m': np.zeros(6, np.float32)}
  resume.TrainState(tmp_path / 'ckpt', {'lr': 1.0}).save(params, opt, step=1, loss=2.0)
  (tmp_path / 'ckpt' / 'args.json').write_text(text)
  with pytest.raises(CheckpointError, match=r'args.json (is not a JSON object|is missing or)'):
    resume.TrainState(tmp_path / 'ckpt', {'lr': 1.0}).restore(params, opt)
