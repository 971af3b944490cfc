"""Run every case of a config's sweep (its `get_sweep()`), resumably, then summarize and plot.

    python -m experiments.sweep --config=configs/speculative.py --workdir=/tmp/sweep
    python -m experiments.sweep --config=configs/speculative.py:smoke --config.num_prompts=2
    python -m experiments.sweep --config=configs/speculative.py --only=k=4 --only=temperature=0.0
    python -m experiments.sweep --config=configs/speculative.py --shard=0/2   # and 1/2 elsewhere

Everything lands in WORKDIR/EXPERIMENT/SWEEP_NAME/: config.json (base), sweep.json (all cases),
results.jsonl (every record, tagged with case_id and the overrides), failures.jsonl,
summary.md, summary.csv, plots/*.png, and cases/CASE_ID/{config.json, results.jsonl, done,
error.txt}. A case counts as measured once its `done` marker exists; running the same command
again skips those, and first drops any partial records of the case it reruns, so every case
appears exactly once. Failed cases are retried on the next run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import importlib
import importlib.util
import json
import os
import pathlib
import sys
import traceback
from typing import Iterable, Optional

from tqdm import tqdm

from experiments import report, sweeps
from experiments.common import Results, format_record, read_results


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


def load_config_file(spec: str):
  """Loads a config file given as `path[:variant]`; returns (module, base ConfigDict).

  Raises:
    ValueError: the file does not exist.
  """
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise ValueError(f'config file {path!r} not found')
  name = '_sweep_config_' + pathlib.Path(path).stem
  module_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module, (module.get_config(arg) if arg else module.get_config())


@contextlib.contextmanager
def _locked(sweep_dir: pathlib.Path):
  """Exclusive lock on the sweep's shared files (several shards may write at once)."""
  with open(sweep_dir / '.lock', 'a') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: pathlib.Path, text: str) -> None:
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(text)
  os.replace(tmp, path)


def _drop_lines(path: pathlib.Path, cid: Optional[str]) -> None:
  """Rewrites a .jsonl file without torn lines and without the lines of case `cid`."""
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  kept = []
  for line in lines:
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if cid is None or record.get('case_id') != cid:
      kept.append(line if line.endswith('\n') else line + '\n')
  if kept != lines:
    _write_atomic(path, ''.join(kept))


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


def _run_case(module, cid, overrides, config, sweep_dir, echo) -> bool:
  """Runs one case from scratch; True if it finished (then marked done), False if it raised."""
  case_dir = sweep_dir / 'cases' / cid
  (case_dir / 'results.jsonl').write_text('')  # partial records of an interrupted try
  (case_dir / 'error.txt').unlink(missing_ok=True)
  with _locked(sweep_dir):
    _drop_lines(sweep_dir / 'results.jsonl', cid)
    _drop_lines(sweep_dir / 'failures.jsonl', cid)
  results = _CaseResults(case_dir, config, {'case_id': cid, **overrides}, sweep_dir, echo)
  try:
    module.run(config, results)
  except Exception as e:  # pylint: disable=broad-except  (one bad case must not stop the sweep)
    tb = traceback.format_exc()
    (case_dir / 'error.txt').write_text(tb)
    _append(sweep_dir, 'failures.jsonl', {'case_id': cid, 'overrides': overrides,
                                          'error': f'{type(e).__name__}: {e}', 'time': _now()})
    tqdm.write(f'case {cid} FAILED: {type(e).__name__}: {e} (see {case_dir / "error.txt"})')
    return False
  _write_atomic(case_dir / 'done', json.dumps({'records': len(results.records), 'time': _now()}))
  return True


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def run_sweep(config_path: str, workdir='runs', overrides: Optional[dict] = None,
              only: Iterable[str] = (), shard: Optional[str] = None, sweep_name: str = 'sweep',
              progress: bool = True) -> SweepOutcome:
  """Runs the cases of a config's sweep not yet done, then writes the summary and plots.

  Args:
    config_path: 'configs/x.py' or 'configs/x.py:variant'; the file defines get_config and
      get_sweep, and get_config().experiment names the module experiments.EXPERIMENT.
    workdir: results go to WORKDIR/EXPERIMENT/SWEEP_NAME.
    overrides: {dotted.field: value} applied to the base config of every case (--config.x=).
    only: 'field=value' filters (see sweeps.parse_only); only matching cases run.
    shard: 'i/n': only cases whose index in the sweep is i modulo n.
    sweep_name: the sweep directory's name; the same name resumes the same sweep.
    progress: show a progress bar and echo records.
  Returns:
    A SweepOutcome; its exit_code is non-zero if a case (or the report) failed.
  Raises:
    ValueError: before any case runs, if the config file, the sweep, an override, --only or
      --shard is invalid (the message names the bad field or value).
    KeyboardInterrupt: passes through; the interrupted case is rerun by the next call.
  """
  module_cfg, base = load_config_file(config_path)
  if not hasattr(module_cfg, 'get_sweep'):
    raise ValueError(f'{config_path} has no get_sweep()')
  base = sweeps.apply_overrides(base, dict(overrides or {}))
  cases = module_cfg.get_sweep()
  configs = sweeps.validate_sweep(base, cases)
  ids = [sweeps.case_id(c) for c in cases]
  filters, shard_in = sweeps.parse_only(only), sweeps.parse_shard(shard)
  swept = {field for case in cases for field in case}
  for field in filters:
    if field not in swept:
      raise ValueError(f'--only field {field!r} is not swept (swept: {", ".join(sorted(swept))})')
  picked = [i for i, case in enumerate(cases) if sweeps.matches(case, filters)
            and (shard_in is None or i % shard_in[1] == shard_in[0])]
  if not picked:
    raise ValueError(f'no case matches --only={list(only)} --shard={shard}')
  experiment = importlib.import_module(f'experiments.{base.experiment}')

  sweep_dir = pathlib.Path(workdir) / base.experiment / sweep_name
  sweep_dir.mkdir(parents=True, exist_ok=True)
  _write_atomic(sweep_dir / 'config.json', base.to_json_best_effort(indent=2) + '\n')
  _write_atomic(sweep_dir / 'sweep.json', json.dumps(
      [{'index': i, 'case_id': ids[i], 'overrides': cases[i]} for i in range(len(cases))],
      indent=1) + '\n')
  with _locked(sweep_dir):
    _drop_lines(sweep_dir / 'results.jsonl', None)  # a torn last line from a killed run
  done = [i for i in picked if (sweep_dir / 'cases' / ids[i] / 'done').exists()]
  outcome = SweepOutcome(sweep_dir, [ids[i] for i in picked], [], [ids[i] for i in done], [], [],
                         [])
  todo = [i for i in picked if i not in done]
  print(f'sweep -> {sweep_dir}: {len(picked)} cases selected, {len(done)} done, '
        f'{len(todo)} to run', flush=True)
  bar = tqdm(todo, total=len(picked), initial=len(done), unit='case', disable=not progress)
  for i in bar:
    bar.set_postfix_str(ids[i])
    case_dir = sweep_dir / 'cases' / ids[i]
    case_dir.mkdir(parents=True, exist_ok=True)
    with open(case_dir / '.lock', 'a') as lock:
      try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        outcome.busy.append(ids[i])
        continue
      if (case_dir / 'done').exists():  # finished by another process meanwhile
        outcome.skipped.append(ids[i])
        continue
      outcome.ran.append(ids[i])
      if not _run_case(experiment, ids[i], cases[i], configs[i], sweep_dir, progress):
        outcome.failed.append(ids[i])
  bar.close()
  _report(outcome, ids, base.experiment)
  return outcome


