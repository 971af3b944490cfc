"""Fail unless every equality check recorded in results files holds (CI's exactness gate).

    python scripts/check_matches.py RESULTS.jsonl [RESULTS.jsonl ...]

The checks are a record's fields named `matches_*` or `*_matches` that are not null:
speculative's `matches_autoregressive`, batching's `matches_baseline`, prefix caching's
`matches_off`, hydration's `replay_matches`. Each must be true. `.ci/run` runs the speculative and
batching smokes with `exact_verify=True` under XLA's default compile settings (the experiments'
own, not the tests') and gives their results here, so the bit-for-bit claim of README *Exact
numerics* is checked where the experiments run.

Exit status: 0 when every check held (it prints how many); 1 naming each record and field that
did not, or when the files hold no check at all (a gate that checked nothing must not pass);
2 for a file that cannot be read, or no file named.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# This checkout's code first (as `python -m` from the repository root), not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments.records import read_results  # noqa: E402


def is_check(field: str) -> bool:
  """Whether a record field is an equality check (`matches_*` or `*_matches`)."""
  return field.startswith('matches_') or field.endswith('_matches')


def failures(paths) -> tuple[int, list[str]]:
  """(checks that held, one line per check that did not) over the records of `paths`.

  Raises:
    OSError, ValueError: a file that cannot be read as a results file (`read_results`).
  """
  held, failed = 0, []
  for path in paths:
    for number, record in enumerate(read_results(path), start=1):
      for field, value in record.items():
        if not is_check(field) or value is None:
          continue
        if value is True:
          held += 1
        else:
          where = ', '.join(f'{k}={record[k]}' for k in ('workload', 'setting', 'k')
                            if k in record)
          failed.append(f'{path} record {number} ({where}): {field} = {value!r}')
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
  if not held and not failed:
    print(f'check_matches: no equality check in {", ".join(paths)}')
    return 1
  print(f'{held} equality checks held, {len(failed)} failed')
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
