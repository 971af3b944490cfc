"""Run every case of a config's sweep (its `get_sweep()`), resumably, then summarize and plot.

    python -m experiments.sweep --config=configs/speculative.py --workdir=/tmp/sweep
    python -m experiments.sweep --config=configs/speculative.py:smoke --config.num_prompts=2
    python -m experiments.sweep --config=configs/speculative.py --only=k=4 --only=temperature=0.0
    python -m experiments.sweep --config=configs/speculative.py --shard=0/2   # and 1/2 elsewhere
    JAX_PROCESS_ID=0 JAX_NUM_PROCESSES=2 python -m experiments.sweep --shard=process  # and id 1

Everything lands in WORKDIR/EXPERIMENT/SWEEP_NAME/: config.json (base), sweep.json (all cases),
results.jsonl (every record, tagged with case_id and the overrides), failures.jsonl,
summary.md, summary.csv, plots/*.png, and cases/CASE_ID/{config.json, environment.json,
results.jsonl, done, error.txt}. A case counts as measured once its `done` marker exists;
running the same command again skips those, and first drops any partial records of the case it
reruns, so every case appears exactly once. Failed cases are retried on the next run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import gc
import json
import os
import pathlib
import sys
import tempfile
import traceback
from typing import Iterable, Optional

import jax
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from experiments import report, sweeps
from experiments.common import (DEFAULT_CONFIG, exit_config_error, exit_unknown_field,
                                import_experiment, parse_flags, validate)
from experiments.records import Results, format_record, json_object, read_results
from jaxspec.parallel import distributed


@dataclasses.dataclass
class SweepOutcome:
  """What one `run_sweep` call did. Case lists hold case ids, in sweep order."""
  sweep_dir: pathlib.Path
  selected: list[str]                 # cases picked by --only / --shard
  ran: list[str]                      # measured by this call (successfully or not)
  skipped: list[str]                  # already done before this call
  failed: list[str]                   # raised during this call
  busy: list[str]                     # being run by another process, left alone
  records: list[dict]                 # every record of the sweep so far
  report_error: Optional[str] = None  # traceback if the summary or plots failed

  @property
  def exit_code(self) -> int:
    """0 if nothing failed, else 1."""
    return 1 if self.failed or self.report_error else 0


@contextlib.contextmanager
def _locked(sweep_dir: pathlib.Path):
  """Exclusive lock on the sweep's shared files (several shards may write at once)."""
  with open(sweep_dir / '.lock', 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def _write_atomic(path: pathlib.Path, text: str) -> None:
  """Writes through a temp file unique to this process, then renames (shards may race)."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + '.', suffix='.tmp')
  with os.fdopen(fd, 'w') as f:
    f.write(text)
  os.replace(tmp, path)


def _check_same_base(sweep_dir: pathlib.Path, base_json: str) -> None:
  """Refuses to resume a sweep whose done cases were measured under another base config."""
  path = sweep_dir / 'config.json'
  if not path.exists() or not any((sweep_dir / 'cases').glob('*/done')):
    return
  old, new = json.loads(path.read_text()), json.loads(base_json)
  changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
  if changed:
    raise ValueError(
        f'{sweep_dir} holds cases measured with another base config (fields differ: '
        + ', '.join(f'{k}: {old.get(k)!r} -> {new.get(k)!r}' for k in changed)
        + '); pass --sweep_name=NEW for a new sweep, or the same --config overrides to resume')


def _drop_lines(path: pathlib.Path, cid: Optional[str]) -> None:
  """Rewrites a .jsonl file without torn lines, lines that are not JSON objects, and the lines
  of case `cid`."""
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  kept = []
  for line in lines:
    record = json_object(line)
    if record is not None and (cid is None or record.get('case_id') != cid):
      kept.append(line if line.endswith('\n') else line + '\n')
  if kept != lines:
    _write_atomic(path, ''.join(kept))


def _restore_done_cases(sweep_dir: pathlib.Path, ids) -> list:
  """Make the sweep's results.jsonl hold each finished case's records as its `done` marker
  counts them (a truncated or hand-edited file lost some): that case's lines are copied again
  from cases/ID/results.jsonl, or, when that file lacks them too, its marker is removed so the
  case runs again. Returns the ids restored or reopened. Call with the sweep locked."""
  path = sweep_dir / 'results.jsonl'
  records = read_results(path) if path.exists() else []
  counts: dict = {}
  for record in records:
    counts[record.get('case_id')] = counts.get(record.get('case_id'), 0) + 1
  restored, reopened = [], []
  for cid in ids:
    done = sweep_dir / 'cases' / cid / 'done'
    try:
      want = json.loads(done.read_text())['records']
    except (OSError, ValueError, KeyError, TypeError):
      continue                     # not done (or an unreadable marker: left as it is)
    if counts.get(cid, 0) == want:
      continue
    case_file = sweep_dir / 'cases' / cid / 'results.jsonl'
    if case_file.exists() and len(read_results(case_file)) == want:
      restored.append(cid)
    else:
      done.unlink()
      reopened.append(cid)
  if restored or reopened:
    lost = set(restored) | set(reopened)
    kept = [r for r in records if r.get('case_id') not in lost]
    for cid in restored:
      kept += read_results(sweep_dir / 'cases' / cid / 'results.jsonl')
    _write_atomic(path, ''.join(json.dumps(r) + '\n' for r in kept))
    print(f'sweep: {path} lacked records of finished cases: {len(restored)} copied again from '
          f'their case files, {len(reopened)} to run again', flush=True)
  return restored + reopened


def _append(sweep_dir: pathlib.Path, name: str, record: dict) -> None:
  with _locked(sweep_dir), open(sweep_dir / name, 'a') as f:
    f.write(json.dumps(record) + '\n')


class _CaseResults(Results):
  """One case's Results; every record is also appended to the sweep's results.jsonl."""

  def __init__(self, case_dir, config, tags, sweep_dir, echo):
    super().__init__(case_dir, config, tags=tags, verbose=False)
    self._sweep_dir, self._echo = sweep_dir, echo

  def write(self, record: dict) -> None:
    super().write(record)
    _append(self._sweep_dir, 'results.jsonl', self.records[-1])
    if self._echo:
      tqdm.write(format_record(self.records[-1]))


def _run_case(module, cid, overrides, config, sweep_dir, echo) -> str:
  """Runs one case from scratch unless another process holds it or finished it meanwhile.

  Returns 'ran' (then marked done), 'failed' (raised; error recorded), 'busy' or 'skipped'.
  """
  case_dir = sweep_dir / 'cases' / cid
  case_dir.mkdir(parents=True, exist_ok=True)
  with open(case_dir / '.lock', 'a') as lock:  # released when this process dies
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return 'busy'
    if (case_dir / 'done').exists():
      return 'skipped'
    (case_dir / 'results.jsonl').write_text('')  # partial records of an interrupted try
    (case_dir / 'error.txt').unlink(missing_ok=True)
    with _locked(sweep_dir):
      _drop_lines(sweep_dir / 'results.jsonl', cid)
      _drop_lines(sweep_dir / 'failures.jsonl', cid)
    results = _CaseResults(case_dir, config, {'case_id': cid, **overrides}, sweep_dir, echo)
    try:
      module.run(config, results)
    except Exception as e:  # pylint: disable=broad-except  (one bad case must not stop the rest)
      (case_dir / 'error.txt').write_text(traceback.format_exc())
      _append(sweep_dir, 'failures.jsonl', {'case_id': cid, 'overrides': overrides,
                                            'error': f'{type(e).__name__}: {e}', 'time': _now()})
      tqdm.write(f'case {cid} FAILED: {type(e).__name__}: {e} (see {case_dir / "error.txt"})')
      return 'failed'
    _write_atomic(case_dir / 'done', json.dumps({'records': len(results.records), 'time': _now()}))
    return 'ran'


def run_sweep(config_path: str, workdir='runs', overrides: Optional[dict] = None,
              only: Iterable[str] = (), shard: Optional[str] = None,
              sweep_name: Optional[str] = None, progress: bool = True) -> SweepOutcome:
  """Runs the cases of a config's sweep not yet done, then writes the summary and plots.

  Args:
    config_path: 'configs/x.py' or 'configs/x.py:variant'; the file defines get_config and
      get_sweep, and get_config().experiment names the module experiments.EXPERIMENT.
    workdir: results go to WORKDIR/EXPERIMENT/SWEEP_NAME.
    overrides: {dotted.field: value} applied to the base config of every case (--config.x=).
    only: 'field=value' filters (see sweeps.parse_only); only matching cases run.
    shard: 'i/n': only cases whose index in the sweep is i modulo n; 'process': i/n from this
      process's JAX_PROCESS_ID / JAX_NUM_PROCESSES (independent cases, each process on its own
      devices; the distributed runtime is not started).
    sweep_name: the sweep directory's name; the same name resumes the same sweep. Default
      'sweep', or 'sweep-VARIANT' for 'configs/x.py:VARIANT' (a variant is another base config,
      and a sweep directory holds the cases of one: `configs/x.py:smoke` no longer collides with
      the full sweep's directory).
    progress: show a progress bar and echo records.
  Returns:
    A SweepOutcome; its exit_code is non-zero if a case (or the report) failed.
  Raises:
    ValueError: before any case runs, if the config file, the sweep, an override, --only or
      --shard is invalid (the message names the bad field or value).
    KeyboardInterrupt: passes through; the interrupted case is rerun by the next call.
  """
  if sweep_name is None:
    variant = config_path.partition(':')[2]            # as sweeps.load_sweep reads it
    sweep_name = f'sweep-{variant}' if variant else 'sweep'
  if not sweep_name or sweep_name in ('.', '..') or '/' in sweep_name or os.sep in sweep_name:
    raise ValueError(f'--sweep_name={sweep_name!r} must name one directory (not empty, ., .. or '
                     f'a path): the sweep lives in WORKDIR/EXPERIMENT/SWEEP_NAME')
  if shard == 'process':
    s = distributed.settings(need_coordinator=False)
    shard = f'{s.process_id}/{s.num_processes}'
  base, cases = sweeps.load_sweep(config_path)
  swept = sorted({field for case in cases for field in case} & set(overrides or {}))
  if swept:
    raise ValueError(f'--config.{swept[0]} names a field the sweep sets in every case '
                     f'({", ".join(swept)}): the override would be ignored; pick cases with '
                     f'--only={swept[0]}=VALUE instead')
  base = sweeps.apply_overrides(base, dict(overrides or {}))
  configs = sweeps.validate_sweep(base, cases)
  ids = [sweeps.case_id(c) for c in cases]
  picked = sweeps.select_cases(cases, only, shard)
  experiment = import_experiment(base.experiment)
  for i in picked:        # every case's values, before the first runs (a bad base fails once)
    try:
      validate(experiment, configs[i])
    except ValueError as error:
      raise ValueError(f'sweep case {i} ({ids[i]}): {error} (--only picks the cases to run)'
                       ) from error

  sweep_dir = pathlib.Path(workdir) / base.experiment / sweep_name
  sweep_dir.mkdir(parents=True, exist_ok=True)
  base_json = base.to_json_best_effort(indent=2) + '\n'
  with _locked(sweep_dir):
    _check_same_base(sweep_dir, base_json)
    _write_atomic(sweep_dir / 'config.json', base_json)
    _write_atomic(sweep_dir / 'sweep.json', json.dumps(
        [{'index': i, 'case_id': ids[i], 'overrides': c} for i, c in enumerate(cases)], indent=1))
    _drop_lines(sweep_dir / 'results.jsonl', None)  # a torn last line from a killed run
    _restore_done_cases(sweep_dir, ids)
  outcome = SweepOutcome(sweep_dir, [ids[i] for i in picked], [], [], [], [], [])
  outcome.skipped = [ids[i] for i in picked if (sweep_dir / 'cases' / ids[i] / 'done').exists()]
  todo = [i for i in picked if ids[i] not in outcome.skipped]
  print(f'sweep -> {sweep_dir}: {len(picked)} case{"s" * (len(picked) != 1)} selected, '
        f'{len(outcome.skipped)} done, '
        f'{len(todo)} to run', flush=True)
  bar = tqdm(todo, total=len(picked), initial=len(outcome.skipped), unit='case',
             disable=not progress)
  for i in bar:
    bar.set_postfix_str(ids[i])
    status = _run_case(experiment, ids[i], cases[i], configs[i], sweep_dir, progress)
    # Free the case's compiled steps: a long sweep's executables otherwise pile up until the
    # compiler can no longer map memory (seen at ~400 engine step variants on the CPU).
    gc.collect()
    jax.clear_caches()
    getattr(outcome, 'ran' if status == 'failed' else status).append(ids[i])
    if status == 'failed':
      outcome.failed.append(ids[i])
  bar.close()
  _report(outcome, ids, base.experiment)
  return outcome


def _report(outcome: SweepOutcome, ids: list[str], experiment: str) -> None:
  """Summary table and plots of every record of the sweep, in sweep order."""
  path = outcome.sweep_dir / 'results.jsonl'
  with _locked(outcome.sweep_dir):
    records = read_results(path) if path.exists() else []
  # Only finished cases: a case interrupted (or still running in another shard) is not reported.
  done = {cid for cid in ids if (outcome.sweep_dir / 'cases' / cid / 'done').exists()}
  records = [r for r in records if r.get('case_id') in done]
  order = {cid: n for n, cid in enumerate(ids)}
  outcome.records = sorted(records, key=lambda r: order.get(r.get('case_id'), len(order)))
  try:
    with _locked(outcome.sweep_dir):
      report.summarize(outcome.records, path.with_name('summary.md'), path.with_name('summary.csv'))
      report.plot(outcome.records, outcome.sweep_dir / 'plots', experiment)
      report.experiment_summary(outcome.records, outcome.sweep_dir, experiment)
  except Exception:  # pylint: disable=broad-except  (the results are safe on disk regardless)
    outcome.report_error = traceback.format_exc()
    print(f'report failed; redo with python -m experiments.report {path}\n'
          f'{outcome.report_error}', file=sys.stderr)
  failed = f': {", ".join(outcome.failed)}' if outcome.failed else ''
  print(f'{len(outcome.ran)} case{"s" * (len(outcome.ran) != 1)} ran, '
        f'{len(outcome.failed)} failed{failed}; '
        f'summary in {path.with_name("summary.md")}', flush=True)


def define_flags() -> None:
  """Defines the CLI flags; called only when run as a program, so imports define no flags."""
  try:  # with the default config file, overrides are applied here, at definition
    config_flags.DEFINE_config_file('config', DEFAULT_CONFIG,
                                    'Config file (path[:variant]) with get_sweep().',
                                    lock_config=True)
  except (AttributeError, KeyError) as error:
    exit_unknown_field(error, sys.argv)
  except OSError as error:   # an override of the default config, which could not be loaded
    exit_config_error(error)
  flags.DEFINE_string('workdir', 'runs', 'Root directory; the sweep goes to WORKDIR/EXPERIMENT/.')
  flags.DEFINE_string('sweep_name', None, "Sweep directory name; the same name resumes (default "
                      "'sweep', or 'sweep-VARIANT' for --config=FILE:VARIANT).")
  flags.DEFINE_multi_string('only', [], 'field=value: run only matching cases (repeatable).')
  flags.DEFINE_string('shard', None, 'i/n: run only cases whose index % n == i; "process": i/n '
                      'from $JAX_PROCESS_ID / $JAX_NUM_PROCESSES.')
  flags.DEFINE_bool('traceback', False, 'Show the traceback of a bad-input error (default: one '
                    'FATAL line naming the bad value; a failing case is recorded either way).')


def main(argv) -> int:
  """absl entry point: runs the sweep the flags describe; returns the exit status."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint read at INFO
  f = flags.FLAGS
  try:
    outcome = run_sweep(config_flags.get_config_filename(f['config']), f.workdir,
                        overrides=config_flags.get_override_values(f['config']),
                        only=f.only, shard=f.shard, sweep_name=f.sweep_name)
  except ValueError as e:                 # bad input: one line, as experiments.run
    if f.traceback:
      raise
    sys.exit(f'FATAL: {e}')
  except OSError as e:   # the sweep directory: a file in the way, no permission, read-only
    if f.traceback:
      raise
    sys.exit(f'FATAL: cannot use the sweep directory under --workdir={f.workdir}: {e}')
  return outcome.exit_code


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=parse_flags)
