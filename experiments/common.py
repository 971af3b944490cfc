"""What the experiment entry points share: reading the command line (`parse_flags`, one-line
errors for a bad config or field), validating config fields (`check_fields`, `comma_list`,
`parse_workloads`), loading the tokenizer and models (`load_tokenizer`, `load_at_dtype`) and
the small helpers several experiments use (`empty_cache`, `draft_label`), so no experiment
imports another one's private names. Where results go, and reading them back:
`experiments.records`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import pathlib
import runpy
from typing import Optional

import sys

from absl import flags
import ml_collections
from ml_collections.config_flags.config_flags import ConfigFileFlagParser
import numpy as np

from jaxspec.cache import PageAllocator, pages_needed
from jaxspec.data import WORKLOADS, Tokenizer
from jaxspec.data.workloads import check_prompt_len
from jaxspec.models import cache_for, is_pretrained, load_model, shipped
from jaxspec.models.checkpoint import ASSETS, CheckpointError
from jaxspec.parallel import load_sharded


def parse_flags(argv):
  """absl flags parser for the experiment entry points: an unknown or malformed `--config.FIELD`
  ends the program with one line naming the field, before anything runs."""
  try:
    rest = flags.FLAGS(argv)
    _exit_unloaded_config()
    return rest
  except OSError as e:   # an override of a config file that could not be loaded
    exit_config_error(e)
  except flags.Error as e:
    text = str(e)
    if 'Traceback (most recent call last)' in text:   # a config file's get_config raised:
      lines = text.strip().splitlines()                # ml_collections quotes its traceback
      text = f'{lines[0].rstrip(": ")}: {lines[-1]}'
    sys.exit(f'FATAL flags: {text}')
  except Exception as e:  # pylint: disable=broad-except
    # ml_collections lets anything but OSError, TypeError and ValueError out of loading the
    # file (a SyntaxError, a get_config that raises or is missing) as it is.
    if _from_config_file(e):
      exit_config_error(e)
    if isinstance(e, (AttributeError, KeyError)):  # an override of a field the config lacks
      _exit_not_a_config()
      _exit_override_of_a_non_config(argv)
      exit_unknown_field(e, argv)
    raise


def _from_config_file(error: BaseException) -> bool:
  """Whether `error` came out of ml_collections loading the `--config` file (its module or its
  get_config): its traceback passes through the config file parser."""
  tb = error.__traceback__
  while tb is not None:
    if isinstance(tb.tb_frame.f_locals.get('self'), ConfigFileFlagParser):
      return True
    tb = tb.tb_next
  return False


def _exit_unloaded_config() -> None:
  """Ends the program with one line when `--config` names a file that could not be loaded
  (ml_collections keeps the error in the flag's value and raises it, with its traceback, at the
  first use: a mistyped path would end in a 30-line traceback), or one whose get_config did not
  return a ConfigDict with an `experiment` field (`_exit_not_a_config`)."""
  if 'config' not in flags.FLAGS:
    return
  try:
    flags.FLAGS['config'].value.keys()
  except OSError as error:
    exit_config_error(error)
  except AttributeError:       # not a ConfigDict
    pass
  _exit_not_a_config()


def _exit_not_a_config() -> None:
  """Ends the program with one line when the `--config` file's get_config returned something
  other than an ml_collections.ConfigDict, or one with no `experiment` field (the module of
  experiments/ that runs it)."""
  try:
    value = flags.FLAGS['config'].value
    path = str(flags.FLAGS['config'].config_filename or DEFAULT_CONFIG)
  except Exception:  # pylint: disable=broad-except  # no --config flag, or not parsed yet
    return
  _exit_unless_a_config_dict(path, value)
  if 'experiment' not in value:
    sys.exit(f"FATAL: {path}: the config has no 'experiment' field (the module of experiments/ "
             f"that runs it, e.g. 'speculative')")


def _exit_override_of_a_non_config(argv) -> None:
  """Ends the program with `_exit_not_a_config`'s line when a `--config.FIELD` override failed
  because get_config returned no ConfigDict (None, a dict, ...): the flag is not parsed then, so
  the file is loaded again to see what it returns (`_config_value`)."""
  try:
    value = _config_value(argv)
  except Exception:  # pylint: disable=broad-except  # its own error is reported instead
    return
  _exit_unless_a_config_dict(_config_path(), value)


def _exit_unless_a_config_dict(path, value) -> None:
  """Ends the program with one line naming the type `path`'s get_config returned, unless
  `value` is an ml_collections.ConfigDict."""
  if not isinstance(value, ml_collections.ConfigDict):
    sys.exit(f'FATAL: {path}: get_config() returned {type(value).__name__}, not an '
             f'ml_collections.ConfigDict')


def exit_config_error(error: Exception) -> None:
  """Ends the program with one line saying why the `--config` file could not be loaded: it is
  missing or unreadable (OSError), or its module or get_config raised (the exception's type and
  message; a module without get_config says so)."""
  reason = str(error).strip().splitlines()[-1].strip() if str(error).strip() else ''
  if isinstance(error, AttributeError) and 'get_config' in reason:
    reason = 'the file defines no get_config()'
  elif isinstance(error, SyntaxError):
    reason = f'SyntaxError: {error.msg} at line {error.lineno}'
  elif not isinstance(error, OSError):
    reason = f'{type(error).__name__}: {reason}' if reason else type(error).__name__
  path = _config_path()
  hint = ''
  if path and not os.path.isabs(path) and not os.path.exists(path) and \
      not os.path.isdir('configs'):
    hint = f'; config paths are relative to the repository root, and {os.getcwd()} is not it'
  named = '' if not path or path in reason else f' {path}'
  sys.exit(f'FATAL: cannot load the config file{named} ({reason}){hint}')


def _config_path() -> str:
  """The `--config` file's path without its ':variant': the flag's once parsed, else the
  command line's (an override that failed leaves the flag unparsed), DEFAULT_CONFIG without
  one."""
  try:
    path = str(flags.FLAGS['config'].config_filename or DEFAULT_CONFIG)
  except Exception:  # pylint: disable=broad-except  # not parsed yet (an override failed first)
    path = _config_spec(sys.argv)
  return path.split(':')[0]


def exit_unknown_field(error: Exception, argv) -> None:
  """Ends the program with one line naming the unknown `--config.FIELD` (ml_collections raises
  AttributeError / KeyError for it, at flag definition when the default config file is used)."""
  bad = [a for a, b in zip(argv[1:], _double_dashed(argv)[1:]) if b.startswith('--config.')]
  while isinstance(error, BaseException) and error.args and \
      isinstance(error.args[0], BaseException):                  # AttributeError(KeyError(...))
    error = error.args[0]
  text = str(error.args[0]) if error.args else str(error)
  name, _, hint = text.partition('\n')             # ml_collections appends 'Did you mean ...'
  name = name.strip('"\'\\')
  hint = f' ({hint.strip()})' if hint.strip() else ''
  found = unknown_fields(argv)
  others = [f'{field!r}' + (f' (did you mean {close!r}?)' if close else '')
            for field, close, _ in found
            if field != name and field.rpartition('.')[2] != name]
  also = f'; also unknown: {", ".join(others)}' if others else ''
  known = next((keys for field, _, keys in found
                if field == name or field.rpartition('.')[2] == name), None)
  listed = (f'; known there: {", ".join(known)}' if known and not hint else
            '; the config file lists every field')
  sys.exit(f'FATAL: unknown config field {name!r}{hint}{also} in {bad}{listed}')


def _own_tokenizer(path) -> Optional[pathlib.Path]:
  """The tokenizer a model directory was trained with: its own tokenizer.json, the shipped one
  for the shipped models (which share jaxspec/assets/tokenizer.json), else None (unknown)."""
  own = pathlib.Path(path) / 'tokenizer.json'
  if own.is_file():
    return own
  if pathlib.Path(path).resolve().parent == ASSETS:
    return shipped('tokenizer.json')
  return None


def load_tokenizer(tokenizer_path, target_path, draft_path=None) -> Tokenizer:
  """The tokenizer of a target (and its draft): `tokenizer_path` if given, else the target's own
  (a Hugging Face or experiments.train directory's tokenizer.json), else the shipped one.

  Raises CheckpointError naming a model path that is not a directory; FileNotFoundError naming
  a given tokenizer file that is missing; ValueError naming the file when a Hugging Face target
  has no tokenizer.json and none is given, or when a model's own tokenizer (its directory's
  tokenizer.json; the shipped one for the shipped models) differs from the one in use: a Hugging
  Face target left with the shipped draft is such a pair."""
  if tokenizer_path:
    source = pathlib.Path(tokenizer_path)
  elif is_pretrained(target_path):
    source = pathlib.Path(target_path) / 'tokenizer.json'
    if not source.is_file():
      raise ValueError(f'{source} is missing: give the tokenizer with --config.tokenizer')
  else:
    source = _own_tokenizer(target_path) or shipped('tokenizer.json')
  for name, path in (('target', target_path), ('draft', draft_path)):
    if path is not None and not pathlib.Path(path).is_dir():   # named before any comparison
      raise CheckpointError(f'no model directory at {pathlib.Path(path).absolute()} '
                            f'(config.{name})')
  tokenizer = Tokenizer.load(source)
  for name, path in (('target', target_path), ('draft', draft_path)):
    own = None if path is None else _own_tokenizer(path)
    if own is None or own.resolve() == source.resolve():
      continue
    diff = tokenizer.vocabulary_difference(Tokenizer.load(own))
    if diff:
      if tokenizer_path:
        why = (f'the {name} was trained with its own: leave config.tokenizer empty, or give '
               f'that one')
      elif pathlib.Path(path).resolve().parent == ASSETS:
        why = (f'draft and target must share one vocabulary (the draft proposes token ids that '
               f'the target verifies); the shipped {name} speaks the shipped tokenizer: give a '
               f'{name} of the same family with --config.{name}')
      else:
        why = ('draft and target must share one vocabulary (the draft proposes token ids that '
               'the target verifies)')
      where = ', config.tokenizer' if tokenizer_path else ''
      raise ValueError(f'the tokenizer in use ({source}{where}) and the {name} tokenizer '
                       f'({own}) differ, in that order: {diff}; {why}')
  return tokenizer


DEFAULT_CONFIG = 'configs/speculative.py'   # --config of experiments.run and experiments.sweep


def _config_spec(argv, default_config: str = DEFAULT_CONFIG) -> str:
  """The `path[:variant]` of argv's last `--config=SPEC` or `--config SPEC` (absl keeps the last
  one; absl also takes `-config`), else `default_config`."""
  argv = _double_dashed(argv)
  specs = [a.partition('=')[2] if a.startswith('--config=') else argv[i + 1]
           for i, a in enumerate(argv[1:], start=1)
           if a.startswith('--config=') or (a == '--config' and i + 1 < len(argv))]
  return specs[-1] if specs else default_config


def _double_dashed(argv) -> list:
  """argv with absl's single-dash form of the config flags (`-config=...`, `-config.FIELD=...`)
  written `--config...`, as the readers of argv here look for it."""
  return [a if i == 0 or not a.startswith('-config') else '-' + a for i, a in enumerate(argv)]


def _config_value(argv, default_config: str = DEFAULT_CONFIG):
  """What get_config returns for argv's `--config` path[:variant] (`_config_spec`), called as
  ml_collections calls it; raises what loading the file raises."""
  path, _, variant = _config_spec(argv, default_config).partition(':')
  get_config = runpy.run_path(path)['get_config']
  return get_config(variant) if variant else get_config()


def unknown_fields(argv, default_config: str = DEFAULT_CONFIG) -> list:
  """[(field, closest known name or None, the known names at that level)] for every
  `--config.FIELD=VALUE` of argv whose dotted path the config file (`_config_spec`: the last
  `--config`, else `default_config`) lacks; [] when the file cannot be loaded (its own error is
  reported instead). ml_collections stops at the first unknown field; this names them all."""
  try:
    config = _config_value(argv, default_config)
  except Exception:  # pylint: disable=broad-except
    return []
  if not isinstance(config, ml_collections.ConfigDict):
    return []
  out = []
  for arg in _double_dashed(argv)[1:]:
    if not arg.startswith('--config.'):
      continue
    field = arg[len('--config.'):].split('=', 1)[0]
    node = config
    for part in field.split('.'):
      if isinstance(node, ml_collections.ConfigDict) and part in node:
        node = node[part]
        continue
      keys = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      close = difflib.get_close_matches(part, keys, n=1)
      out.append((field, close[0] if close else None, sorted(keys)))
      break
  return out


def warn_if_busy(threshold: float = 0.5) -> Optional[float]:
  """Print a warning when the machine is already busy before a run starts: the 1-minute load
  average above `threshold` x the CPU count (timings, and speedups most, fall under load, while
  α, β and τ at a fixed K do not; the average decays over minutes, so runs back to back also
  raise it). Returns the load average (None where the OS does not report one)."""
  try:
    load = os.getloadavg()[0]
  except (AttributeError, OSError):
    return None
  cpus = os.cpu_count() or 1
  if load > threshold * cpus:
    print(f'warning: load average {load:.1f} on {cpus} CPUs before the run: if other work '
          f'shares the machine, times and speedups read low (at a fixed K, α, β and τ do not '
          f'depend on load)', file=sys.stderr, flush=True)
  return load


_RUNNERS = ('run', 'sweep', 'report')   # the entry points of experiments/


def import_experiment(name: str):
  """The module experiments.NAME (`config.experiment`), for experiments.run and .sweep.

  Raises:
    ValueError: there is no experiments/NAME.py, or it is not an experiment (no run(config,
      results): the runners and helpers beside them, such as common or report); an import
      that fails inside the module (e.g. a missing dependency) raises as it is.
  """
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f'config.experiment={name!r} must name a module of experiments/')
  if name in _RUNNERS:       # imported again, run.py would define its flags a second time
    raise ValueError(f'config.experiment={name!r}: experiments/{name}.py runs experiments, it '
                     f'is not one')
  try:
    module = importlib.import_module(f'experiments.{name}')
  except ModuleNotFoundError as error:
    if error.name != f'experiments.{name}':
      raise
    raise ValueError(f'config.experiment={name!r} names no module experiments/{name}.py') from None
  if not callable(getattr(module, 'run', None)):
    raise ValueError(f'config.experiment={name!r}: experiments/{name}.py is not an experiment '
                     f'(it has no run(config, results))')
  return module


def validate(module, config) -> None:
  """Run an experiment module's `validate(config)` if it has one: the checks of its config that
  need no model, so a bad value fails before a run directory is made or a sweep's first case
  runs (each experiment's `run` calls its own too).

  Raises:
    ValueError: from the module, naming the bad field.
  """
  check = getattr(module, 'validate', None)
  if check is not None:
    check(config)


def check_fields(config, names, minimum: int = 1) -> None:
  """Raise ValueError('config.NAME must be >= MINIMUM, got VALUE') for the first of `names`
  whose value in `config` is below `minimum` (sizes and counts an experiment checks before it
  loads any model)."""
  for name in names:
    if config[name] < minimum:
      raise ValueError(f'config.{name} must be >= {minimum}, got {config[name]}')


def comma_list(config, field: str, known=None, convert=None, what: str = 'value') -> list:
  """The items of the comma-separated string `config.FIELD`, blanks dropped, each checked.

  Args:
    known: the allowed items (None: any); convert: applied to each item (e.g. int), a
      ValueError from it naming the item; what: the word for an item in errors.
  Raises:
    ValueError: naming the field and its value when it lists nothing, an item not in `known` or
      that `convert` refuses, or an item twice (its records would repeat).
  """
  text = config[field]
  items = [s.strip() for s in str(text).split(',') if s.strip()]
  if not items:
    raise ValueError(f'config.{field} names no {what}: {text!r}')
  if known is not None:
    unknown = [n for n in items if n not in known]
    if unknown:
      raise ValueError(f'unknown {what}(s) {unknown} in config.{field}={text!r}; known: '
                       f'{", ".join(map(str, known))}')
  if convert is not None:
    converted = []
    for item in items:
      try:
        converted.append(convert(item))
      except ValueError:
        raise ValueError(f'config.{field}={text!r}: {item!r} is not a valid {what}') from None
    items = converted
  repeated = [n for i, n in enumerate(items) if n in items[:i]]
  if repeated:
    raise ValueError(f'config.{field}={text!r} names {sorted(set(map(str, repeated)))} more '
                     f'than once (its records would repeat)')
  return items


def parse_workloads(config) -> list[str]:
  """The workload names of `config.workloads`, a comma-separated string such as 'json,code'
  (`comma_list` with the known `jaxspec.data.WORKLOADS`; config.repeats measures one again).

  Raises:
    ValueError: the string names no workload, names one not in WORKLOADS (the message names
      the bad value and the known workloads), or names one twice (its records would repeat);
      a config.prompt_len (where the config has one) too short for one of them
      (`jaxspec.data.workloads.check_prompt_len`).
  """
  workloads = comma_list(config, 'workloads', WORKLOADS, what='workload')
  if 'prompt_len' in config:
    for workload in workloads:
      check_prompt_len(workload, config.prompt_len, 'config.prompt_len')
  return workloads


def draft_label(config) -> str:
  """How errors name the run's draft: 'the draft (PATH)', or '(shipped)' for the default."""
  return f'the draft ({config.draft or "shipped"})'


def load_at_dtype(path, config, mesh=None, *, replicate: bool = False) -> tuple:
  """(ModelConfig, params) of the model directory `path` at `config.dtype` (float32 when the
  config has no dtype field): params cast and the ModelConfig's activations dtype set to match.

  With a `mesh` (`jaxspec.parallel.mesh_of`), a `save_model` directory is read straight into
  its placement (`jaxspec.parallel.load_sharded`: split by the target's rules, or replicated
  with `replicate=True`), so a target larger than one device is never whole on one; a Hugging
  Face directory is read whole (`load_model`) and placed later.

  Raises CheckpointError / ValueError (`load_model`, `load_sharded`): missing, corrupt, a bad
  dtype, or a target the mesh's model axis does not divide."""
  dtype = str(config.get('dtype', 'float32'))
  if mesh is not None and not is_pretrained(path):
    model, params = load_sharded(path, mesh, replicate=replicate, dtype=dtype)
  else:
    model, params = load_model(path, dtype)
  return dataclasses.replace(model, dtype=dtype), params


def empty_cache(model, batch: int, slots: int, page_size: int):
  """An empty paged KV cache with room for `slots` tokens per sequence, each row its own pages.

  Args:
    model: the `ModelConfig` whose layers / kv heads / head_dim / dtype shape the cache.
    batch: B sequences (rows of the page table).
    slots: tokens of capacity per sequence, rounded up to whole pages of `page_size` tokens.
    page_size: L tokens per page.
  Returns:
    (cache, per_seq_bytes): a `PagedKVCache` with page_table [B, ceil(slots / L)] int32 (distinct
    pages, page 0 the null page left unused), lengths [B] zeros, pool of B * ceil(slots / L) + 1
    pages; and the KV bytes one sequence's pages hold over all layers (int, bytes).
  Raises:
    ValueError: page_size < 1 (from `pages_needed`), or batch < 1 or slots < 1 (no page to
      allocate: from `PageAllocator`).
  """
  per_seq = pages_needed(slots, page_size)
  allocator = PageAllocator(batch * per_seq + 1)
  table = np.array([allocator.allocate(per_seq) for _ in range(batch)], np.int32)
  cache = cache_for(model, table, allocator.num_pages, page_size)
  per_seq_bytes = per_seq * page_size * model.kv_bytes_per_token(cache.k_pages.dtype.itemsize)
  return cache, per_seq_bytes
