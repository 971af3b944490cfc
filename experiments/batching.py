"""Speculative decoding against plain continuous batching, at one batch size B per run.

One run = one B (engine slots) and one set of workloads. Inside the run, one `Engine` per
setting (K = 0 is plain continuous batching; K >= 1 speculates with the draft model; adaptive
policies and other drafters are more settings), all built from the same target/draft pair and
compiled by `warm_up` before anything is timed. For each repeat and workload, N =
max(requests_per_slot x B, min_requests) held-out prompts (`make_prompts`, drawn anew for every
repeat unless new_prompts is False: `prompt_seed`) are submitted at once to every setting. With
interleave='steps' (default) the engines then step in turn, one step each, in an
order shuffled every round (`measure`; seeded per (repeat, workload)), so every setting's steps are
timed milliseconds apart and every ratio against K = 0 is taken under the same machine conditions;
interleave='runs' runs the settings one after another instead (whole runs, in an order that rotates
by one per (repeat, workload)).

One record per (workload, setting, repeat); "engine seconds" = the sum of that engine's own
`step()` wall times (all requests arrive at 0 on that clock):
  engine_s, tokens_per_s  engine seconds of the run; tokens emitted / engine_s (prefill, decode,
                      host-side scheduling: everything `step()` does)
  ttft_s, tpot_s      mean over the requests of first-token time, and of (last − first token
                      time) / (tokens − 1), on the engine clock (seconds)
  acceptance_rate     alpha = accepted / proposed draft tokens over all requests (None at K = 0)
  mean_accepted_length  tau = tokens emitted per request per decode round (1 at K = 0)
  round_s             median seconds of one decode-only engine step (a step that ran no prefill
                      chunk): one decode round, host work included (mostly of all B slots: a
                      round with few busy requests runs in a smaller `decode_buckets` bucket)
  decode_tokens_per_s tokens emitted in decode-only steps / their seconds
  decode_steps, prefill_steps  steps without / with a prefill chunk (a prefill call computes
                      its row bucket x `chunk_size` tokens: `Engine.prefill_buckets`)
  prompt_seed         the `make_prompts` seed of the pass's prompts (`prompt_seed`)
  speedup, decode_speedup, round_cost  tokens_per_s, decode_tokens_per_s, round_s divided by
                      the baseline setting's (K = 0) in the same repeat and workload
  rounds_by_k         {K: decode rounds run at K} (adaptive policies choose K per round)
  matches_baseline    at temperature 0: every request's tokens equal those the baseline
                      (K = 0) engine emitted for it in the same pass (None for the baseline
                      and when sampling); with config.exact_verify it must be true, without it
                      equality is to floating-point rounding (README, *Exact numerics*)
  idle_round_s, idle_round_cost  one decode round of all B slots on idle rows, timed
                      `cost_rounds` times with the settings interleaved round by round (median
                      seconds; median ratio to the baseline's), the same for every workload of
                      the run; fixed-K settings only
  warmup_step_costs   the engine's `step_costs` {K: seconds} after the run: for adaptive settings
                      the table `warm_up` measured (where `goodput` starts: its own table,
                      `engine.policy.costs`, is that made non-decreasing in K and updated from
                      live rounds); for fixed ones the last idle round of the interleaved
                      benchmark
  calibration, calibration_rounds  for a goodput setting that calibrates: its realized-over-
                      predicted factor on K >= 1 scores after the pass and the K >= 1 rounds
                      counted so far (`jaxspec.engine.calibration`; the engine's, so they carry
                      over from the passes before; a factor of 1.0 on 0 rounds measured
                      nothing); else None
The α-threshold analysis over these records is `experiments.batching_report`.

Settings are data (`experiments.batching_settings`): 'name=key:value,key:value;name2=...', each
key an `Engine` keyword argument, so a new Engine option needs no change here.
"""

from __future__ import annotations

import math
import random
import statistics
import time

from jaxspec.checks import check_seed
from jaxspec.data import make_prompts
from jaxspec.decoding import SamplingParams
from jaxspec.engine import Engine, check_outputs
from experiments.batching_settings import (check_engines, describe, engine_shape, make_engines,
                                          parse_settings, run_span, uses_draft_model)
