"""Host-side page allocator: a free list with reference counts (vLLM's block manager, in brief).

Plain Python over integers; never touches device arrays. Page 0 is the null page and is never
handed out.
"""

from __future__ import annotations

import math

from jaxspec.cache.paged import NULL_PAGE
from jaxspec.checks import is_int_in


class OutOfPagesError(ValueError):
  """The pool has fewer free pages than a request needs."""


class PageAllocator:
  """Hands out pool pages 1 .. num_pages-1 and tracks how many holders each page has.

  Every page is in exactly one state: free (ref count 0, on the free list) or held (ref count
  >= 1). Shared prefix pages are held by several sequences at once.
  """

  def __init__(self, num_pages: int):
    if not is_int_in(num_pages, 2, math.inf):
      raise ValueError(f'num_pages must be an int >= 2 (page 0 is the null page), got '
                       f'{num_pages!r}')
    num_pages = int(num_pages)
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out low pages first
    self._refs = [0] * num_pages

  @property
  def num_free(self) -> int:
    """Pages on the free list."""
    return len(self._free)

  def ref_count(self, page: int) -> int:
    """Holders of `page` (0 when free)."""
    return self._refs[page]

  def allocate(self, n: int) -> list[int]:
    """Take `n` free pages, each with ref count 1.

    Raises:
      OutOfPagesError: when fewer than `n` pages are free; nothing is taken then.
      ValueError: for negative `n`.
    """
    if n < 0:
      raise ValueError(f'cannot allocate a negative number of pages: {n}')
    if n > len(self._free):
      raise OutOfPagesError(
          f'cache out of pages: need {n}, {len(self._free)} free of {self.num_pages - 1}')
    pages = [self._free.pop() for _ in range(n)]
    for p in pages:
      self._refs[p] = 1
    return pages

  def share(self, pages) -> None:
    """Add one holder to each held page (a sequence reusing a cached prefix)."""
    for p in pages:
      self._check_held(p)
    for p in pages:
      self._refs[p] += 1

  def free(self, pages) -> list[int]:
    """Drop one holder from each page; pages whose count reaches 0 return to the free list.

    Returns:
      The pages that became free.
    Raises:
      ValueError: for the null page, a page outside the pool or a page that is already free
        (a double free); nothing is changed then.
    """
    pages = list(pages)
    for p in pages:
      self._check_held(p)
    if len(set(pages)) != len(pages):
      raise ValueError(f'page listed twice in one free(): {pages}')
    released = []
    for p in pages:
      self._refs[p] -= 1
      if self._refs[p] == 0:
        self._free.append(p)
        released.append(p)
    return released

  def _check_held(self, p: int) -> None:
    if not 0 < p < self.num_pages:
      raise ValueError(f'page {p} is not a pool page (1 .. {self.num_pages - 1})')
    if self._refs[p] == 0:
      raise ValueError(f'page {p} is free (double free?)')
