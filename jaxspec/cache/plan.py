"""What a `PrefixCache` admission hands out: a sequence's pages (`Request`) and the device <-> host
page copies to run before its prefill (`Plan`, run by `PrefixCache.apply`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Request:
  """One sequence's pages, as handed out by `PrefixCache.admit`.

  Attributes:
    id: request id.
    tokens: the prompt ids (grows through `commit`).
    salt: its cache salt.
    pages: pool pages of logical pages 0, 1, ... (the row of a page table).
    num_cached: prompt tokens whose keys/values were found in the cache (a multiple of the page
      size); prefill computes tokens[num_cached:].
    num_promoted: of those, tokens found in the host tier (copied in by `apply`).
  """

  id: int
  tokens: list
  salt: bytes
  pages: list
  num_cached: int
  num_promoted: int = 0
  finished: bool = False


@dataclasses.dataclass
class Plan:
  """Data movement an admission needs before prefill: run it with `PrefixCache.apply`.

  demote: (device page, key) pairs reclaimed this admission whose contents go to the host tier;
    they must be read before the page is overwritten.
  promote: (key, device page) pairs to copy from the host tier into fresh device pages.
  """

  demote: list = dataclasses.field(default_factory=list)
  promote: list = dataclasses.field(default_factory=list)
  pinned: set = dataclasses.field(default_factory=set, repr=False)  # host keys to keep

  def __bool__(self) -> bool:
    return bool(self.demote or self.promote)
