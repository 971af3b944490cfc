"""Names of full pages for prefix caching: a SHA-256 chain

    key_i = SHA-256(key_{i-1} || salt || token ids of page i)

so a key names the page *and everything before it* (vLLM's automatic prefix caching hashes
blocks the same way); a salt isolates tenants (different salts never share a page). A plain
Python `hash` would be predictable and lets one tenant poison another's cache, hence SHA-256.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from jaxspec.checks import check_int, token_ids

_ROOT = bytes(32)  # parent key of a sequence's first page


def salt_bytes(salt) -> bytes:
  """A prefix-cache salt as bytes (str is UTF-8 encoded).

  Raises:
    ValueError: anything but str or bytes.
  """
  if isinstance(salt, str):
    return salt.encode()
  if isinstance(salt, (bytes, bytearray)):
    return bytes(salt)
  raise ValueError(f'cache salt must be str or bytes, got {type(salt).__name__} {salt!r}')


def page_keys(tokens: Sequence[int], page_size: int, salt: bytes | str = b'') -> list[bytes]:
  """SHA-256 chain keys of every *full* page of `tokens` (a trailing partial page has none).

  Args:
    tokens: token ids (ints >= 0).
    page_size: L, tokens per page.
    salt: optional cache salt (bytes or str); keys of different salts never collide.
  Returns:
    len(tokens) // page_size keys of 32 bytes each (bytes), one per full page, in order.
  Raises:
    ValueError: page_size not an int >= 1, a token id that is not an int in [0, 2**63), or a
      salt that is not str / bytes (each named).
  """
  return page_keys_unchecked(token_ids(tokens, 'tokens'), check_int('page_size', page_size, 1),
                    salt_bytes(salt))


def page_keys_unchecked(tokens: list, page_size: int, salt: bytes) -> list[bytes]:
  """`page_keys` of arguments already checked (the prefix cache's own calls)."""
  salt_part = struct.pack('<I', len(salt)) + salt
  keys, parent = [], _ROOT
  for i in range(len(tokens) // page_size):
    page = tokens[i * page_size:(i + 1) * page_size]
    digest = hashlib.sha256(parent + salt_part + struct.pack(f'<{page_size}q', *page)).digest()
    keys.append(digest)
    parent = digest
  return keys