def _report(outcome: SweepOutcome, ids: list[str], experiment: str) -> None:
  """Summary table and plots of every record of the sweep, in sweep order."""
  sweep_dir = outcome.sweep_dir
  with _locked(sweep_dir):
    path = sweep_dir / 'results.jsonl'
    records = read_results(path) if path.exists() else []
  order = {cid: n for n, cid in enumerate(ids)}
  outcome.records = sorted(records, key=lambda r: order.get(r.get('case_id'), len(order)))
  try:
    report.summarize(outcome.records, sweep_dir / 'summary.md', sweep_dir / 'summary.csv')
    report.plot(outcome.records, sweep_dir / 'plots', experiment)
  except Exception:  # pylint: disable=broad-except  (the results are safe on disk regardless)
    outcome.report_error = traceback.format_exc()
    print(f'report failed (rerun: python -m experiments.report {path}):\n'
          f'{outcome.report_error}', file=sys.stderr)
  print(f'{len(outcome.ran)} cases ran, {len(outcome.failed)} failed'
        f'{": " + ", ".join(outcome.failed) if outcome.failed else ""}; '
        f'summary in {sweep_dir / "summary.md"}', flush=True)


def define_flags() -> None:
  """Defines the CLI flags (only when run as a program, so importing this module defines none)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file('config', 'configs/speculative.py',
                                  'Config file (path[:variant]) defining get_sweep().',
                                  lock_config=True)
  flags.DEFINE_string('workdir', 'runs', 'Root directory; the sweep goes to WORKDIR/EXPERIMENT/.')
  flags.DEFINE_string('sweep_name', 'sweep', 'Sweep directory name; the same name resumes.')
  flags.DEFINE_multi_string('only', [], 'field=value: run only matching cases (repeatable).')
  flags.DEFINE_string('shard', None, 'i/n: run only cases whose index % n == i.')


def main(argv) -> int:
  """absl entry point: runs the sweep the flags describe; returns the exit status."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  try:
    outcome = run_sweep(config_flags.get_config_filename(f['config']), f.workdir,
                        overrides=config_flags.get_override_values(f['config']),
                        only=f.only, shard=f.shard, sweep_name=f.sweep_name)
  except ValueError as e:
    sys.exit(f'sweep: {e}')
  return outcome.exit_code


if __name__ == '__main__':
  from absl import app as _app  # pylint: disable=g-import-not-at-top
  define_flags()
  _app.run(main)
