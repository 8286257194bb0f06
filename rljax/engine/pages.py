"""Host-side bookkeeping of the KV page pool: free list, reference counts, page tables.

Page 0 is the null page: never allocated, the target of unused page-table entries and of
padding writes. Pages are shared by reference (a group's prompt), and a shared page is
copied before anyone writes into it (copy on write).
"""

from __future__ import annotations

import numpy as np


class OutOfPages(RuntimeError):
  pass


class PagePool:
  """Reference-counted pages 1..num_pages-1."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError("need at least 2 pages (page 0 is the null page)")
    self.num_pages = num_pages
    self.refcount = np.zeros(num_pages, np.int32)
    self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

  @property
  def free_count(self) -> int:
    return len(self._free)

  @property
  def used_count(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def alloc(self, n: int = 1) -> list[int]:
    if n > len(self._free):
      raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
    pages = [self._free.pop() for _ in range(n)]
    self.refcount[pages] = 1
    return pages

  def share(self, pages: list[int]) -> list[int]:
    """Another reference to each page (the caller gets the same ids back)."""
    for p in pages:
      self._check_live(p)
      self.refcount[p] += 1
    return list(pages)

  def release(self, pages: list[int]) -> None:
    for p in pages:
      self._check_live(p)
      self.refcount[p] -= 1
      if self.refcount[p] == 0:
        self._free.append(p)

  def is_shared(self, page: int) -> bool:
    self._check_live(page)
    return self.refcount[page] > 1

  def _check_live(self, page: int) -> None:
    if not 0 < page < self.num_pages or self.refcount[page] <= 0:
      raise ValueError(f"page {page} is not allocated (double free or stale table?)")


def pages_for(num_tokens: int, page_size: int) -> int:
  return -(-num_tokens // page_size)


def table_row(pages: list[int], max_blocks: int) -> np.ndarray:
  row = np.zeros(max_blocks, np.int32)
  if len(pages) > max_blocks:
    raise ValueError(f"{len(pages)} pages exceed the page table width {max_blocks}")
  row[:len(pages)] = pages
  return row
