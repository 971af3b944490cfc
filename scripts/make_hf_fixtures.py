"""Builds tests/fixtures/hf/: tiny random Hugging Face checkpoints and their golden outputs.

Needs torch and transformers (the `hf-reference` extra), which the tests never import. Install
them beside the project without disturbing its tokenizers / safetensors versions:

    python -m venv --system-site-packages /work/venvs/hf
    /work/venvs/hf/bin/pip install torch==2.13.0 'transformers>=5'   # or: '.[hf-reference]'
    PYTHONPATH=$PWD /work/venvs/hf/bin/python scripts/make_hf_fixtures.py

For each family it writes tests/fixtures/hf/<name>/ in the standard layout (config.json,
model.safetensors or shards + index, tokenizer.json) and golden.npz, computed by transformers in
float32 on the CPU with eager attention:

  prompts      [P, S] int32, each prompt right-padded with -1 (lengths in prompt_lengths [P])
  greedy       [P, N] int32: N greedy tokens, each from a full forward pass over the text so far
  margins      [P, N] float32: top-1 minus top-2 logit of each greedy step (all >= MIN_MARGIN,
               so float rounding cannot flip a greedy choice)
  logits       [P, S + N - 1, V] float32: logits of prompt + greedy continuation (NaN past each
               row's end)

Families: llama (Llama 3 'llama3' rope scaling, 3 shards + index), llama-draft (a one-layer
Llama cut from it with noise, bfloat16 storage: the draft of the speculative test), mistral
(sliding window 8, head_dim 16 != hidden/heads), qwen2 (q/k/v biases, tied embeddings,
embedding padded past the tokenizer, bfloat16 storage).

Finally it checks that transformers reads what jaxspec's `save_pretrained` writes (same logits).
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import shutil
import sys

if __name__ == '__main__':   # --help before the optional imports; no flags
  argparse.ArgumentParser(description=__doc__.split('\n\n')[0]).parse_args()

import numpy as np
import tokenizers
try:
  import torch
  import transformers
except ImportError as _error:
  sys.exit(f'FATAL: {_error}: this script needs torch and transformers (the hf-reference extra: '
           f"pip install -e '.[hf-reference]')")
from tokenizers import decoders, models, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).resolve().parent.parent / 'tests' / 'fixtures' / 'hf'
TOKENIZER_VOCAB = 296                       # 256 bytes + 40 merges, then 3 specials appended
SPECIALS = ('<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>')
NEW_TOKENS = 12
MIN_MARGIN = 1e-3
TEXTS = ('def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)',
         '{\n  "version": "2.0",\n  "metadata": {"apiVersion": "2015-03-31"}')
COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
              max_position_embeddings=256, initializer_range=0.25, hidden_act='silu')
LLAMA3 = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
          'original_max_position_embeddings': 64}


def make_tokenizer() -> tokenizers.Tokenizer:
  """Byte-level BPE trained on a few stdlib sources; specials appended at ids 296..298, as
  Llama 3 appends its own after the merges."""
  from jaxspec.data import documents
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([d.text for d in documents('code', 'train')[:20]], trainer=trainer)
  tok.add_special_tokens(list(SPECIALS))
  return tok


def randomize(model: torch.nn.Module, seed: int) -> None:
  """Norm scales around 1 and biases nonzero, so a swapped or dropped tensor changes logits."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
      elif name.endswith('bias'):
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def golden(model, prompts) -> dict:
  """Greedy continuations by repeated full forward passes, and the logits of the whole text."""
  model = model.eval()
  width = max(map(len, prompts))
  out = {'prompts': np.full((len(prompts), width), -1, np.int32),
         'prompt_lengths': np.array([len(p) for p in prompts], np.int32),
         'greedy': np.zeros((len(prompts), NEW_TOKENS), np.int32),
         'margins': np.zeros((len(prompts), NEW_TOKENS), np.float32),
         'logits': np.full((len(prompts), width + NEW_TOKENS - 1, model.config.vocab_size),
                           np.nan, np.float32)}
  with torch.no_grad():
    for i, prompt in enumerate(prompts):
      out['prompts'][i, :len(prompt)] = prompt
      ids = list(prompt)
      for j in range(NEW_TOKENS):
        last = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(last, 2).values
        out['margins'][i, j] = float(top[0] - top[1])
        ids.append(int(last.argmax()))
      out['greedy'][i] = ids[len(prompt):]
      logits = model(torch.tensor([ids[:-1]])).logits[0].numpy()
      out['logits'][i, :len(ids) - 1] = logits
  if out['margins'].min() < MIN_MARGIN:
    raise SystemExit(f'{model.config.architectures}: a greedy step has margin '
                     f'{out["margins"].min():.2g} < {MIN_MARGIN}; change the seed')
  return out


