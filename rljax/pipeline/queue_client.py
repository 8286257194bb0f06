"""A rollout host's end of the work queue (rljax.pipeline.work_queue has the keys and the
records): `QueueClient`, the only writer of queue/hosts/<host_id>/.

`request(n)` says "I want to hold up to n groups at a time" (a level, not a count, so
rewriting it is idempotent); every request and `heartbeat()` rewrites the record with
seq + 1. `poll_lease()` reads the one lease record: grants for
this incarnation it has not seen are new; leases that vanish before it pushed them were
revoked (expired). `push_result` writes the arrays (token ids, log-probs, ...: numeric
arrays only, bitwise lossless through .npz) and a JSON meta.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Mapping

from rljax.pipeline import npz
from rljax.pipeline.work_queue import Grant, QueueError, _check_host_id, _dumps, _norm_prefix
from rljax.sync.store import Store


class QueueClient:
  """A rollout host's end: the only writer of queue/hosts/<host_id>/.

  One process per host id at a time; each QueueClient is a new incarnation, so leases
  granted to a previous process with this host id are never taken for its own."""

  def __init__(self, store: "Store | str", host_id: str, *, prefix: str = "queue/",
               clock: Callable[[], float] = time.time, incarnation: str | None = None):
    self.store = Store.open(store)
    self.host_id = _check_host_id(host_id)
    self.prefix = _norm_prefix(prefix)
    self.clock = clock
    self.incarnation = incarnation or uuid.uuid4().hex
    self.want = 0
    self.seq = 0
    self.held: dict[int, Grant] = {}  # granted to us, live at the last poll, not pushed
    self.revoked: dict[int, Grant] = {}  # vanished from the record before we pushed them
    self._pushed: set[int] = set()  # pushed, still in the record at the last poll
    self._max_seen = 0  # lease ids only grow: larger ones are new

  def _host_key(self, name: str) -> str:
    return f"{self.prefix}hosts/{self.host_id}/{name}"

  def request(self, max_groups: int) -> None:
    """Asks to hold up to `max_groups` groups at a time (0: no more); also a heartbeat."""
    if not isinstance(max_groups, int) or max_groups < 0:
      raise ValueError(f"max_groups must be an int >= 0, got {max_groups!r}")
    self.want = max_groups
    self.heartbeat()

  def heartbeat(self) -> None:
    self.seq += 1
    self.store.write(self._host_key("request.json"), _dumps(dict(
        host_id=self.host_id, incarnation=self.incarnation, seq=self.seq, want=self.want,
        heartbeat=self.clock())))

  def poll_lease(self) -> list[Grant]:
    """Reads this host's lease record; returns the grants not seen before. Leases we hold
    that the record no longer lists move to `revoked` (expired: drop that work)."""
    raw = self.store.read(f"{self.prefix}trainer/leases/{self.host_id}.json")
    if raw is None:
      return []
    rec = json.loads(raw)
    if rec["incarnation"] != self.incarnation:
      return []  # the trainer has not seen this incarnation yet
    live = {g["lease_id"]: Grant(**g) for g in rec["leases"]}
    for lease_id in list(self.held):
      if lease_id not in live:
        self.revoked[lease_id] = self.held.pop(lease_id)
    self._pushed &= set(live)
    new = [g for lease_id, g in sorted(live.items()) if lease_id > self._max_seen]
    for g in new:
      self.held[g.lease_id] = g
    self._max_seen = max([self._max_seen, *live])
    return new

  def push_result(self, lease_id: int, group_id: int, arrays: Mapping[str, Any],
                  meta: Mapping[str, Any] | None = None) -> None:
    """Writes a finished group. `arrays`: numeric arrays (token ids, log-probs, versions,
    ...) kept bitwise; `meta`: JSON. A revoked lease may still be pushed (the trainer
    counts it late and ignores it)."""
    grant = self.held.get(lease_id) or self.revoked.get(lease_id)
    if grant is None:
      state = "already pushed" if lease_id in self._pushed else "not a lease of this host"
      raise QueueError(f"push_result: lease {lease_id} is {state} "
                       f"({self.host_id}, incarnation {self.incarnation})")
    if grant.group_id != group_id:
      raise QueueError(f"push_result: lease {lease_id} is for group {grant.group_id}, "
                       f"not {group_id}")
    data = npz.encode(dict(group_id=group_id, lease_id=lease_id, host_id=self.host_id,
                              incarnation=self.incarnation, meta=dict(meta or {})), arrays)
    self.store.write(self._host_key(f"results/{lease_id:012d}.npz"), data)
    if self.held.pop(lease_id, None) is not None:
      self._pushed.add(lease_id)
    else:
      self.revoked.pop(lease_id)
