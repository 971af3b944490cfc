"""Where an experiment's results go: WORKDIR/EXPERIMENT/RUN_ID/{config.json, environment.json,
results.jsonl}, and reading them back.

Each measured case is appended to results.jsonl (and flushed) as soon as it is measured, so an
interrupted run loses nothing; `read_results` skips a line torn by a kill.
"""

from __future__ import annotations

import datetime
import gzip
import json
import math
import os
import pathlib
from typing import Optional
import warnings

import ml_collections


def new_run_dir(workdir, experiment: str, run_id: Optional[str] = None) -> pathlib.Path:
  """A fresh WORKDIR/EXPERIMENT/RUN_ID directory (RUN_ID defaults to a UTC timestamp;
  RUN_ID-2, -3, ... when taken). A WORKDIR with '..' in it is resolved first (the absolute path
  is returned): `mkdir(parents=True)` of new/../kept would make a stray new/ to pass through.

  Safe against other runs making directories beside it: a RUN_ID another run took between the
  check and the mkdir (two runs started in the same second) moves on to the next suffix, and
  an EXPERIMENT directory another run's cleanup removed (`experiments.run` removes what a run
  that measured nothing made) is made again.

  Raises:
    OSError: the directory cannot be made (a file in the way, no permission).
  """
  base = pathlib.Path(workdir) / experiment
  if '..' in base.parts:
    base = pathlib.Path(os.path.realpath(base))
  run_id = run_id or datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%d-%H%M%S')
  n, remade = 1, 0
  while True:
    path = base / (run_id if n == 1 else f'{run_id}-{n}')
    try:
      path.mkdir(parents=True)
      return path
    except FileExistsError:               # taken (by another run since the last try, too)
      if not os.path.lexists(path):       # a parent in the way (a dangling link): not taken
        raise
      n += 1
    except FileNotFoundError:
      # mkdir(parents=True) made EXPERIMENT, and another run's cleanup removed it (empty) before
      # RUN_ID was made in it: make both again (a few times; past that, a real error).
      remade += 1
      if remade > 8:
        raise


def _clean(value):
  """JSON-safe: NaN/inf become None (strict JSON has no NaN)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


# The packages a result depends on beyond our code: the corpora are read from the installed
# Python's standard library and botocore's data files (jaxspec.data.corpus), so their versions
# change the held-out prompts and with them α, token counts and perplexities.
_VERSIONED = ('jax', 'jaxlib', 'flax', 'numpy', 'botocore', 'tokenizers', 'llguidance')


def environment() -> dict:
  """What a run's numbers depend on besides its config: Python and package versions (the
  corpora come from the stdlib and botocore), the machine's CPU and JAX's devices."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import platform  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  versions = {}
  for name in _VERSIONED:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  cpu = platform.processor() or platform.machine()
  try:
    for line in pathlib.Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith('model name'):
        cpu = line.split(':', 1)[1].strip()
        break
  except OSError:
    pass
  return dict(python=platform.python_version(), packages=versions, cpu=cpu,
              cpu_count=os.cpu_count(), devices=[d.device_kind for d in jax.devices()])


class Results:
  """Appends one JSON line per measured case to `run_dir/results.jsonl`.

  Attributes:
    dir: the run directory (plots go here too).
    records: every record written so far, in order.
  """

  def __init__(self, run_dir, config: Optional[ml_collections.ConfigDict] = None,
               tags: Optional[dict] = None, verbose: bool = True):
    self.dir = pathlib.Path(run_dir)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.tags = dict(tags or {})
    self.verbose = verbose
    self.records: list[dict] = []
    if config is not None:
      (self.dir / 'config.json').write_text(config.to_json_best_effort(indent=2) + '\n')
      (self.dir / 'environment.json').write_text(json.dumps(environment(), indent=2) + '\n')
    self.path = self.dir / 'results.jsonl'

  def write(self, record: dict) -> None:
    """Append `record` (plus the tags) as one line, flushed to disk before returning."""
    record = {**self.tags, **{k: _clean(v) for k, v in record.items()}}
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    self.records.append(record)
    if self.verbose:
      print(format_record(record), flush=True)


class DiscardedResults(Results):
  """Results of a process other than 0 in a multi-process run: records are kept in memory (the
  experiment may read them) but nothing is written or printed; process 0 writes the results."""

  def __init__(self, tags: Optional[dict] = None):  # pylint: disable=super-init-not-called
    self.dir, self.path, self.tags, self.verbose = None, None, dict(tags or {}), False
    self.records = []

  def write(self, record: dict) -> None:
    self.records.append({**self.tags, **{k: _clean(v) for k, v in record.items()}})