def save(name: str, model, tok, prompts, *, storage=torch.float32, shard=None, extra=None):
  path = OUT / name
  shutil.rmtree(path, ignore_errors=True)
  model.config.architectures = [type(model).__name__]
  with torch.no_grad():                      # golden from the weights as stored; buffers (the
    for p in model.parameters():             # rotary frequencies) stay float32
      p.copy_(p.to(storage).float())
  kwargs = {'max_shard_size': shard} if shard else {}
  copy.deepcopy(model).to(storage).save_pretrained(path, **kwargs)
  tok.save(str(path / 'tokenizer.json'))
  for file, fields in (extra or {}).items():
    (path / file).write_text(json.dumps(fields, indent=2) + '\n')
  result = golden(model, prompts)
  np.savez_compressed(path / 'golden.npz', **result,
                      versions=np.array([f'torch {torch.__version__}',
                                         f'transformers {transformers.__version__}']))
  size = sum(f.stat().st_size for f in path.iterdir())
  print(f'{name:12s} {size / 1024:6.1f} KiB  min greedy margin {result["margins"].min():.3f}  '
        f'files {sorted(f.name for f in path.iterdir())}')
  return model


def check_round_trip(name: str) -> None:
  """jaxspec load_pretrained -> save_pretrained -> transformers from_pretrained: same logits."""
  import tempfile
  from jaxspec.data import Tokenizer
  from jaxspec.models import load_pretrained, save_pretrained
  config, params = load_pretrained(OUT / name)
  ref = transformers.AutoModelForCausalLM.from_pretrained(OUT / name, attn_implementation='eager')
  with tempfile.TemporaryDirectory() as tmp:
    save_pretrained(tmp, config, params, Tokenizer.load(OUT / name), dtype='float32',
                    max_shard_bytes=20_000)
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation='eager')
  ids = torch.tensor([list(range(3, 40))])
  with torch.no_grad():
    diff = (ref.float()(ids).logits - ours.float()(ids).logits).abs().max().item()
  print(f'{name:12s} transformers reads save_pretrained output: max |logit diff| {diff:.2g}')
  if diff > 1e-5:
    raise SystemExit(f'{name}: save_pretrained output differs in transformers by {diff}')


def main() -> None:
  torch.manual_seed(0)
  tok = make_tokenizer()
  bos, eos, eot = (tok.token_to_id(s) for s in SPECIALS)
  prompts = [tok.encode(t).ids for t in TEXTS]
  prompts = [prompts[0][:14], [bos] + prompts[1][:21]]
  print('tokenizer vocab', tok.get_vocab_size(), 'prompt lengths', [len(p) for p in prompts])
  specials = dict(bos_token_id=bos, eos_token_id=[eos, eot], pad_token_id=None)

  llama_cfg = transformers.LlamaConfig(vocab_size=300, num_hidden_layers=2, num_key_value_heads=2,
                                       rope_theta=10000.0, rope_scaling=dict(LLAMA3),
                                       tie_word_embeddings=False, **COMMON, **specials)
  torch.manual_seed(1)
  llama = transformers.LlamaForCausalLM(llama_cfg)
  randomize(llama, 1)
  llama = save('llama', llama, tok, prompts, shard='60KB')

  draft_cfg = transformers.LlamaConfig(**{**llama_cfg.to_dict(), 'num_hidden_layers': 1})
  draft = transformers.LlamaForCausalLM(draft_cfg)
  with torch.no_grad():
    state = {k: v for k, v in llama.state_dict().items() if not k.startswith('model.layers.1.')}
    gen = torch.Generator().manual_seed(2)
    draft.load_state_dict({k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen)
                           if v.numel() > 1 else v for k, v in state.items()})
  save('llama-draft', draft, tok, prompts, storage=torch.bfloat16)

  torch.manual_seed(3)
  mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
      vocab_size=300, num_hidden_layers=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=None,
      pad_token_id=None, **COMMON))
  randomize(mistral, 3)
  # No eos id in config.json: the tokenizer's specials come from tokenizer_config.json.
  save('mistral', mistral, tok, prompts, extra={'tokenizer_config.json': {
      'bos_token': SPECIALS[0], 'eos_token': {'content': SPECIALS[1]}}})

  torch.manual_seed(4)
  qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=320, num_hidden_layers=2, num_key_value_heads=2, rope_theta=1000000.0,
      tie_word_embeddings=True, use_sliding_window=False, **COMMON, **specials))
  randomize(qwen, 4)
  save('qwen2', qwen, tok, prompts, storage=torch.bfloat16)

  for name in ('llama', 'mistral', 'qwen2'):
    check_round_trip(name)


if __name__ == '__main__':
  main()
