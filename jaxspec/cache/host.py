"""Host-memory tier for cached prefix pages: pages reclaimed from the device pool are demoted to
host RAM and promoted back into fresh device pages on a later prefix hit, instead of being
recomputed (the CPU-offload tier of vLLM's KV connector / SGLang's HiCache, in brief).

`HostTier` is the bookkeeping (an LRU of keys with a page capacity); `read_pages` and
`write_pages` move one page set between the device pools and host numpy arrays.
"""

from __future__ import annotations

import collections
import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import paged
from jaxspec.cache.paged import NULL_PAGE
from jaxspec.checks import check_int


class HostTier:
  """Cached pages in host memory, keyed by their prefix key, least recently used evicted first.

  Each entry holds, per model sharing the page table (target, draft), the page's keys and
  values: a list of (k, v) numpy arrays [layers, K, L, H].

  Args:
    capacity: pages the tier holds at most (>= 1).
  """

  def __init__(self, capacity: int):
    capacity = check_int('host tier capacity (pages)', capacity, 1)
    self.capacity = capacity
    self._entries: collections.OrderedDict[bytes, object] = collections.OrderedDict()
    self.evicted = 0

  def __contains__(self, key: bytes) -> bool:
    return key in self._entries

  def __len__(self) -> int:
    return len(self._entries)

  def keys(self) -> list[bytes]:
    """Keys held, least recently used first."""
    return list(self._entries)

  def touch(self, key: bytes) -> None:
    """Mark `key` most recently used."""
    self._entries.move_to_end(key)

  def reserve(self, key: bytes, pinned: Iterable[bytes] = ()) -> bool:
    """Make room for `key` (its data arrives through `put`), evicting least recently used
    entries not in `pinned`. Returns False (nothing changes) when everything left is pinned.
    A key already present keeps its entry (and data) and becomes the most recently used."""
    if key in self._entries:
      self._entries.move_to_end(key)
      return True
    pinned = set(pinned)
    while len(self._entries) >= self.capacity:
      victim = next((k for k in self._entries if k not in pinned), None)
      if victim is None:
        return False
      del self._entries[victim]
      self.evicted += 1
    self._entries[key] = None
    return True

  def put(self, key: bytes, data) -> None:
    """Store a reserved page's data: list of (k, v) [layers, K, L, H] per model."""
    if key not in self._entries:
      raise KeyError('host tier: put() of a key that was not reserved')
    self._entries[key] = data

  def get(self, key: bytes):
    """The stored page data of `key` (see `put`).

    Raises:
      KeyError: the key is absent or its data never arrived.
    """
    data = self._entries[key]
    if data is None:
      raise KeyError('host tier: page reserved but its data never arrived (apply the plan)')
    return data

  def discard(self, key: bytes) -> None:
    """Forget `key` and its data (nothing happens when it is absent)."""
    self._entries.pop(key, None)

  def has_data(self, key: bytes) -> bool:
    """Whether `key` is present with its data (reserved entries wait for `put`)."""
    return self._entries.get(key) is not None

  def clear(self) -> None:
    """Drop every entry."""
    self._entries.clear()

  @property
  def num_bytes(self) -> int:
    """Bytes of page data held."""
    return sum(a.nbytes for data in self._entries.values() if data for kv in data for a in kv)