from experiments.common import check_fields, parse_workloads
from experiments.speculative import load_pair

class StepKinds:
  """Records what each `Engine.step` scheduled, by wrapping its scheduler's public `schedule`
  (the one call a step makes to plan its prefill chunks and its decode round).

  Attributes:
    prefill_rows, decode_rows: requests the latest step prefilled / decoded.
  """

  def __init__(self, engine: Engine):
    self._schedule = engine.scheduler.schedule
    engine.scheduler.schedule = self
    self.prefill_rows = self.decode_rows = 0

  def __call__(self, *args, **kwargs):
    prefills, decodes = self._schedule(*args, **kwargs)
    self.prefill_rows, self.decode_rows = len(prefills), len(decodes)
    return prefills, decodes

  @property
  def decode_only(self) -> bool:
    """Whether the latest step ran a decode round and no prefill chunk."""
    return self.decode_rows > 0 and self.prefill_rows == 0


def _mean(values) -> float | None:
  values = [v for v in values if v is not None and not math.isnan(v)]
  return sum(values) / len(values) if values else None


def measure(engines: dict, prompts, *, max_tokens: int, stop_tokens,
            seed: int = 0) -> dict[str, dict]:
  """Submit every prompt at once to each engine, then step the engines in turn (one step of
  each, round after round, in an order shuffled every round) until all finish, timing every
  step.

  Stepping in turn puts every setting's steps milliseconds apart, so a burst of load from
  other processes slows all settings alike (a ratio of whole runs taken one after another
  moves by 2-3x on a shared machine). Each engine's clock is the sum of its own step seconds:
  tokens/s, TTFT and TPOT are measured on it (all requests arrive at 0), so the other engines'
  steps in between do not count. With one engine this is an ordinary run.

  The order is shuffled every round because a step runs faster after a step that left the
  same data in the CPU's caches: in a fixed cyclic order (rotations keep it) each setting
  always follows the same one, and at B = 4 on the development CPU K = 0 rounds of the goodput
  engine, which followed K = 8's, took 4 % longer than the same call of the K = 0 engine,
  which followed another K = 0 engine's (equal when both followed K = 0 steps). What the
  shuffle cannot even out: once some engines have finished, the rest follow only each other
  (the last one itself), so the settings that need the most rounds (K = 0 and what runs like
  it) take their last steps after steps like their own, a bias against the others' speedups.

  Args:
    engines: {name: (Engine, StepKinds)}, warmed up, no live requests.
    prompts: token-id lists; max_tokens, stop_tokens: per request.
    seed: of the per-round shuffles (the same seed, engine order and rounds per engine give
      the same orders).
  Returns:
    {name: the per-run fields of a record (see the module docstring)}; times in seconds.
  """
  runs = {}
  for name, (engine, _) in engines.items():
    engine.prefix.reset()               # every run prefills its prompts (no cross-run hits)
    ids = [engine.add_request(p, max_tokens=max_tokens, stop_tokens=stop_tokens)
           for p in prompts]
    runs[name] = dict(rounds=dict(engine.k_rounds), clock=0.0, first={}, last={}, decode_s=[],
                      decode_tokens=0, prefill_steps=0, ids=ids)
  live = [n for n, (e, _) in engines.items() if e.has_unfinished()]
  shuffle = random.Random(seed).shuffle
  while live:
    shuffle(live)
    for name in live:
      engine, kinds = engines[name]
      run = runs[name]
      t0 = time.perf_counter()
      emitted = engine.step()
      seconds = time.perf_counter() - t0
      run['clock'] += seconds
      for rid, tokens in emitted:
        if tokens:
          run['first'].setdefault(rid, run['clock'])
          run['last'][rid] = run['clock']
      run['prefill_steps'] += kinds.prefill_rows > 0
      if kinds.decode_only:
        run['decode_s'].append(seconds)
        run['decode_tokens'] += sum(len(t) for _, t in emitted)
    live = [n for n in live if engines[n][0].has_unfinished()]
  return {name: _summary(engines[name][0], runs[name]) for name in engines}


