"""A queue of prompt groups with leases, on shared storage: the trainer hands groups to
rollout hosts that share nothing with it but a storage root (a `Store`: memory, file, gcs).
This module holds what both ends share: the records, the keys and their encodings; the
trainer's end is `queue_owner.QueueOwner`, a rollout host's `queue_client.QueueClient`.

Storage gives no compare-and-swap we rely on, so every key has exactly one writer:

  queue/trainer/state.json               the trainer's whole queue state (source of truth)
  queue/trainer/leases/<host>.json       the trainer's grants to one host (its live leases)
  queue/hosts/<host>/request.json        the host: incarnation, seq, want, heartbeat time
  queue/hosts/<host>/results/<lease>.npz the host: one finished group (write-once)

One exception: the trainer deletes a host's result object once it has consumed it (the
group was finalized, or the result was late). Results are write-once under a lease id
nobody reuses, so the delete never races a writer (a host retrying a push it made could
resurrect one; the trainer then ignores it as late and deletes it again).

One owner per queue, and one live process per host id, at a time.

Time is wall-clock seconds (`time.time()`, injectable): lease deadlines are sent to hosts.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import re
from typing import Any, Iterable

import numpy as np

PENDING, LEASED, READY = "pending", "leased", "ready"
_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_STATE_FORMAT = 1


class QueueError(Exception):
  """A queue protocol violation (bad input, or storage that contradicts the state)."""


@dataclasses.dataclass(frozen=True)
class QueueConfig:
  max_outstanding: int  # groups granted and not yet finalized (leased + ready)
  lease_s: float  # a lease's deadline is its grant time + lease_s
  lease_ttl_s: float  # a host silent this long loses its leases

  def __post_init__(self):
    if self.max_outstanding < 1 or self.lease_s <= 0 or self.lease_ttl_s <= 0:
      raise ValueError(f"bad queue config {self}")


@dataclasses.dataclass(frozen=True)
class GroupSpec:
  """A unit of rollout work: `payload` is small JSON data (task index, prompt ids)."""
  group_id: int
  payload: dict[str, Any]
  group_size: int


@dataclasses.dataclass(frozen=True)
class Grant:
  """A group leased to a host, as the host sees it."""
  lease_id: int
  group_id: int
  payload: dict[str, Any]
  group_size: int
  deadline: float  # wall-clock seconds; a result after it may be ignored

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ReadyGroup:
  """A finished group, as the trainer receives it."""
  group_id: int
  lease_id: int
  host_id: str
  payload: dict[str, Any]
  group_size: int
  attempts: int  # leases granted for this group (1 = first try)
  arrays: dict[str, np.ndarray]
  meta: dict[str, Any]
  key: str  # the result's storage key: readable until the group is finalized and flushed


@dataclasses.dataclass(frozen=True)
class StepReport:
  collected: int  # results that made groups ready
  late: int  # results ignored (lease no longer live)
  expired: int  # leases expired
  granted: int  # leases granted


# ---- keys and encodings ----

def _check_host_id(host_id: str) -> str:
  if not isinstance(host_id, str) or not _HOST_ID.match(host_id):
    raise ValueError(f"host id {host_id!r}: letters, digits, '_', '.', '-' only")
  return host_id


def _norm_prefix(prefix: str) -> str:
  return prefix.strip("/") + "/"


def _dumps(obj: Any) -> bytes:
  return json.dumps(obj, sort_keys=True, allow_nan=False).encode()


class _IdRanges:
  """A set of ints as sorted disjoint half-open ranges [lo, hi)."""

  def __init__(self, ranges: Iterable[Iterable[int]] = ()):
    pairs = sorted(tuple(r) for r in ranges)
    self.lo = [lo for lo, _ in pairs]
    self.hi = [hi for _, hi in pairs]

  def __contains__(self, x: int) -> bool:
    i = bisect.bisect_right(self.lo, x) - 1
    return i >= 0 and x < self.hi[i]

  def add(self, x: int) -> None:
    i = bisect.bisect_right(self.lo, x)  # lo[i-1] <= x < lo[i]
    if i > 0 and x < self.hi[i - 1]:
      return
    left = i > 0 and self.hi[i - 1] == x
    right = i < len(self.lo) and self.lo[i] == x + 1
    if left and right:
      self.hi[i - 1] = self.hi[i]
      del self.lo[i], self.hi[i]
    elif left:
      self.hi[i - 1] = x + 1
    elif right:
      self.lo[i] = x
    else:
      self.lo.insert(i, x)
      self.hi.insert(i, x + 1)

  def to_json(self) -> list[list[int]]:
    return [[lo, hi] for lo, hi in zip(self.lo, self.hi)]


# ---- the trainer's state records ----

@dataclasses.dataclass
class _Group:
  group_id: int
  payload: dict[str, Any]
  group_size: int
  status: str = PENDING
  lease_id: int | None = None
  host_id: str | None = None  # the lease's holder, or the last holder while pending
  deadline: float | None = None
  attempts: int = 0
  result_key: str | None = None


@dataclasses.dataclass
class _Host:
  incarnation: str
  seq: int
  want: int
  last_seen: float  # trainer clock when (incarnation, seq) last changed
