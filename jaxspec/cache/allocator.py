"""Host-side page allocator: a free list with reference counts (vLLM's block manager, in brief).

Plain Python over integers; never touches device arrays. Page 0 is the null page and is never
handed out.
"""

from __future__ import annotations

import math

from jaxspec.cache.paged import NULL_PAGE
from jaxspec.checks import check_int, is_int_in


class OutOfPagesError(ValueError):
  """The pool has fewer free pages than a request needs."""


def check_num_pages(num_pages) -> int:
  """`num_pages` as an int, if it is an int >= 2 (page 0 is the null page); else ValueError."""
  if not is_int_in(num_pages, 2, math.inf):
    raise ValueError(f'num_pages must be an int >= 2 (page 0 is the null page), got '
                     f'{num_pages!r}')
  return int(num_pages)


class PageAllocator:
  """Hands out pool pages 1 .. num_pages-1 and tracks how many holders each page has.

  Every page is in exactly one state: free (ref count 0, on the free list) or held (ref count
  >= 1). Shared prefix pages are held by several sequences at once.
  """

  def __init__(self, num_pages: int):
    num_pages = check_num_pages(num_pages)
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out low pages first
    self._refs = [0] * num_pages

  @property
  def num_free(self) -> int:
    """Pages on the free list."""
    return len(self._free)

  def ref_count(self, page: int) -> int:
    """Holders of `page` (0 when free; the null page has none).

    Raises:
      ValueError: a page outside 0 .. num_pages-1 (named).
    """
    if not is_int_in(page, 0, self.num_pages - 1):
      raise ValueError(f'page {page!r} is not a page of the pool (0 .. {self.num_pages - 1})')
    return self._refs[page]

  def allocate(self, n: int) -> list[int]:
    """Take `n` free pages, each with ref count 1.

    Raises:
      OutOfPagesError: when fewer than `n` pages are free; nothing is taken then.
      ValueError: `n` not an int >= 0 (a bool or a float too).
    """
    n = check_int('pages to allocate', n, 0)
    if n > len(self._free):
      raise OutOfPagesError(
          f'cache out of pages: need {n}, {len(self._free)} free of {self.num_pages - 1}')
    pages = [self._free.pop() for _ in range(n)]
    for p in pages:
      self._refs[p] = 1
    return pages

  def share(self, pages) -> None:
    """Add one holder to each held page (a sequence reusing a cached prefix).

    Raises:
      ValueError: as `free` (a page not held, or listed twice); nothing is changed then.
    """
    pages = self._checked(pages)
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
    pages = self._checked(pages)
    released = []
    for p in pages:
      self._refs[p] -= 1
      if self._refs[p] == 0:
        self._free.append(p)
        released.append(p)
    return released

  def _checked(self, pages) -> list[int]:
    """`pages` as a list of ints, each a held pool page, none listed twice (ValueError)."""
    pages = list(pages)
    for p in pages:
      if not is_int_in(p, 1, self.num_pages - 1):
        raise ValueError(f'page {p!r} is not a pool page (1 .. {self.num_pages - 1})')
      if self._refs[p] == 0:
        raise ValueError(f'page {p} is free (double free?)')
    pages = [int(p) for p in pages]
    if len(set(pages)) != len(pages):
      raise ValueError(f'page listed twice in one call: {pages}')
    return pages
