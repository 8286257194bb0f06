"""Page pool properties over random alloc / fork / extend / copy-on-write / free sequences."""

import collections

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
import numpy as np
import pytest

from rljax.engine.pages import OutOfPages, PagePool, pages_for, table_row

NUM_PAGES = 24


class PoolMachine(RuleBasedStateMachine):
  """Owners are sequences: each holds a list of page references."""

  def __init__(self):
    super().__init__()
    self.pool = PagePool(NUM_PAGES)
    self.owners: dict[int, list[int]] = {}
    self.next_id = 0

  @rule(n=st.integers(1, 6))
  def alloc(self, n):
    if n > self.pool.free_count:
      with pytest.raises(OutOfPages):
        self.pool.alloc(n)
      return
    self.owners[self.next_id] = self.pool.alloc(n)
    self.next_id += 1

  @precondition(lambda self: self.owners)
  @rule(data=st.data())
  def fork(self, data):
    src = data.draw(st.sampled_from(sorted(self.owners)))
    self.owners[self.next_id] = self.pool.share(self.owners[src])
    self.next_id += 1

  @precondition(lambda self: self.owners)
  @rule(data=st.data())
  def extend(self, data):
    owner = data.draw(st.sampled_from(sorted(self.owners)))
    if self.pool.free_count:
      self.owners[owner] += self.pool.alloc(1)

  @precondition(lambda self: self.owners)
  @rule(data=st.data())
  def copy_on_write(self, data):
    owner = data.draw(st.sampled_from(sorted(self.owners)))
    pages = self.owners[owner]
    if not pages:
      return
    block = data.draw(st.integers(0, len(pages) - 1))
    if self.pool.is_shared(pages[block]) and self.pool.free_count:
      (new,) = self.pool.alloc(1)
      self.pool.release([pages[block]])
      pages[block] = new
      assert not self.pool.is_shared(new)

  @precondition(lambda self: self.owners)
  @rule(data=st.data())
  def free(self, data):
    owner = data.draw(st.sampled_from(sorted(self.owners)))
    self.pool.release(self.owners.pop(owner))

  @invariant()
  def refcounts_exact_and_no_leak(self):
    counts = collections.Counter(p for pages in self.owners.values() for p in pages)
    expected = np.zeros(NUM_PAGES, np.int32)
    for p, c in counts.items():
      expected[p] = c
    np.testing.assert_array_equal(self.pool.refcount, expected)
    assert self.pool.free_count + len(counts) == NUM_PAGES - 1  # no leak
    assert 0 not in counts  # the null page is never handed out
    assert len(set(self.pool._free)) == len(self.pool._free)  # no double free  # pylint: disable=protected-access
    assert not set(self.pool._free) & set(counts)  # pylint: disable=protected-access


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_double_free_and_stale_pages_raise():
  pool = PagePool(4)
  pages = pool.alloc(2)
  pool.release(pages)
  with pytest.raises(ValueError, match="not allocated"):
    pool.release(pages[:1])
  with pytest.raises(ValueError, match="not allocated"):
    pool.share([0])


def test_freed_pages_are_reused():
  pool = PagePool(3)
  a = pool.alloc(2)
  with pytest.raises(OutOfPages):
    pool.alloc(1)
  pool.release(a)
  assert sorted(pool.alloc(2)) == sorted(a)


def test_table_row_and_pages_for():
  assert pages_for(1, 16) == 1 and pages_for(16, 16) == 1 and pages_for(17, 16) == 2
  np.testing.assert_array_equal(table_row([5, 3], 4), [5, 3, 0, 0])
  with pytest.raises(ValueError):
    table_row([1, 2, 3], 2)