def _summary(engine: Engine, run: dict) -> dict:
  """The record fields of one engine's run (`measure`); pops its outputs from the engine."""
  outs = check_outputs(engine.outputs.pop(i) for i in run['ids'])
  metrics = [o.metrics for o in outs]
  tokens = sum(len(o.tokens) for o in outs)
  proposed = sum(m.proposed for m in metrics)
  rounds = [n for m in metrics for n in m.accepted_lengths]
  before = run['rounds']
  by_k = {str(k): n - before.get(k, 0) for k, n in sorted(engine.k_rounds.items())
          if n > before.get(k, 0)}
  first, last, decode_s = run['first'], run['last'], run['decode_s']
  tpots = [(last[o.request_id] - first[o.request_id]) / (len(o.tokens) - 1)
           for o in outs if len(o.tokens) > 1]
  return dict(
      num_requests=len(outs), tokens=tokens, engine_s=run['clock'],
      tokens_per_s=tokens / run['clock'],
      ttft_s=_mean(first.get(o.request_id) for o in outs), tpot_s=_mean(tpots),
      acceptance_rate=sum(m.accepted for m in metrics) / proposed if proposed else None,
      mean_accepted_length=sum(rounds) / len(rounds) if rounds else None,
      decode_steps=len(decode_s), prefill_steps=run['prefill_steps'],
      round_s=statistics.median(decode_s) if decode_s else None,
      decode_tokens_per_s=run['decode_tokens'] / sum(decode_s) if decode_s else None,
      preemptions=sum(m.preemptions for m in metrics), rounds_by_k=by_k,
      outputs=[list(o.tokens) for o in outs])


def _matches(outputs, baseline, is_baseline: bool, greedy: bool) -> bool | None:
  """Whether a greedy run emitted, request for request, the tokens the baseline (K = 0) run
  emitted; None for the baseline itself, when sampling, or without both outputs."""
  if is_baseline or not greedy or outputs is None or baseline is None:
    return None
  return outputs == baseline


def _calibration(engine: Engine) -> dict:
  """The record fields `calibration` and `calibration_rounds`: the K policy's `calibration.factor`
  and the K >= 1 rounds it rests on, after the pass (both None without one)."""
  calibration = getattr(getattr(engine, 'policy', None), 'calibration', None)
  if calibration is None:
    return dict(calibration=None, calibration_rounds=None)
  return dict(calibration=calibration.factor, calibration_rounds=calibration.rounds)


def _ratio(num, den):
  return num / den if num is not None and den else None


def rotated(names: list, repeat: int) -> list:
  """`names` rotated left by `repeat` (each setting takes every position across repeats)."""
  r = repeat % len(names)
  return names[r:] + names[:r]


def build_engines(config, settings: dict, target, target_params, draft, draft_params) -> dict:
  """{name: (Engine, StepKinds)}, each compiled by `warm_up`. Every engine gets the same
  num_slots, pool, chunk size and max_seq_len (room for the largest K of any setting), so the
  attention work per step is the same and round times compare K alone.

  Raises:
    ValueError: naming the setting whose Engine arguments the engine refuses, or in which a
      request of the run (prompt_len + max_tokens + K + 1 tokens) would not fit its max_seq_len
      or the pool (checked before any engine is warmed up).
  """
  need = run_span(config, settings)
  k_max = max(int(s.get('k', 0)) for s in settings.values())
  drafting = any(uses_draft_model(kwargs) for kwargs in settings.values())
  context = min(m.max_seq_len for m in (target, draft if drafting else None) if m is not None)
  if need > context:
    raise ValueError(f'config.prompt_len={config.prompt_len} + config.max_tokens='
                     f'{config.max_tokens} + K + 1 = {need} tokens (K = {k_max}, the largest of '
                     f'any setting) exceeds the models\' context of {context}: lower prompt_len '
                     f'or max_tokens')
  max_seq_len, pool = engine_shape(config, settings, context)
  engines = make_engines(config, settings, target, target_params, draft, draft_params,
                         sampling=_sampling(config), max_seq_len=max_seq_len, num_pages=pool)
  for engine in engines.values():                  # every setting checked first, then compiled
    engine.warm_up()
  return {name: (engine, StepKinds(engine)) for name, engine in engines.items()}


def _sampling(config) -> SamplingParams:
  return SamplingParams(temperature=float(config.temperature), top_k=int(config.top_k),
                        top_p=float(config.top_p))


