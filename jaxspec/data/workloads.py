"""Held-out prompts for speculative-decoding evaluation, three workloads.

* ``'json'``: a window of real botocore JSON; the continuation is the file's next tokens.
* ``'code'``: the same over stdlib Python sources.
* ``'retrieval'``: copy-heavy. A document chunk, then an instruction to quote a passage, then
  the passage's first few tokens::

      <chunk of a held-out code or JSON file>

      # Quote the passage that starts with: "<first tokens of a line in the chunk>"
      <those same first tokens>

  so the natural continuation copies from the chunk; prompt-lookup / n-gram drafters shine here.

Choices are hashed (SHA-256 of seed, workload and file name), not drawn from a PRNG, so a seed
gives the same prompts on every machine. Prompt i comes from the i-th file of that hashed order,
wrapping round to new windows of the same files only when there are fewer files than prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib

from jaxspec.checks import check_int, check_seed, is_int_in
from jaxspec.data import corpus
from jaxspec.data.tokenizer import Tokenizer

WORKLOADS = ('json', 'code', 'retrieval')
REFERENCE_LEN = 256  # Tokens of real continuation kept in Prompt.reference.
QUOTE_LEN = 8  # Most tokens quoted to start a retrieval passage.
MIN_QUOTE_LEN = 4
MIN_RETRIEVAL_PROMPT = 48  # Least retrieval prompt_len: instruction + quote take 25-45 tokens.
CHUNK_FRACTION = 0.8  # Retrieval: document chunk ~ this fraction of prompt_len.
SEPARATOR = '\n\n# Quote the passage that starts with: "{quote}"\n'


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One evaluation prompt.

  workload: one of WORKLOADS. name: '<kind>:<file>@<token offset>', unique per prompt.
  tokens: the prompt ids (no bos). reference: the real continuation (<= REFERENCE_LEN ids), for
  information only; drafters and targets never see it.
  """
  workload: str
  name: str
  tokens: tuple[int, ...]
  reference: tuple[int, ...]


def _hash(*parts: object) -> int:
  return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], 'big')


def _ordered_docs(kinds: tuple[str, ...], split: str, seed: int, workload: str):
  docs = [d for k in kinds for d in corpus.documents(k, split)]
  return sorted(docs, key=lambda d: _hash(seed, workload, d.kind, d.name))


def _window_prompt(workload, doc, ids, round_, seed, prompt_len) -> Prompt | None:
  """prompt_len ids at a hashed offset, then up to REFERENCE_LEN more (at least 1)."""
  room = len(ids) - prompt_len - 1
  if room < 0:
    return None
  off = _hash(seed, workload, doc.name, round_) % (room + 1)
  return Prompt(workload, f'{doc.kind}:{doc.name}@{off}', tuple(ids[off:off + prompt_len]),
                tuple(ids[off + prompt_len:off + prompt_len + REFERENCE_LEN]))


