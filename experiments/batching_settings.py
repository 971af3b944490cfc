"""The batching study's settings: the strings that name each setting's `Engine` arguments
('name=key:value,...;...'), parsed, described for the records, and tried on a stand-in model
before any real one loads (so a setting the Engine refuses fails a sweep before its first case).
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import jax

from jaxspec.cache import pages_needed
from jaxspec.checks import check_int
from jaxspec.engine import Engine, admission
from jaxspec.engine.drafters import ModelDrafter, make_drafter
from jaxspec.engine.k_policy import make_policy
from jaxspec.models import ModelConfig, param_shapes

# Tokens of context the stand-in model of `check_engines` gets at most (its pool stays small).
STAND_IN_CONTEXT = 4096

# A setting's key for an option of its K policy or its drafter: k_policy.OPTION:VALUE,
# drafter.OPTION:VALUE (`engine_kwargs`), with an example option of each.
POLICY_OPTION, DRAFTER_OPTION = 'k_policy.', 'drafter.'
_EXAMPLE = {POLICY_OPTION: ('K policy', 'k_policy.spec_confidence:true'),
            DRAFTER_OPTION: ('drafter', 'drafter.probe_every:none')}
# Engine arguments the experiment sets itself; a setting may not name them.
RESERVED = ('target', 'target_params', 'draft', 'draft_params', 'num_slots', 'self')
# Engine arguments set from other config fields (a setting string cannot spell their values).
FROM_CONFIG = {'num_slots': '--config.batch_size', 'sampling': '--config.temperature / top_k / '
               'top_p', 'page_size': '--config.page_size (the pool is sized in its pages)',
               'num_pages': '--config.pool_pages (one pool for every setting)',
               'max_seq_len': '--config.prompt_len / max_tokens (it is sized from them)'}


def _value(text: str):
  """'4' -> 4, '0.5' -> 0.5, 'true'/'false' -> bool, '8/2/1' -> (8, 2, 1) and '8/' -> (8,) (a
  sequence of ints, e.g. decode_buckets), anything else the string itself."""
  if re.fullmatch(r'\s*-?\d+\s*(/\s*-?\d+\s*)*/\s*(-?\d+\s*)?', text):   # a/b/c or a/
    return tuple(int(p) for p in text.split('/') if p.strip())
  low = text.lower()
  if low in ('true', 'false'):
    return low == 'true'
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def parse_settings(text: str) -> dict[str, dict]:
  """Parse settings 'name=key:value,key:value;name2=key:value' into {name: Engine kwargs}.

  Example: 'k0=k:0;k4=k:4;goodput=k:8,k_policy:goodput' ->
  {'k0': {'k': 0}, 'k4': {'k': 4}, 'goodput': {'k': 8, 'k_policy': 'goodput'}}. Values are ints,
  floats, true/false, tuples of ints written a/b/c (`decode_buckets:8/2/1`; one element: `8/`)
  or strings. A setting with k >= 1 gets the draft model unless it names another drafter
  (`drafter:ngram`: prompt lookup, no draft model); k defaults to 0. `k_policy.OPTION:VALUE`
  passes OPTION to the K policy's constructor and `drafter.OPTION:VALUE` to the drafter's
  (`engine_kwargs`; an option's value 'none' is None), e.g. 'gp=k:8,k_policy:goodput,
  k_policy.spec_confidence:true' or 'gpf=k:8,k_policy:goodput,drafter.fill_prefill:true'. Values
  the Engine, the policy or the drafter refuses (a bad policy name, an option it does not take, a
  lazy draft cache's option where the engine keeps none, ...) are reported by `make_engines`,
  naming the setting.

  Raises:
    ValueError: naming the setting: no settings, a setting without '=', an empty or repeated
      name, a pair that is not key:value, a repeated key, a key that is not an `Engine` keyword
      argument (or one the experiment sets itself: target, draft, num_slots, sampling, ...),
      k_policy.OPTION or drafter.OPTION, k_policy options without k_policy, drafter options at
      K = 0 (no drafter), a k that is not an int >= 0, no K = 0 setting (the baseline).
  """
  params = inspect.signature(Engine.__init__).parameters
  allowed = sorted(n for n in params if n not in RESERVED and n not in FROM_CONFIG)
  settings: dict[str, dict] = {}
  for part in str(text).split(';'):
    part = part.strip()
    if not part:
      continue
    name, eq, body = part.partition('=')
    name = name.strip()
    if not eq or not name:
      raise ValueError(f'setting {part!r} is not name=key:value,...')
    if name in settings:
      raise ValueError(f'setting {name!r} appears twice in {text!r}')
    kwargs = {}
    for pair in body.split(','):
      key, colon, value = (s.strip() for s in pair.partition(':'))
      if not colon or not key or not value:
        raise ValueError(f'setting {name!r}: {pair.strip()!r} is not key:value')
      if key in kwargs:
        raise ValueError(f'setting {name!r}: key {key!r} appears twice')
      if key in FROM_CONFIG:
        raise ValueError(f'setting {name!r}: {key!r} is set by the experiment for every setting '
                         f'(use {FROM_CONFIG[key]})')
      prefix = _option_prefix(key)
      if prefix is not None:
        if not key[len(prefix):].isidentifier():
          raise ValueError(f'setting {name!r}: {key!r} is not {prefix}OPTION (an option of '
                           f'the {_EXAMPLE[prefix][0]}, e.g. {_EXAMPLE[prefix][1]})')
      elif key not in allowed:
        raise ValueError(f'setting {name!r}: {key!r} is not an Engine argument a setting may '
                         f'set (known: {", ".join(allowed)})')
      # An option's 'none' is None (e.g. drafter.probe_every:none); elsewhere it stays a string.
      none = prefix is not None and value.lower() == 'none'
      kwargs[key] = None if none else _value(value)
    k = kwargs.setdefault('k', 0)
    check_int(f'setting {name!r}: k', k, 0)
    if policy_options(kwargs) and 'k_policy' not in kwargs:
      raise ValueError(f'setting {name!r}: k_policy options {policy_options(kwargs)} without '
                       f'k_policy:NAME')
    if drafter_options(kwargs) and k == 0:
      raise ValueError(f'setting {name!r}: drafter options {drafter_options(kwargs)} at k = 0, '
                       f'which runs no drafter')
    settings[name] = kwargs
  if not settings:
    raise ValueError(f'no settings in {text!r}')
  if not any(kw['k'] == 0 for kw in settings.values()):
    raise ValueError(f'settings {text!r} have no K = 0 baseline (every ratio is taken against '
                     f'it): add one, e.g. k0=k:0')
  return settings


def _option_prefix(key: str):
  """POLICY_OPTION or DRAFTER_OPTION if `key` starts with it, else None."""
  return next((p for p in (POLICY_OPTION, DRAFTER_OPTION) if key.startswith(p)), None)


def _options(kwargs: dict, prefix: str) -> dict:
  return {key[len(prefix):]: value for key, value in kwargs.items() if key.startswith(prefix)}


def policy_options(kwargs: dict) -> dict:
  """{option: value} of a setting's k_policy.OPTION keys (the K policy's constructor
  arguments: `jaxspec.engine.k_policy.make_policy`)."""
  return _options(kwargs, POLICY_OPTION)


def drafter_options(kwargs: dict) -> dict:
  """{option: value} of a setting's drafter.OPTION keys (the drafter's constructor arguments:
  `jaxspec.engine.drafters.make_drafter`, e.g. a `ModelDrafter`'s probe_every, fill_prefill)."""
  return _options(kwargs, DRAFTER_OPTION)


def engine_kwargs(kwargs: dict) -> dict:
  """A setting's `Engine` keyword arguments: its k_policy.OPTION keys built into the policy
  (`make_policy(k_policy, **options)`) and its drafter.OPTION keys into the drafter
  (`make_drafter(drafter, **options)`, default 'model'), fresh instances per call: one per
  engine, each keeping its own state.

  Raises:
    ValueError: an unknown policy or drafter, an option it does not take or a value it refuses.
  """
  out = {key: value for key, value in kwargs.items() if _option_prefix(key) is None}
  policy, drafter = policy_options(kwargs), drafter_options(kwargs)
  if policy:
    out['k_policy'] = make_policy(out.get('k_policy', 'fixed'), **policy)
  if drafter:
    out['drafter'] = make_drafter(out.get('drafter', 'model'), uses_draft_model(kwargs), **drafter)
  return out


def describe(kwargs: dict) -> dict:
  """The record fields naming a setting: k, drafter ('none' at K = 0, else the setting's
  drafter, default 'model'), k_policy (default 'fixed'), and k_policy_options and
  drafter_options (their OPTION values as 'OPTION=VALUE,...' sorted by option, a tuple as 0/2/4,
  '' without any), so the records tell apart settings that differ only in an option."""
  k = int(kwargs.get('k', 0))
  return dict(k=k, drafter=str(kwargs.get('drafter', 'model')) if k else 'none',
              k_policy=str(kwargs.get('k_policy', 'fixed')),
              k_policy_options=_spelled(policy_options(kwargs)),
              drafter_options=_spelled(drafter_options(kwargs)))


def _spelled(options: dict) -> str:
  return ','.join(f'{key}=' + ('/'.join(map(str, value)) if isinstance(value, tuple) else
                               str(value)) for key, value in sorted(options.items()))


def uses_draft_model(kwargs: dict) -> bool:
  """Whether a setting needs the draft model (K >= 1 with the default or 'model' drafter)."""
  return int(kwargs.get('k', 0)) > 0 and kwargs.get('drafter', 'model') == 'model'


def run_span(config, settings: dict) -> int:
  """Tokens a request of the run spans at most: prompt_len + max_tokens + K + 1 (K the largest
  of any setting: a round writes up to K + 1 cache slots)."""
  return config.prompt_len + config.max_tokens + max(int(s.get('k', 0))
                                                     for s in settings.values()) + 1


def engine_shape(config, settings: dict, context: int) -> tuple[int, int]:
  """(max_seq_len, num_pages) every setting's engine gets: room for `run_span` tokens in whole
  pages, at most `context` (tokens), and `config.pool_pages` pages (0: a full max_seq_len for
  each of the batch_size slots, plus the null page)."""
  page = int(config.page_size)
  max_seq_len = min(pages_needed(run_span(config, settings), page) * page, context)
  return max_seq_len, int(config.pool_pages) or full_pool(config, max_seq_len)


def full_pool(config, max_seq_len: int) -> int:
  """Pages for max_seq_len tokens in each of the batch_size slots, plus the null page."""
  return int(config.batch_size) * pages_needed(max_seq_len, int(config.page_size)) + 1


def make_engines(config, settings: dict, target, target_params, draft, draft_params, *,
                 sampling, max_seq_len: int, num_pages: int, admit: bool = True) -> dict:
  """{name: Engine} (not warmed up), one per setting, each checked to admit a request of the run
  (a prompt of prompt_len tokens and max_tokens; `admit=False` skips that) before any is
  compiled.

  Raises:
    ValueError: naming the setting whose Engine arguments the Engine refuses, that sets a lazy
      draft cache's option (`ModelDrafter.LAZY_OPTIONS`) for an engine that keeps none (named
      at any value: the Engine itself refuses only values away from the defaults), or whose
      engine cannot hold a request of the run (e.g. too few pool pages: `--config.pool_pages`).
  """
  engines = {}
  for name, kwargs in settings.items():
    spec = dict(draft=draft, draft_params=draft_params) if uses_draft_model(kwargs) else {}
    args = dict(num_slots=int(config.batch_size), num_pages=num_pages,
                page_size=int(config.page_size), chunk_size=int(config.chunk_size),
                max_seq_len=max_seq_len, sampling=sampling, seed=int(config.seed))
    try:
      args.update(engine_kwargs(kwargs))
      engine = Engine(target, target_params, **args, **spec)
    except (TypeError, ValueError) as err:
      raise ValueError(f'setting {name!r} ({kwargs}): {err}') from err
    idle = sorted(set(drafter_options(kwargs)) & set(ModelDrafter.LAZY_OPTIONS))
    if idle and engine.draft_sync is None:
      raise ValueError(f'setting {name!r}: drafter options {idle} act on the lazy draft cache, '
                       f'which this engine does not keep (its K policy never chooses K = 0, or '
                       f'drafter.lazy is false)')
    if admit:                                        # the engine's own admission check
      try:
        admission.check(engine, [0] * int(config.prompt_len), int(config.max_tokens), (), b'',
                        None)
      except ValueError as err:
        hint = (f' (--config.pool_pages={config.pool_pages}; 0 sizes it)'
                if 'pages' in str(err) else '')
        raise ValueError(f'setting {name!r}: a request of the run: {err}{hint}') from err
    engines[name] = engine
  return engines


def check_engines(config, settings: dict, sampling) -> None:
  """Build each setting's engine around a stand-in model (the test-tiny shapes, zero weights)
  and drop it: the Engine's own checks of the setting's arguments, and of the pool against a
  request of the run, run before the real pair loads (seconds, not the minutes of a load and
  warm-up). The stand-in's context fits the run up to STAND_IN_CONTEXT tokens; a longer run is
  checked for its arguments only (its pool and the real models' context: `build_engines`,
  which checks what depends on the real models in any case).

  Raises:
    ValueError: as `make_engines`.
  """
  page = int(config.page_size)
  span = pages_needed(run_span(config, settings), page) * page
  fits = span <= STAND_IN_CONTEXT
  stand_in = ModelConfig.from_name('test-tiny', max_seq_len=min(span, STAND_IN_CONTEXT))
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), param_shapes(stand_in))
  max_seq_len, pool = engine_shape(config, settings, stand_in.max_seq_len)
  full = full_pool(config, max_seq_len)
  pool = min(pool, full) if fits else full       # more than a full pool admits the same
  for name, kwargs in settings.items():          # one at a time: one stand-in pool alive
    make_engines(config, {name: kwargs}, stand_in, params, stand_in, params, sampling=sampling,
                 max_seq_len=max_seq_len, num_pages=pool, admit=fits)