def validate(config) -> None:
  """Check a batching config before any model loads (`experiments.common.validate`).

  Raises:
    ValueError: bad settings, workloads, batch_size, requests_per_slot, min_requests,
      max_tokens, repeats, prompt_len (also: too short for retrieval), interleave, cost_rounds,
      a seed whose passes' prompt seeds (`prompt_seed`) are not all 64-bit ints,
      or a temperature, top_k or top_p out of `SamplingParams`' range; a setting the Engine
      refuses, or whose engine could not hold a request of the run (`check_engines`: on a
      stand-in model; the real models' context is checked by `build_engines`).
  """
  settings = parse_settings(config.settings)
  for field in ('temperature', 'top_k', 'top_p'):       # SamplingParams' ranges, named
    try:
      SamplingParams(**{field: config[field]})
    except (TypeError, ValueError) as error:
      raise ValueError(f'config.{field}={config[field]!r}: {error}') from None
  check_fields(config, ('batch_size', 'requests_per_slot', 'max_tokens', 'repeats', 'prompt_len'))
  if config.interleave not in ('steps', 'runs'):
    raise ValueError(f"config.interleave must be 'steps' or 'runs', got {config.interleave!r}")
  check_fields(config, ('cost_rounds', 'min_requests'), minimum=0)
  for repeat in (0, int(config.repeats) - 1):     # every pass's prompt seed (`prompt_seed`)
    try:
      check_seed(prompt_seed(config, repeat))
    except ValueError:
      raise ValueError(f'config.seed={config.seed} with config.repeats={config.repeats}: pass '
                       f'{repeat}\'s prompt seed {prompt_seed(config, repeat)} is not a 64-bit '
                       f'int') from None
  parse_workloads(config)                         # and prompt_len for each
  check_engines(config, settings, _sampling(config))


def load_study(config) -> tuple:
  """(workloads, (target, target_params, draft, draft_params, tokenizer), engines) of a batching
  study config: its workloads, its model pair (`load_pair`) and its settings' engines
  (`build_engines`). The study scripts' start.

  Raises:
    ValueError: an unknown workload or setting, or a pair that does not load.
  """
  validate(config)
  workloads, settings = parse_workloads(config), parse_settings(config.settings)
  pair = load_pair(config)                # after the checks: a bad name fails before loading
  engines = build_engines(config, settings, *pair[:4])
  return workloads, pair, engines


def prompt_seed(config, repeat: int) -> int:
  """The `make_prompts` seed of a repeat's prompts: config.seed + repeat with
  `config.new_prompts` (every pass draws its own N held-out prompts), else config.seed (every
  pass reruns the same N). A fraction of the best static setting measured on one set of N = 8
  prompts at B = 1-2 is largely that set's: the static K that suits its few requests in
  hindsight (their lock-step finishes, a few long accepted runs) is not the workload's best
  (`docs/adaptive_k.md`, *One prompt set per pass*). Runs at seeds s and s + 1 share prompt
  sets: pass 1 of the one draws pass 0 of the other's."""
  return int(config.seed) + (int(repeat) if config.new_prompts else 0)


def decode_alone(engine: Engine, config, tokenizer, workload: str, requests: int) -> tuple:
  """(prompts, outputs): the study's first `requests` held-out prompts of `workload`
  (`make_prompts`, test split, `config.seed`, `config.prompt_len` tokens) run through `engine`
  to the end (`config.max_tokens`, stop at the tokenizer's EOS); outputs[i] is prompts[i]'s
  `RequestOutput`. The study scripts' one-engine runs (scripts/acceptance_by_position.py,
  scripts/replay_k_policy.py)."""
  prompts = make_prompts(workload, tokenizer, requests, config.prompt_len, split='test',
                         seed=int(config.seed))
  ids = [engine.add_request(p.tokens, max_tokens=config.max_tokens,
                            stop_tokens=tokenizer.eos_ids) for p in prompts]
  done = engine.run()
  return prompts, check_outputs(done[i] for i in ids)