def _retrieval_prompt(tokenizer, doc, ids, round_, seed, prompt_len) -> Prompt | None:
  """Chunk + separator + quote start; None if the document has no usable line to quote."""
  chunk_len = int(prompt_len * CHUNK_FRACTION)
  if len(ids) < chunk_len:
    return None
  off = _hash(seed, 'retrieval', doc.name, round_) % (len(ids) - chunk_len + 1)
  chunk = ids[off:off + chunk_len]
  pieces = [tokenizer.decode([t]) for t in chunk]
  # Quote starts: a token right after a newline, inside the first half of the chunk (so most of
  # the passage is left to copy), beginning a run of >= MIN_QUOTE_LEN tokens with no newline
  # that occurs exactly once in the chunk (so the copy target is unambiguous).
  candidates = []
  for q in range(max(1, chunk_len // 8), chunk_len // 2):
    if '\n' not in pieces[q - 1] or not pieces[q].strip():
      continue
    n = 0
    while n < QUOTE_LEN and '\n' not in pieces[q + n]:
      n += 1
    quote = chunk[q:q + n]
    if n >= MIN_QUOTE_LEN and _count(chunk, quote) == 1:
      candidates.append((q, n))
  for q, n in sorted(candidates, key=lambda c: _hash(seed, doc.name, round_, c)):
    quote = chunk[q:q + n]
    # The instruction shows the quote without its leading space; the prompt then ends with
    # the quote's own tokens, exactly as they appear in the chunk.
    tail = tokenizer.encode(SEPARATOR.format(quote=tokenizer.decode(quote).strip())) + quote
    keep = min(chunk_len, prompt_len - len(tail))
    if q + n + MIN_QUOTE_LEN > keep:  # Trimming the chunk's end must leave a passage to copy.
      continue
    return Prompt('retrieval', f'{doc.kind}:{doc.name}@{off}', tuple(chunk[:keep] + tail),
                  tuple(chunk[q + n:keep][:REFERENCE_LEN]))
  return None


def _count(seq: list[int], sub: list[int]) -> int:
  n = len(sub)
  return sum(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


def check_prompt_len(workload: str, prompt_len, name: str = 'prompt_len') -> int:
  """`prompt_len` (tokens) as an int, checked for `workload`: >= 1, and >= MIN_RETRIEVAL_PROMPT
  for retrieval (its instruction and quote take 25-45 tokens).

  Raises:
    ValueError: naming `name`, the value and the workload.
  """
  least = MIN_RETRIEVAL_PROMPT if workload == 'retrieval' else 1
  if not is_int_in(prompt_len, least, 2 ** 63):
    raise ValueError(f'{name} must be an int >= {least} for {workload!r}, got {prompt_len!r}')
  return int(prompt_len)


def make_prompts(workload: str, tokenizer: Tokenizer, num_prompts: int, prompt_len: int,
                 split: str = 'test', seed: int = 0) -> list[Prompt]:
  """``num_prompts`` held-out prompts of ``workload`` ('json' | 'code' | 'retrieval').

  json / code: each prompt is exactly ``prompt_len`` tokens. retrieval: at most ``prompt_len``
  (the chunk is trimmed so chunk + separator + quote fit). References hold up to REFERENCE_LEN
  tokens. Deterministic in (workload, tokenizer, num_prompts, prompt_len, split, seed); prompts come
  from distinct files while the split has enough files that fit.

  Raises ValueError for an unknown workload or split, num_prompts not an int >= 1, prompt_len not
  an int >= 1 (retrieval: >= 48), a seed not a 64-bit int, or a split with no file long enough
  (retrieval's instruction + quote take 25-45 tokens, so prompt_len < 96 leaves little document
  and may find too few prompts).
  """
  if workload not in WORKLOADS:
    raise ValueError(f'unknown workload {workload!r}; expected one of {WORKLOADS}')
  num_prompts = check_int('num_prompts', num_prompts, 1)
  prompt_len = check_prompt_len(workload, prompt_len)
  seed = check_seed(seed)     # a Python int: the hashed repr of np.int64(0) is not that of 0
  kinds = corpus.KINDS if workload == 'retrieval' else (workload,)
  docs = _ordered_docs(kinds, split, seed, workload)
  token_cache: dict[str, list[int]] = {}
  prompts: list[Prompt] = []
  names: set = set()          # of the prompts so far (a list scan made this quadratic)
  for round_ in range(max(4, num_prompts)):  # Extra rounds reuse files at new offsets.
    made_any = False
    for doc in docs:
      key = f'{doc.kind}:{doc.name}'
      if key not in token_cache:
        token_cache[key] = tokenizer.encode(doc.text)
      ids = token_cache[key]
      if workload == 'retrieval':
        p = _retrieval_prompt(tokenizer, doc, ids, round_, seed, prompt_len)
      else:
        p = _window_prompt(workload, doc, ids, round_, seed, prompt_len)
      if p is None or p.name in names:
        continue
      made_any = True
      prompts.append(p)
      names.add(p.name)
      if len(prompts) == num_prompts:
        return prompts
    if not made_any and round_ > 0:
      break
  raise ValueError(f'split {split!r} yields only {len(prompts)} {workload!r} prompts of '
                   f'{prompt_len} tokens, {num_prompts} requested')
