"""Corpora of real text that nobody on this project wrote, split held-out by file.

Two kinds of document, both read from packages already installed beside Python:

* ``'code'``: the Python standard library's own ``.py`` sources.
* ``'json'``: botocore's AWS service definitions (``service-2``, ``paginators-1``, ``waiters-2``,
  ``examples-1`` and their ``sdk-extras``), many stored gzipped.

Choices made here (each one a constant below, so an experiment can quote it):

* Text is kept exactly as the file holds it (UTF-8 decoded, gzip undone); JSON is *not*
  re-serialised, so the model sees the files' own indentation and key order.
* Files outside a size window are skipped, never truncated: code 1 KB-200 KB, JSON 200 B-300 KB
  (decoded size). This drops botocore's ~90 largest service models (EC2, SageMaker...), which
  would otherwise be most of the JSON bytes, and its empty ``{"examples":{}}`` skeletons.
* Skipped as generated or not "source": stdlib ``site-packages``, every ``test``/``tests``
  directory (lib2to3's test data lives there), ``idlelib``, ``encodings`` (codec tables
  generated from charmaps), ``config-*`` and ``_sysconfigdata*`` (machine-specific build
  settings); botocore's ``endpoint-rule-set-1`` files (one
  machine-written template repeated ~450 times) and ``endpoints.json``.
* Splits hash (SHA-256) a path relative to its corpus root, so they are stable across machines
  and Python versions. Code is split per file. JSON is split per *service directory*: the
  paginators, waiters and examples of a service quote its ``service-2`` shapes, and services
  ship several near-identical API versions, so splitting per file would leak test text into
  training.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import pathlib
import sysconfig

KINDS = ('code', 'json')
SPLITS = ('train', 'val', 'test')
SPLIT_PERCENT = {'train': 90, 'val': 5, 'test': 5}

CODE_BYTES = (1_000, 200_000)  # [min, max] decoded bytes kept.
JSON_BYTES = (200, 300_000)
_CODE_SKIP_DIRS = frozenset({'site-packages', 'test', 'tests', 'idlelib', 'encodings',
                             '__pycache__'})
_JSON_SKIP_NAMES = ('endpoint-rule-set-1', 'endpoints.json')


@dataclasses.dataclass(frozen=True)
class Document:
  """One file of a corpus.

  kind: 'code' or 'json'; name: path relative to the corpus root (POSIX, '.gz' kept);
  text: the file's decoded text.
  """
  kind: str
  name: str
  text: str


def code_root() -> pathlib.Path:
  """Directory holding the Python standard library sources."""
  return pathlib.Path(sysconfig.get_paths()['stdlib'])


def json_root() -> pathlib.Path:
  """botocore's ``data/`` directory (imported lazily: botocore is only a data source)."""
  import botocore  # pylint: disable=g-import-not-at-top
  return pathlib.Path(botocore.__file__).parent / 'data'


def _decoded_size(path: pathlib.Path) -> int:
  """Bytes after gunzip; read from the gzip trailer (ISIZE, exact below 4 GiB), not by inflating."""
  if path.suffix != '.gz':
    return path.stat().st_size
  with open(path, 'rb') as f:
    f.seek(-4, 2)
    return int.from_bytes(f.read(4), 'little')


def code_files() -> list[pathlib.Path]:
  """Stdlib ``.py`` files kept for the 'code' corpus, sorted (see module docstring for filters).

  Which files exist depends on the installed Python version; the split of a given file does not.
  """
  return list(_code_files())


@functools.lru_cache(maxsize=None)
def _code_files() -> tuple[pathlib.Path, ...]:
  root = code_root()
  lo, hi = CODE_BYTES
  out = []
  for path in root.rglob('*.py'):
    parts = path.relative_to(root).parts[:-1]
    if any(p in _CODE_SKIP_DIRS or p.startswith('config-') for p in parts):
      continue
    if path.name.startswith('_sysconfigdata'):
      continue
    if path.is_file() and lo <= _decoded_size(path) <= hi:
      out.append(path)
  return tuple(sorted(out))


def json_files() -> list[pathlib.Path]:
  """botocore ``.json`` / ``.json.gz`` definition files kept for the 'json' corpus, sorted.

  Size limits apply to the decoded (gunzipped) size. Which files exist depends on the installed
  botocore version; the split of a given file does not.
  """
  return list(_json_files())


@functools.lru_cache(maxsize=None)
def _json_files() -> tuple[pathlib.Path, ...]:
  root = json_root()
  lo, hi = JSON_BYTES
  out = []
  for path in root.rglob('*'):
    name = path.name
    if not (name.endswith('.json') or name.endswith('.json.gz')):
      continue
    if any(name.startswith(s) for s in _JSON_SKIP_NAMES) or not path.is_file():
      continue
    if lo <= _decoded_size(path) <= hi:
      out.append(path)
  return tuple(sorted(out))


def read_text(path: pathlib.Path | str) -> str:
  """The file's text exactly as stored: gunzipped if it ends in '.gz', decoded as UTF-8.

  Bytes that are not valid UTF-8 become U+FFFD (the kept files are all valid UTF-8).
  Raises FileNotFoundError if the path does not exist.
  """
  data = pathlib.Path(path).read_bytes()
  if str(path).endswith('.gz'):
    data = gzip.decompress(data)
  return data.decode('utf-8', errors='replace')


def split_of(path: pathlib.Path | str, root: pathlib.Path | str) -> str:
  """'train' | 'val' | 'test' for ``path``, from SHA-256 of its POSIX path relative to ``root``.

  The first 8 digest bytes, mod 100, fall into SPLIT_PERCENT's buckets (90/5/5). Pure function of
  the relative path string: stable across machines, Python versions and PYTHONHASHSEED.
  Raises ValueError if ``path`` is not under ``root``.
  """
  rel = pathlib.PurePath(path).relative_to(root).as_posix()
  bucket = int.from_bytes(hashlib.sha256(rel.encode('utf-8')).digest()[:8], 'big') % 100
  if bucket < SPLIT_PERCENT['train']:
    return 'train'
  if bucket < SPLIT_PERCENT['train'] + SPLIT_PERCENT['val']:
    return 'val'
  return 'test'


def _check(kind: str, split: str) -> None:
  if kind not in KINDS:
    raise ValueError(f'unknown corpus kind {kind!r}; expected one of {KINDS}')
  if split not in SPLITS:
    raise ValueError(f'unknown split {split!r}; expected one of {SPLITS}')


def files_of(kind: str, split: str) -> list[pathlib.Path]:
  """Sorted paths of ``kind`` ('code'|'json') in ``split`` ('train'|'val'|'test').

  JSON files are assigned by their top-level (service) directory. Raises ValueError naming an
  unknown kind or split.
  """
  _check(kind, split)
  if kind == 'code':
    root = code_root()
    return [p for p in code_files() if split_of(p, root) == split]
  root = json_root()
  return [p for p in json_files() if split_of(root / p.relative_to(root).parts[0], root) == split]


@functools.lru_cache(maxsize=8)
def _documents(kind: str, split: str) -> tuple[Document, ...]:
  root = code_root() if kind == 'code' else json_root()
  return tuple(Document(kind, p.relative_to(root).as_posix(), read_text(p))
               for p in files_of(kind, split))


def documents(kind: str, split: str) -> list[Document]:
  """All documents of ``kind`` ('code'|'json') in ``split`` ('train'|'val'|'test'), by name.

  Reads the files once per process (cached). Raises ValueError naming an unknown kind or split.
  """
  _check(kind, split)
  return list(_documents(kind, split))