def format_record(record: dict) -> str:
  """One readable line: key=value with floats at 4 significant digits; dict and list fields
  (per-K round counts, cost tables, per-chunk series) are left to results.jsonl (printed, a
  batching record ran past 400 characters)."""
  parts = []
  for key, value in record.items():
    if isinstance(value, (dict, list, tuple)):
      continue
    if isinstance(value, float):
      value = f'{value:.4g}'
    parts.append(f'{key}={value}')
  return '  '.join(parts)


def results_text(path) -> str:
  """The text of a results.jsonl file, or of a gzip-compressed one named *.gz (records kept in
  the repository, docs/batching/).

  Raises:
    OSError: the file cannot be read. ValueError: it is not UTF-8 text, or a *.gz file is not
      gzip data (naming it)."""
  try:
    if str(path).endswith('.gz'):
      with gzip.open(path, 'rt', encoding='utf-8') as f:
        return f.read()
    return pathlib.Path(path).read_text()
  except UnicodeDecodeError as e:
    raise ValueError(f'{path} is not a results file (not UTF-8 text: {e.reason})') from None
  except (gzip.BadGzipFile, EOFError) as e:
    raise ValueError(f'{path} is not a results file (not gzip data: {e})') from None


def read_results(path) -> list[dict]:
  """All records of a results file (`results_text`: plain or *.gz). A line that is not a JSON
  object is skipped: silently if it is the last (torn by a killed run), else with a warning
  naming the line numbers (a record damaged in the middle of a file is a lost result). Blank
  lines are skipped silently.

  Raises:
    ValueError: the file is not UTF-8 text, or not gzip data where named *.gz (naming it)."""
  text = results_text(path)
  lines = text.splitlines()
  records, bad = [], []
  for number, line in enumerate(lines, start=1):
    record = json_object(line)
    if record is not None:
      records.append(record)
    elif line.strip() and number < len(lines):
      bad.append(number)
  if bad:
    shown = ', '.join(map(str, bad[:10])) + (f' and {len(bad) - 10} more' if len(bad) > 10 else '')
    warnings.warn(f'{path}: line{"s" if len(bad) > 1 else ""} {shown} not a JSON record, '
                  f'skipped', stacklevel=2)
  return records


def read_run(path) -> tuple[pathlib.Path, list[dict], int]:
  """(results file, records, records left out) of a results file or of the run or sweep
  directory holding results.jsonl. A sweep's records are those of its finished cases (a `done`
  marker) that its sweep.json still lists, in sweep order (every finished case when sweep.json
  is missing or unreadable), as the sweep itself reports them.

  Raises:
    ValueError: no results file there, or one `read_results` refuses (naming it).
  """
  path = pathlib.Path(path)
  if path.is_dir():                                   # a run or sweep directory
    path = path / 'results.jsonl'
  if not path.is_file():
    raise ValueError(f'no results file {str(path)!r} (give a results.jsonl or its directory)')
  records = read_results(path)
  cases = path.parent / 'cases'
  if not cases.is_dir():
    return path, records, 0
  ids = _sweep_ids(path.parent / 'sweep.json')
  order = {cid: n for n, cid in enumerate(ids or ())}
  kept = [r for r in records if (cases / str(r.get('case_id')) / 'done').exists()
          and (ids is None or r.get('case_id') in order)]
  return path, sorted(kept, key=lambda r: order.get(r.get('case_id'), 0)), len(records) - len(kept)


def _sweep_ids(path: pathlib.Path) -> Optional[list]:
  """The case ids a sweep's sweep.json lists, in sweep order; None if it is missing or
  unreadable (every finished case is kept then)."""
  try:
    return [case['case_id'] for case in json.loads(path.read_text())]
  except (OSError, ValueError, TypeError, KeyError):
    return None


def json_object(line: str) -> dict | None:
  """The JSON object a results line holds, or None for a line that is not one (torn by a
  kill, another JSON value, nested too deep for the parser (RecursionError), or an integer
  past Python's 4300-digit conversion limit (a plain ValueError))."""
  try:
    record = json.loads(line)
  except (ValueError, RecursionError):         # json.JSONDecodeError is a ValueError
    return None
  return record if isinstance(record, dict) else None
