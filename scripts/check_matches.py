"""Fail unless every equality check recorded in results files holds (CI's exactness gate).

    python scripts/check_matches.py RESULTS.jsonl [RESULTS.jsonl ...]

The checks are a record's fields named `matches_*` or `*_matches` that are not null:
speculative's `matches_autoregressive`, batching's `matches_baseline`, prefix caching's
`matches_off`, hydration's `replay_matches`. Each must be true. `.ci/run` runs the speculative and
batching smokes with `exact_verify=True` under XLA's default compile settings (the experiments'
own, not the tests') and gives their results here, so the bit-for-bit claim of README *Exact
numerics* is checked where the experiments run.

Exit status: 0 when every check held (it prints how many); 1 naming each record (by file and
line) and field that did not, each line that is not a JSON record (torn or damaged: a lost
result), and each file that holds no check at all (a gate that checked nothing must not pass);
2 for a file that cannot be read, or no file named.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments.records import json_object, results_text  # noqa: E402

LABEL = ('batch_size', 'workload', 'setting', 'k', 'temperature', 'repeat')


def is_check(field: str) -> bool:
  """Whether a record field is an equality check (`matches_*` or `*_matches`)."""
  return field.startswith('matches_') or field.endswith('_matches')


def failures(paths) -> tuple[int, list[str]]:
  """(checks that held, one line per failure) over the lines of `paths`. A failure is a check
  that is not true, a line that is not a JSON record (a torn or damaged record is a lost result,
  which a gate must not pass over), or a file holding no check at all.

  Raises:
    OSError: a file that cannot be read; ValueError: one that is not a results file
      (`experiments.records.results_text`: UTF-8 text, gzip data where named *.gz).
  """
  held, failed = 0, []
  for path in paths:
    lines = results_text(path).splitlines()
    checked = 0
    for number, line in enumerate(lines, start=1):
      if not line.strip():
        continue
      record = json_object(line)
      if record is None:
        failed.append(f'{path} line {number}: not a JSON record')
        continue
      for field, value in record.items():
        if not is_check(field) or value is None:
          continue
        checked += 1
        if value is True:
          held += 1
        else:
          where = ', '.join(f'{k}={record[k]}' for k in LABEL if k in record)
          failed.append(f'{path} line {number} ({where}): {field} = {value!r}')
    if not checked:
      failed.append(f'{path}: no equality check (every check field null or absent)')
  return held, failed


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('results', nargs='+', help='results.jsonl files')
  paths = parser.parse_args(argv).results
  try:
    held, failed = failures(paths)
  except (OSError, ValueError) as error:
    print(f'check_matches: {error}', file=sys.stderr)
    return 2
  for line in failed:
    print(f'FAILED {line}')
  print(f'equality checks: {held} held, {len(failed)} failed')
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