def check_host_fits(host_pages: int, caches: Sequence) -> None:
  """Refuse a host tier that could not fit the machine's memory when full, before it fills (it
  grows one demoted page at a time, so a run would fail late, or be killed by the OS).

  Args:
    host_pages: the tier's capacity in pages.
    caches: PagedKVCache per model sharing the page table (a demoted page holds each one's
      keys and values). On the CPU their pools live in the same memory and are counted too.
  Raises:
    ValueError: the tier's bytes when full (+ the pools on the CPU) exceed the machine's
      physical memory (named, in GiB).
  """
  per_page = sum(2 * c.k_pages.nbytes // c.k_pages.shape[2] for c in caches)
  pools = sum(2 * c.k_pages.nbytes for c in caches
              if all(d.platform == 'cpu' for d in c.k_pages.devices()))
  need, have = host_pages * per_page, paged.host_memory_bytes()
  if have is not None and need + pools > have:
    also = f' besides {pools / 2 ** 30:.1f} GiB of device pools in the same memory' if pools else ''
    raise ValueError(f'host_pages={host_pages} needs {need / 2 ** 30:.1f} GiB of host memory when '
                     f'full ({per_page / 2 ** 10:.1f} KiB a page for {len(caches)} model(s)){also},'
                     f' more than the machine\'s {have / 2 ** 30:.1f} GiB: use fewer host pages')


def _bucket(n: int) -> int:
  """Copies are padded to a power of two of pages (null-page entries), so a run compiles a
  handful of copy shapes instead of one per page count."""
  return 1 << max(n - 1, 0).bit_length()


def _padded(pages: Sequence[int]):
  idx = np.full((_bucket(len(pages)),), NULL_PAGE, np.int32)
  idx[:len(pages)] = pages
  return jnp.asarray(idx)


@jax.jit
def _read(pool, idx):
  return pool[:, :, idx]


def read_pages(caches: Sequence, pages: Sequence[int]) -> list:
  """Copy pool pages to host memory.

  Args:
    caches: PagedKVCache per model.
    pages: device page ids.
  Returns:
    Per cache, (k, v) numpy arrays [layers, K, n, L, H] (n = len(pages)), bit-identical copies.
  """
  idx, n = _padded(pages), len(pages)
  out = jax.device_get([(_read(c.k_pages, idx), _read(c.v_pages, idx)) for c in caches])
  return [(np.asarray(k)[:, :, :n], np.asarray(v)[:, :, :n]) for k, v in out]


@functools.partial(jax.jit, donate_argnums=(0,))
def _write(pool, idx, values):
  return pool.at[:, :, idx].set(values)


def write_pages(caches: Sequence, pages: Sequence[int], data: Sequence) -> list:
  """Write host copies into pool pages (caches donated).

  Args:
    caches: PagedKVCache per model.
    pages: device page ids (n), none of them the null page.
    data: per page, per cache, (k, v) [layers, K, L, H] as `HostTier.get` returns.
  Returns:
    The updated caches. An error while staging the data (before any write) leaves `caches`
    usable; the writes themselves donate each pool.
  """
  idx = _padded(pages)
  pad = int(idx.shape[0]) - len(pages)  # padding writes zeros into the null page, never read
  widths = ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))
  # Every model's values are on the device before any pool is donated: a failure while building
  # them (host memory) leaves every cache as it was.
  values = [tuple(jnp.asarray(np.pad(np.stack([d[m][i] for d in data], axis=2), widths))
                  for i in (0, 1)) for m in range(len(caches))]
  return [cache.replace(k_pages=_write(cache.k_pages, idx, k),
                        v_pages=_write(cache.v_pages, idx, v))
          for cache, (k, v) in zip(caches, values)]


def check_caches(host: HostTier, demote: Sequence, promote: Sequence, caches: Sequence) -> None:
  """Check that `move_pages` can carry out a plan with these caches.

  Raises:
    ValueError: pages to move and no caches; a promoted page that was demoted from another
      number of caches (one per model sharing the page table) than given.
  """
  if (demote or promote) and not caches:
    raise ValueError(f'the plan moves {len(demote)} demoted and {len(promote)} promoted pages, '
                     f'and no caches were given')
  for key, _ in promote:
    if host.has_data(key) and len(host.get(key)) != len(caches):
      raise ValueError(f'a promoted page was demoted from {len(host.get(key))} caches '
                       f'(one per model), {len(caches)} given')


def move_pages(host: HostTier, demote: Sequence, promote: Sequence, caches: Sequence):
  """Carry out a prefix-cache plan's copies: demoted pages to the host tier first (they are read
  before any promoted page overwrites a pool page), then promoted pages into their device pages.

  Args:
    host: the tier; demoted keys were reserved in it (`HostTier.reserve`), promoted ones hold
      data.
    demote: (device page, key) pairs; a key the tier no longer holds (it demoted more than its
      capacity) is skipped.
    promote: (key, device page) pairs.
    caches: PagedKVCache per model (donated when a page is promoted).
  Returns:
    (caches, pages demoted).
  """
  caches = list(caches)
  promoted = [host.get(key) for key, _ in promote]
  demote = [(page, key) for page, key in demote if key in host]
  if demote:
    data = read_pages(caches, [page for page, _ in demote])
    for i, (_, key) in enumerate(demote):
      # Own copies: a view would keep the whole batched read alive past the tier's capacity.
      host.put(key, [(np.ascontiguousarray(k[:, :, i]), np.ascontiguousarray(v[:, :, i]))
                     for k, v in data])
  if promote:
    caches = write_pages(caches, [page for _, page in promote], promoted)
  return caches, len(demote)


def warm_up_copies(caches: Sequence, max_pages: int) -> list:
  """Compile the copy shapes of up to `max_pages` pages (a read and a write of the null page
  for each power-of-two bucket), so a timed run does not compile. Returns the caches (donated)."""
  caches = list(caches)
  n = 1
  while True:
    data = read_pages(caches, [NULL_PAGE] * n)
    per_page = [[(k[:, :, i], v[:, :, i]) for k, v in data] for i in range(n)]
    caches = write_pages(caches, [NULL_PAGE] * n, per_page)
    if n >= max_pages:
      return caches
    n *= 2
