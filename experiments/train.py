"""Train one model (configs/train.py) and save it as a model directory with its training facts."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

from jaxspec.checks import nearest_existing
from jaxspec.data import Tokenizer, train_mixture
from jaxspec.models import ModelConfig, save_model, shipped
from jaxspec.models.checkpoint import check_model_destination, floating_dtype
from jaxspec.training import check_settings, train


def validate(config) -> None:
  """Check a train config before any data is read (`experiments.common.validate`).

  Raises:
    ValueError: an unknown model or store_dtype, an out or checkpoint_dir that cannot be a
      directory, an out that holds something other than a model (`check_model_destination`),
      max_docs < 0, or an optimisation setting `train` refuses
      (`jaxspec.training.check_settings`).
  """
  # What is checked only at the end (saving) is checked first: a long run is not lost to it.
  floating_dtype(config.store_dtype)
  for field in ('out', 'checkpoint_dir'):
    if config[field]:
      _check_directory(f'config.{field}', pathlib.Path(config[field]))
  if config.out and config.checkpoint_dir:        # the state's files would block the save
    out, state = (pathlib.Path(config[f]).absolute() for f in ('out', 'checkpoint_dir'))
    if state == out or out in state.parents:
      raise ValueError(f'config.checkpoint_dir={config.checkpoint_dir!r} is config.out='
                       f'{config.out!r} or inside it: the model directory would hold the '
                       f'training state; give them separate directories')
  if config.out:
    try:
      check_model_destination(config.out)
    except ValueError as error:
      raise ValueError(f'config.out={config.out!r}: {error}') from None
  if config.max_docs < 0:
    raise ValueError(f'config.max_docs must be >= 0 (0: every document), got {config.max_docs}')
  check_settings(ModelConfig.from_name(config.model), steps=config.steps,
                 batch_size=config.batch_size, seq_len=config.seq_len,
                 learning_rate=config.learning_rate, warmup_steps=config.warmup_steps,
                 weight_decay=config.weight_decay, grad_clip=config.grad_clip, seed=config.seed,
                 eval_batches=config.eval_batches, checkpoint_every=config.checkpoint_every)


def run(config, results) -> None:
  """Train `config.model` on the train split, evaluate on val, save, write one record."""
  validate(config)
  tokenizer = Tokenizer.load(config.tokenizer or shipped('tokenizer.json'))
  max_docs = config.max_docs or None
  train_tokens = train_mixture(tokenizer, 'train', max_docs=max_docs)
  val_tokens = train_mixture(tokenizer, 'val', max_docs=max_docs)
  model = ModelConfig.from_name(config.model, vocab_size=tokenizer.vocab_size)
  params, info = train(model, train_tokens, val_tokens, steps=config.steps,
                       batch_size=config.batch_size, seq_len=config.seq_len,
                       learning_rate=config.learning_rate, warmup_steps=config.warmup_steps,
                       weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                       seed=config.seed, eval_batches=config.eval_batches,
                       checkpoint_dir=config.checkpoint_dir or None,
                       checkpoint_every=config.checkpoint_every)
  out = config.out or results.dir / 'model'
  info = dict(model=config.model, corpus_train_tokens=int(len(train_tokens)), **info)
  save_model(out, model, params, dtype=config.store_dtype, info=info)
  # The model's vocabulary travels with it: experiments pairing it with a draft or target check
  # their tokenizers against this one (experiments.common.load_tokenizer). A Hugging Face
  # tokenizer's special ids live in the files beside it: they travel too.
  out = pathlib.Path(out)
  for source, name in ((tokenizer.source, 'tokenizer.json'),
                       (tokenizer.source.parent / 'generation_config.json', None),
                       (tokenizer.source.parent / 'tokenizer_config.json', None)):
    target = out / (name or source.name)
    if source.is_file() and source.resolve() != target.resolve():   # retrained in place: kept
      shutil.copyfile(source, target)
  ids = lambda t: (t.pad_id, t.bos_id, t.eos_ids)
  try:
    same = ids(Tokenizer.load(out)) == ids(tokenizer)
  except ValueError:                # e.g. the special ids were only in the source's config.json
    same = False
  if not same:
    (out / 'generation_config.json').write_text(json.dumps(dict(
        pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
        eos_token_id=list(tokenizer.eos_ids)), indent=2) + '\n')
  results.write(dict(info, out=str(out)))


def _check_directory(name: str, path: pathlib.Path) -> None:
  """ValueError unless `path` is a directory, or can be made one: the first of it and its parents
  that exists is a writable directory (checked before training, which would be lost)."""
  p = nearest_existing(path)
  if not p.is_dir():
    raise ValueError(f'{name}={str(path)!r}: {str(p)!r} is a file, not a directory')
  if not os.access(p, os.W_OK):
    raise ValueError(f'{name}={str(path)!r}: {str(p)!r} is not writable')
