"""The trainer's end of the work queue (rljax.pipeline.work_queue has the keys and the
records): `QueueOwner`, the only writer of queue/trainer/.

On each `step(now)`:
  1. lists queue/hosts/ once; reads the new result objects: a result whose lease is the
     group's live lease makes the group ready, any other is counted late and deleted;
  2. reads every host's request record: a changed (incarnation, seq) is a sign of life,
     timed by the trainer's own clock (immune to clock skew; the host's own timestamp is
     for people); a new incarnation expires every lease of the old one. Heartbeats alone
     are not persisted: after a trainer restart a dead host keeps its leases <= one ttl;
  3. expires leases past their deadline (no result yet) and every lease of a host silent
     for more than `lease_ttl_s`; their groups go back to the front of the pending pool
     and are re-granted under new lease ids, preferably to another host;
  4. grants pending groups to live hosts below their wanted level, while the outstanding
     groups (leased + ready, i.e. granted and not yet finalized) stay <= max_outstanding:
     hosts can never run further ahead of the trainer than it allows;
  5. if anything changed, `flush()`: state.json first, then the changed lease records,
     then the deletes. A crash between leaves records the reopened trainer rewrites.
`ready()` delivers each ready group once; `mark_trained` / `mark_dropped` finalize.
`submit`, `mark_*` change memory only: the next `step()` or `flush()` persists them.

Accounting: submitted = trained + dropped + pending + leased + ready, always.

Restart: `QueueOwner.open(store)` reads state.json and resumes: live leases are kept (and
their results collected), groups finalized before the last write are never delivered
again. Groups ready but not finalized as of that write are delivered again by the new
owner (their results stay in storage until finalized), so nothing delivered-but-untrained
is lost with the process; `flush()` right after a checkpoint makes the two agree.
Finalized ids are kept as ranges, so the state grows with the unfinished groups only.
One owner per queue, and one live process per host id, at a time.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import tensorstore as ts

from rljax.pipeline import npz
from rljax.pipeline.work_queue import (_STATE_FORMAT, LEASED, PENDING, READY, GroupSpec, Grant,
                                       QueueConfig, QueueError, ReadyGroup, StepReport, _dumps,
                                       _Group, _Host, _IdRanges, _norm_prefix)
from rljax.sync.store import Store


class QueueOwner:
  """The trainer's end: the only writer of queue/trainer/. Build with `open`."""

  def __init__(self, store: Store, config: QueueConfig, *, prefix: str,
               clock: Callable[[], float]):
    self.store = store
    self.config = config
    self.prefix = prefix
    self.clock = clock
    self._groups: dict[int, _Group] = {}  # every unfinalized group
    self._pending: list[int] = []  # grant order
    self._leases: dict[int, int] = {}  # live lease id -> group id
    self._final = _IdRanges()
    self._hosts: dict[str, _Host] = {}
    self._garbage: list[str] = []  # consumed result keys to delete after the next write
    self._undelivered: dict[int, ReadyGroup] = {}  # ready and not yet returned by ready()
    self._next_lease = 1
    self._next_group_id = 0
    self._counts = dict(submitted=0, trained=0, dropped=0, expired_leases=0,
                        late_results_ignored=0)
    self.dropped_reasons: dict[str, int] = {}
    self._dirty = False
    self._dirty_hosts: set[str] = set()

  @classmethod
  def open(cls, store: "Store | str", config: QueueConfig | None = None, *,
           prefix: str = "queue/", clock: Callable[[], float] = time.time) -> "QueueOwner":
    """Resumes the queue under `prefix` if the store holds one (`config`, when given,
    replaces the stored one), or starts an empty one with `config`."""
    store = Store.open(store)
    if store.read_only or not store.can_list:
      raise ValueError(f"a queue owner needs a writable, listable store, not {store}")
    prefix = _norm_prefix(prefix)
    raw = store.read(prefix + "trainer/state.json")
    if raw is None:
      if config is None:
        raise QueueError(f"no queue under {prefix!r} in {store}: pass a config to start one")
      owner = cls(store, config, prefix=prefix, clock=clock)
      owner._dirty = True
      owner.flush()
      return owner
    state = json.loads(raw)
    if state.get("format") != _STATE_FORMAT:
      raise QueueError(f"queue state format {state.get('format')!r} is not {_STATE_FORMAT}")
    owner = cls(store, config or QueueConfig(**state["config"]), prefix=prefix, clock=clock)
    owner._load(state)
    owner._dirty = config is not None and config != QueueConfig(**state["config"])
    return owner

  # ---- keys ----

  def _state_key(self) -> str:
    return self.prefix + "trainer/state.json"

  def _lease_key(self, host_id: str) -> str:
    return f"{self.prefix}trainer/leases/{host_id}.json"

  # ---- persistence ----

  def _state_json(self) -> dict[str, Any]:
    return dict(
        format=_STATE_FORMAT, config=dataclasses.asdict(self.config),
        next_lease=self._next_lease, next_group_id=self._next_group_id,
        counts=self._counts, dropped_reasons=self.dropped_reasons,
        groups=[dataclasses.asdict(g) for g in self._groups.values()],
        pending=self._pending, final=self._final.to_json(),
        hosts={h: dataclasses.asdict(s) for h, s in self._hosts.items()},
        garbage=self._garbage)

  def _load(self, state: Mapping[str, Any]) -> None:
    self._next_lease = state["next_lease"]
    self._next_group_id = state["next_group_id"]
    self._counts = dict(state["counts"])
    self.dropped_reasons = dict(state["dropped_reasons"])
    self._groups = {g["group_id"]: _Group(**g) for g in state["groups"]}
    self._pending = list(state["pending"])
    self._leases = {g.lease_id: g.group_id for g in self._groups.values()
                    if g.status == LEASED}
    self._final = _IdRanges(state["final"])
    self._hosts = {h: _Host(**s) for h, s in state["hosts"].items()}
    self._garbage = list(state["garbage"])
    ready = [g for g in self._groups.values() if g.status == READY]
    for g, raw in zip(ready, self.store.read_many(g.result_key for g in ready)):
      if raw is None:
        raise QueueError(f"group {g.group_id} is ready but {g.result_key} is gone")
      self._undelivered[g.group_id] = self._ready_group(g, g.result_key,
                                                         *npz.decode(raw))
    self._dirty_hosts = set(self._hosts)  # a crash may have come before their write
    self._dirty = False
    self._write_leases()
    self._delete_garbage()

  def flush(self) -> None:
    """Persists the state (if changed), then the changed lease records, then deletes
    consumed results."""
    if self._dirty:
      self.store.write(self._state_key(), _dumps(self._state_json()))
      self._dirty = False
    self._write_leases()
    self._delete_garbage()

  def _write_leases(self) -> None:
    if not self._dirty_hosts:
      return
    by_host: dict[str, list[dict[str, Any]]] = {h: [] for h in self._dirty_hosts}
    for lease_id in sorted(self._leases):
      g = self._groups[self._leases[lease_id]]
      if g.host_id in by_host:
        by_host[g.host_id].append(self._grant_of(g).to_json())
    self.store.write_many({
        self._lease_key(h): _dumps(dict(host_id=h, incarnation=self._hosts[h].incarnation,
                                        leases=leases))
        for h, leases in by_host.items()})
    self._dirty_hosts.clear()

  def _delete_garbage(self) -> None:
    futures = [self.store.kvstore.delete_range(ts.KvStore.KeyRange(k, k + "\0"))
               for k in self._garbage]
    for f in futures:
      f.result()
    self._garbage = []  # state.json may still list them: deleting twice is harmless

  # ---- trainer API ----

  def submit(self, groups: Iterable["GroupSpec | tuple[int, dict, int]"]) -> None:
    """Adds groups to the pending pool (all or none). Group ids are unique forever."""
    specs = [g if isinstance(g, GroupSpec) else GroupSpec(*g) for g in groups]
    seen: set[int] = set()
    for s in specs:
      if not isinstance(s.group_id, int) or isinstance(s.group_id, bool) or s.group_id < 0:
        raise ValueError(f"group id {s.group_id!r} is not an int >= 0")
      if s.group_id in seen or s.group_id in self._groups or s.group_id in self._final:
        raise QueueError(f"duplicate group id {s.group_id}: group ids are never reused")
      seen.add(s.group_id)
      if not isinstance(s.payload, dict):
        raise ValueError(f"group {s.group_id}: payload must be a dict, not "
                         f"{type(s.payload).__name__}")
      if not isinstance(s.group_size, int) or s.group_size < 1:
        raise ValueError(f"group {s.group_id}: group_size must be an int >= 1")
    payloads = [json.loads(_dumps(s.payload)) for s in specs]  # raises if not JSON-able
    for s, payload in zip(specs, payloads):
      self._groups[s.group_id] = _Group(s.group_id, payload, s.group_size)
      self._pending.append(s.group_id)
      self._next_group_id = max(self._next_group_id, s.group_id + 1)
    self._counts["submitted"] += len(specs)
    self._dirty = self._dirty or bool(specs)

  @property
  def next_group_id(self) -> int:
    """1 + the largest group id ever submitted (0 for none): where a restarted trainer
    continues numbering."""
    return self._next_group_id

  def step(self, now: float | None = None) -> StepReport:
    """Collects results, reads host requests, expires leases, grants, persists."""
    now = self.clock() if now is None else now
    keys = self.store.list(self.prefix + "hosts/")
    requests: dict[str, str] = {}
    results: list[tuple[str, str, int]] = []
    for key in keys:
      parts = key[len(self.prefix) + len("hosts/"):].split("/")
      if len(parts) == 2 and parts[1] == "request.json":
        requests[parts[0]] = key
      elif len(parts) == 3 and parts[1] == "results" and parts[2].endswith(".npz"):
        try:
          results.append((key, parts[0], int(parts[2][:-len(".npz")])))
        except ValueError:
          pass
    expired_before = self._counts["expired_leases"]
    collected, late = self._collect(results)
    self._read_requests(requests, now)
    self._expire(now)
    granted = self._grant(now)
    self.flush()
    return StepReport(collected=collected, late=late,
                      expired=self._counts["expired_leases"] - expired_before,
                      granted=granted)

  def ready(self) -> list[ReadyGroup]:
    """Groups that became ready since the last call (each delivered once)."""
    out = list(self._undelivered.values())
    self._undelivered.clear()
    return out

  def mark_trained(self, group_id: int) -> None:
    g = self._group(group_id)
    if g.status != READY:
      raise QueueError(f"group {group_id} is {g.status}, not ready: only ready groups train")
    self._finalize(g)
    self._counts["trained"] += 1

  def mark_dropped(self, group_id: int, reason: str) -> None:
    """Finalizes a group without training it: a ready one (e.g. too stale), a pending one,
    or a leased one (its lease is revoked; a result for it will be ignored)."""
    g = self._group(group_id)
    if g.status == PENDING:
      self._pending.remove(group_id)
    elif g.status == LEASED:
      self._revoke(g)
    self._finalize(g)
    self._counts["dropped"] += 1
    self.dropped_reasons[reason] = self.dropped_reasons.get(reason, 0) + 1

  def is_finalized(self, group_id: int) -> bool:
    """Trained or dropped (as of this process's memory)."""
    return group_id in self._final

  def accounting(self) -> dict[str, int]:
    """submitted = trained + dropped + pending + leased + ready."""
    ready = sum(1 for g in self._groups.values() if g.status == READY)
    return dict(submitted=self._counts["submitted"], trained=self._counts["trained"],
                dropped=self._counts["dropped"], pending=len(self._pending),
                leased=len(self._leases), ready=ready,
                expired_leases=self._counts["expired_leases"],
                late_results_ignored=self._counts["late_results_ignored"])

  # ---- internals ----

  def _group(self, group_id: int) -> _Group:
    g = self._groups.get(group_id)
    if g is None:
      state = "already finalized" if group_id in self._final else "unknown"
      raise QueueError(f"group {group_id} is {state}")
    return g

  def _finalize(self, g: _Group) -> None:
    if g.result_key is not None:
      self._garbage.append(g.result_key)
    self._undelivered.pop(g.group_id, None)
    del self._groups[g.group_id]
    self._final.add(g.group_id)
    self._dirty = True

  def _grant_of(self, g: _Group) -> Grant:
    return Grant(lease_id=g.lease_id, group_id=g.group_id, payload=g.payload,
                 group_size=g.group_size, deadline=g.deadline)

  def _ready_group(self, g: _Group, key: str, header: Mapping[str, Any],
                   arrays: dict[str, np.ndarray]) -> ReadyGroup:
    if header.get("group_id") != g.group_id or header.get("lease_id") != g.lease_id:
      raise QueueError(f"{key} holds group {header.get('group_id')} lease "
                       f"{header.get('lease_id')}, not group {g.group_id} lease {g.lease_id}")
    return ReadyGroup(group_id=g.group_id, lease_id=g.lease_id, host_id=g.host_id,
                      payload=g.payload, group_size=g.group_size, attempts=g.attempts,
                      arrays=arrays, meta=header.get("meta", {}), key=key)

  def _revoke(self, g: _Group) -> None:
    """Ends g's live lease (the holder's record loses it)."""
    del self._leases[g.lease_id]
    self._dirty_hosts.add(g.host_id)
    g.status, g.deadline = PENDING, None
    self._dirty = True

  def _collect(self, results: list[tuple[str, str, int]]) -> tuple[int, int]:
    consumed = {g.result_key for g in self._groups.values() if g.status == READY}
    consumed.update(self._garbage)
    fresh = [r for r in results if r[0] not in consumed]
    collected = late = 0
    raws = self.store.read_many(key for key, _, _ in fresh)
    for (key, host_id, lease_id), raw in zip(fresh, raws):
      if raw is None:
        continue
      g = self._groups.get(self._leases.get(lease_id, -1))
      if g is None or g.host_id != host_id:
        late += 1
        self._garbage.append(key)
        continue
      ready = self._ready_group(g, key, *npz.decode(raw))
      del self._leases[lease_id]
      self._dirty_hosts.add(host_id)
      g.status, g.result_key = READY, key
      self._undelivered[g.group_id] = ready
      collected += 1
    self._counts["late_results_ignored"] += late
    self._dirty = self._dirty or bool(collected or late)
    return collected, late

  def _read_requests(self, requests: Mapping[str, str], now: float) -> None:
    hosts = sorted(requests)
    for host_id, raw in zip(hosts, self.store.read_many(requests[h] for h in hosts)):
      if raw is None:
        continue
      rec = json.loads(raw)
      h = self._hosts.get(host_id)
      if h is None:
        self._hosts[host_id] = _Host(rec["incarnation"], rec["seq"], rec["want"], now)
        self._dirty_hosts.add(host_id)
        self._dirty = True
      elif rec["incarnation"] != h.incarnation:
        # a restarted host: the leases of its previous incarnation die with it
        self._expire_leases([g for g in self._leased() if g.host_id == host_id])
        h.incarnation, h.seq, h.want, h.last_seen = (rec["incarnation"], rec["seq"],
                                                     rec["want"], now)
        self._dirty_hosts.add(host_id)
        self._dirty = True
      elif rec["seq"] != h.seq:
        h.seq, h.want, h.last_seen = rec["seq"], rec["want"], now

  def _leased(self) -> list[_Group]:
    return [self._groups[gid] for gid in self._leases.values()]

  def _alive(self, host_id: str, now: float) -> bool:
    return now - self._hosts[host_id].last_seen <= self.config.lease_ttl_s

  def _expire(self, now: float) -> None:
    self._expire_leases([g for g in self._leased()
                         if now > g.deadline or not self._alive(g.host_id, now)])

  def _expire_leases(self, groups: list[_Group]) -> None:
    if not groups:
      return
    for g in groups:
      self._revoke(g)
    self._pending[:0] = sorted(g.group_id for g in groups)  # retried first
    self._counts["expired_leases"] += len(groups)

  def _grant(self, now: float) -> int:
    outstanding = len(self._groups) - len(self._pending)  # leased + ready
    room = self.config.max_outstanding - outstanding
    if room <= 0 or not self._pending:
      return 0
    held: dict[str, int] = {}
    for g in self._leased():
      held[g.host_id] = held.get(g.host_id, 0) + 1
    capacity = {h: s.want - held.get(h, 0) for h, s in self._hosts.items()
                if self._alive(h, now) and s.want > held.get(h, 0)}
    granted = 0  # the pending pool is granted in order: a prefix of it goes
    while granted < min(room, len(self._pending)) and capacity:
      g = self._groups[self._pending[granted]]
      host_id = min(capacity, key=lambda h: (h == g.host_id, -capacity[h], h))
      capacity[host_id] -= 1
      if not capacity[host_id]:
        del capacity[host_id]
      g.status, g.host_id, g.lease_id = LEASED, host_id, self._next_lease
      g.deadline, g.attempts = now + self.config.lease_s, g.attempts + 1
      self._leases[g.lease_id] = g.group_id
      self._next_lease += 1
      self._dirty_hosts.add(host_id)
      granted += 1
    del self._pending[:granted]
    self._dirty = self._dirty or bool(granted)
    return granted
