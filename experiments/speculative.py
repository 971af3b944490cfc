"""Speculative vs autoregressive decoding on held-out prompts, one results line per workload.

Both decoders run on the same prompts in the same process, interleaved batch by batch, after a
compile-only warm-up, so the speedup is a ratio taken under the same machine conditions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.common import draft_label, load_at_dtype, load_tokenizer, parse_workloads
from jaxspec.checks import check_int
from jaxspec.data import make_prompts
from jaxspec.decoding import SamplingParams, generate
from jaxspec.models import shipped, truncate_vocab
from jaxspec.parallel import mesh_of, place_pair


def load_pair(config):
  """(target_config, target_params, draft_config, draft_params, tokenizer) from the config's
  paths, the shipped ones where a path is ''. A path may be one of our model directories or a
  Hugging Face checkpoint directory (config.json + *.safetensors). `config.exact_verify` and
  `config.dtype` (if present) set both models' numerics mode and dtype. With `config.mesh`
  naming more than one device (or several processes), our model directories are read straight
  into their placement on the mesh (`experiments.common.load_at_dtype`).

  The tokenizer is `config.tokenizer` if given, else the target's tokenizer.json when the target
  is a Hugging Face directory, else the shipped one. Draft and target must share one vocabulary:
  a model whose own tokenizer (its directory's tokenizer.json, written by experiments.train and
  Hugging Face; the shipped one for the shipped models) differs from the one in use is an error
  (`experiments.common.load_tokenizer`). When the two embedding matrices are padded to different
  sizes past the tokenizer (Qwen2.5-0.5B vs 7B), the larger is cut to the smaller
  (`jaxspec.models.truncate_vocab`).

  Raises CheckpointError / ValueError when missing, corrupt, or the vocabularies disagree;
  FileNotFoundError naming a missing `config.tokenizer`."""
  target_path = config.target or shipped('target')
  draft_path = config.draft or shipped('draft')
  tokenizer = load_tokenizer(config.tokenizer, target_path, draft_path)   # cheap: checked first
  mesh = mesh_of(config.get('mesh'))    # None: one device; else read straight into the placement
  target_cfg, target_params = load_at_dtype(target_path, config, mesh)
  draft_cfg, draft_params = load_at_dtype(draft_path, config, mesh, replicate=True)
  for name, cfg in (('target', target_cfg), ('draft', draft_cfg)):
    if cfg.vocab_size < tokenizer.vocab_size:
      raise ValueError(f'{name} vocabulary ({cfg.vocab_size}) is smaller than the tokenizer '
                       f'vocabulary ({tokenizer.vocab_size})')
  if target_cfg.vocab_size > draft_cfg.vocab_size:
    target_cfg, target_params = truncate_vocab(target_cfg, target_params, draft_cfg.vocab_size)
  elif draft_cfg.vocab_size > target_cfg.vocab_size:
    draft_cfg, draft_params = truncate_vocab(draft_cfg, draft_params, target_cfg.vocab_size)
  exact = bool(config.get('exact_verify', False))
  target_cfg = dataclasses.replace(target_cfg, exact_verify=exact)
  draft_cfg = dataclasses.replace(draft_cfg, exact_verify=exact)
  return target_cfg, target_params, draft_cfg, draft_params, tokenizer


def validate(config) -> None:
  """Check a speculative config before any model loads (`experiments.common.validate`).

  Raises:
    ValueError: sampling SamplingParams refuses, max_k < 1, K out of [1, max_k], batch_size
      or num_prompts < 1 or batch_size > num_prompts, an unknown workload, mesh.data < 1 or a
      batch it does not divide.
  """
  SamplingParams(temperature=float(config.temperature), top_k=int(config.top_k),
                 top_p=float(config.top_p))
  check_int('max_k', config.max_k, 1)
  if not 1 <= config.k <= config.max_k:
    raise ValueError(f'speculation length K must be an int in [1, {config.max_k}], got '
                     f'{config.k}')
  if config.batch_size < 1 or config.num_prompts < 1:
    raise ValueError(f'batch_size ({config.batch_size}) and num_prompts ({config.num_prompts}) '
                     'must be >= 1')
  if config.batch_size > config.num_prompts:    # the record would claim a batch never run
    raise ValueError(f'config.batch_size={config.batch_size} exceeds config.num_prompts='
                     f'{config.num_prompts}: no batch would be that large')
  parse_workloads(config)
  data = int(config.get('mesh', {}).get('data', 1))
  if data < 1:
    raise ValueError(f'mesh.data must be an int >= 1, got {data}')
  for rows in {config.batch_size, config.num_prompts % config.batch_size} - {0}:
    if rows % data:
      raise ValueError(f'a batch of {rows} prompts (batch_size={config.batch_size}, num_prompts='
                       f'{config.num_prompts}) does not split over mesh.data={data}')


def run(config, results) -> None:
  """Measure every workload of `config` (see configs/speculative.py) and write one record each."""
  validate(config)
  sampling = SamplingParams(temperature=float(config.temperature), top_k=int(config.top_k),
                            top_p=float(config.top_p))
  workloads = parse_workloads(config)
  target, target_params, draft, draft_params, tokenizer = load_pair(config)
  # Sharded target and replicated draft on a mesh, or the default device for a 1 x 1 mesh.
  steps, target_params, draft_params = place_pair(config.get('mesh'), target, target_params,
                                                  draft_params)
  common = dict(max_new_tokens=config.max_new_tokens, sampling=sampling,
                stop_tokens=tokenizer.eos_ids, page_size=config.page_size, steps=steps)
  spec = dict(draft=draft, draft_params=draft_params, k=config.k, max_k=config.max_k)

  for workload in workloads:
    prompts = [p.tokens for p in make_prompts(workload, tokenizer, config.num_prompts,
                                              config.prompt_len, split='test', seed=config.seed)]
    batches = [prompts[i:i + config.batch_size]
               for i in range(0, len(prompts), config.batch_size)]
    # Compile both loops for every batch shape (a short last batch too) before timing anything.
    for batch in {len(b): b for b in batches}.values():
      generate(target, target_params, batch, seed=config.seed, **common)
      generate(target, target_params, batch, seed=config.seed, **common, **spec)
    ar_runs, sp_runs = [], []
    for i, batch in enumerate(batches):
      ar_runs.append(generate(target, target_params, batch, seed=config.seed + i, **common))
      sp_runs.append(generate(target, target_params, batch, seed=config.seed + i, **common,
                              **spec).check_draft(draft_label(config)))
    results.write(summarize(workload, config, ar_runs, sp_runs, sampling))


def ratio(num: float, den: float) -> float:
  """num / den, NaN when den is 0 (e.g. every prompt stopped at its first token)."""
  return num / den if den else float('nan')


def summarize(workload, config, ar_runs, sp_runs, sampling) -> dict:
  """One record from per-batch GenerationResults of both decoders."""
  total = lambda runs, f: sum(getattr(r, f) for r in runs)
  new_tokens = lambda runs: sum(r.num_tokens - len(r.tokens) for r in runs)
  ar_tps = ratio(new_tokens(ar_runs), total(ar_runs, 'decode_s'))
  sp_tps = ratio(new_tokens(sp_runs), total(sp_runs, 'decode_s'))
  proposed = total(sp_runs, 'proposed')
  matches = None
  if sampling.greedy:
    matches = all(a.tokens == s.tokens for a, s in zip(ar_runs, sp_runs))
  return dict(
      workload=workload, k=int(config.k), temperature=sampling.temperature,
      top_k=sampling.top_k, top_p=sampling.top_p, batch_size=int(config.batch_size),
      num_prompts=int(config.num_prompts),
      acceptance_rate=ratio(total(sp_runs, 'accepted'), proposed),
      acceptance_per_position=ratio(total(sp_runs, 'accepted'),
                                    total(sp_runs, 'accepted') + total(sp_runs, 'rejected')),
      mean_accepted_length=ratio(total(sp_runs, 'emitted'), total(sp_runs, 'target_calls')),
      tokens_per_s_autoregressive=ar_tps, tokens_per_s_speculative=sp_tps,
      speedup=ratio(sp_tps, ar_tps),
      ttft_s=float(np.mean([r.ttft_s for r in sp_runs])),
      ttft_s_autoregressive=float(np.mean([r.ttft_s for r in ar_runs])),
      tokens_generated=sum(r.num_tokens for r in sp_runs),
      matches_autoregressive=matches)