def idle_round_costs(engines: dict, settings: dict, base: str | None, rounds: int) -> dict:
  """Seconds of one decode round on idle rows per fixed-policy setting, interleaved.

  `rounds` times, the settings in rotated order each take one timed round
  (`Engine.measure_costs(1)`: one warm call, then the fastest of a block of back-to-back timed
  calls, `timing.fastest`; all B slots computed, as in a busy round), so a ratio to the baseline
  compares rounds taken milliseconds apart, which keeps it steady on a loaded machine where whole
  runs are not. The rotated order is no bias here (see `measure`): each timed call follows its
  own setting's warm call. Adaptive policies are skipped (they run several K).

  Returns:
    {name: (median seconds, median of the per-round ratios to the baseline's or None)}.
  """
  names = [n for n in engines if describe(settings[n])['k_policy'] == 'fixed']
  times = {n: [] for n in names}
  for r in range(rounds):
    for name in rotated(names, r):
      engine = engines[name][0]
      times[name].append(engine.measure_costs(1, widths=(engine.num_slots,))[engine.k])
  out = {}
  for name in names:
    ratios = ([t / b for t, b in zip(times[name], times[base])] if base in times else [])
    out[name] = (statistics.median(times[name]), statistics.median(ratios) if ratios else None)
  return out


def baseline_name(settings: dict) -> str | None:
  """The first setting with K = 0 (plain continuous batching), else None."""
  return next((n for n, s in settings.items() if int(s.get('k', 0)) == 0), None)


def run(config, results) -> None:
  """Measure every (repeat, workload, setting) of `config` (configs/batching.py); one record
  each, written after all settings of a (repeat, workload) ran so speedups can be attached.

  Raises:
    ValueError: bad settings, workloads, batch_size, requests_per_slot, min_requests,
      max_tokens, repeats, prompt_len or cost_rounds (before any model is loaded), or a setting
      the Engine refuses.
  """
  validate(config)
  settings = parse_settings(config.settings)
  workloads, (*_, tokenizer), engines = load_study(config)
  b = int(config.batch_size)
  n = max(int(config.requests_per_slot) * b, int(config.min_requests))

  def prompts_of(workload, repeat):
    return [p.tokens for p in make_prompts(workload, tokenizer, n, int(config.prompt_len),
                                           split='test', seed=prompt_seed(config, repeat))]
  stop = tokenizer.eos_ids
  # One untimed pass per engine: short prompts, few tokens (first-call host work, cond branches).
  warm = [list(p[:config.chunk_size]) for p in prompts_of(workloads[0], 0)[:b]]
  for name in engines:
    measure({name: engines[name]}, warm, max_tokens=min(4, int(config.max_tokens)),
            stop_tokens=stop)
  base = baseline_name(settings)
  names = list(settings)
  idle = (idle_round_costs(engines, settings, base, int(config.cost_rounds))
          if int(config.cost_rounds) > 0 else {})
  for repeat in range(int(config.repeats)):
    for w, workload in enumerate(workloads):
      order = rotated(names, repeat * len(workloads) + w)
      groups = [order] if config.interleave == 'steps' else [[n] for n in order]
      prompts = prompts_of(workload, repeat)
      runs = {}
      for group in groups:
        runs.update(measure({n: engines[n] for n in group}, prompts,
                            max_tokens=int(config.max_tokens), stop_tokens=stop,
                            seed=repeat * len(workloads) + w))
      ref = runs.get(base, {})
      outputs = {name: runs[name].pop('outputs', None) for name in names}
      for name in names:
        m = runs[name]
        engine = engines[name][0]
        idle_s, idle_cost = idle.get(name, (None, None))
        results.write(dict(
            workload=workload, setting=name, repeat=repeat, batch_size=b,
            prompt_seed=prompt_seed(config, repeat),
            temperature=float(config.temperature), top_k=int(config.top_k),
            top_p=float(config.top_p), **describe(settings[name]),
            **m, speedup=_ratio(m['tokens_per_s'], ref.get('tokens_per_s')),
            decode_speedup=_ratio(m['decode_tokens_per_s'], ref.get('decode_tokens_per_s')),
            round_cost=_ratio(m['round_s'], ref.get('round_s')),
            matches_baseline=_matches(outputs[name], outputs.get(base), name == base,
                                      _sampling(config).greedy),
            idle_round_s=idle_s, idle_round_cost=idle_cost,
            warmup_step_costs={str(k): t for k, t in sorted(engine.step_costs.items())},
            **_calibration(engine)))
