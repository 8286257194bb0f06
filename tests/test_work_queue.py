"""The prompt-group work queue: grants, admission limit, lease expiry (deadline, dead
heartbeat, host restart), trainer restart from storage, bitwise results, accounting."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.pipeline.queue_client import QueueClient
from rljax.pipeline.queue_owner import QueueOwner
from rljax.pipeline.work_queue import QueueConfig, QueueError, ReadyGroup
from rljax.sync.store import Store


class Clock:
  def __init__(self, t: float = 1_000.0):
    self.t = t

  def __call__(self) -> float:
    return self.t


def make(url="memory://", *, max_outstanding=8, lease_s=100.0, ttl=10.0):
  store, clock = Store.open(url), Clock()
  owner = QueueOwner.open(store, QueueConfig(max_outstanding, lease_s, ttl), clock=clock)
  return store, clock, owner


def check(owner: QueueOwner) -> dict:
  a = owner.accounting()
  assert a["submitted"] == (a["trained"] + a["dropped"] + a["pending"] + a["leased"]
                            + a["ready"]), a
  assert min(a.values()) >= 0, a
  return a


def groups(ids):
  return [(i, {"task": i, "prompt_ids": [1, 2, i]}, 4) for i in ids]


def arrays_for(group_id: int, lease_id: int) -> dict:
  tokens = (np.arange(12, dtype=np.int32).reshape(4, 3) * 1_000_003 + group_id) ^ lease_id
  logp = np.array([-0.0, np.inf, -np.inf, np.float32(1e-45), np.nan, -1.5, 3.25,
                   np.float32(np.pi)], np.float32).reshape(2, 4)
  logp = (logp.view(np.uint32) ^ np.uint32(group_id)).view(np.float32)  # odd NaN payloads
  return {"tokens": tokens, "logp": logp, "mask": np.array([True, False, True])}


def assert_result(r: ReadyGroup) -> None:
  want = arrays_for(r.group_id, r.lease_id)
  assert set(r.arrays) == set(want)
  for k, x in want.items():
    assert r.arrays[k].dtype == x.dtype and r.arrays[k].shape == x.shape
    assert r.arrays[k].tobytes() == x.tobytes(), k
  assert r.meta == {"lease": r.lease_id, "reward": [0.5, 1.0]}


def push(host: QueueClient, grant) -> None:
  host.push_result(grant.lease_id, grant.group_id, arrays_for(grant.group_id, grant.lease_id),
                   {"lease": grant.lease_id, "reward": [0.5, 1.0]})


def result_keys(store: Store) -> list:
  return [k for k in store.list("queue/hosts/") if "/results/" in k]


def test_two_hosts_grant_push_ready_train():
  store, clock, owner = make()
  a, b = QueueClient(store, "a", clock=clock), QueueClient(store, "b", clock=clock)
  owner.submit(groups(range(4)))
  check(owner)
  assert a.poll_lease() == []  # nothing yet
  a.request(2)
  b.request(2)
  rep = owner.step()
  assert rep.granted == 4 and check(owner)["leased"] == 4
  ga, gb = a.poll_lease(), b.poll_lease()
  assert len(ga) == len(gb) == 2
  assert sorted(g.group_id for g in ga + gb) == [0, 1, 2, 3]
  assert len({g.lease_id for g in ga + gb}) == 4
  assert ga[0].payload == {"task": ga[0].group_id, "prompt_ids": [1, 2, ga[0].group_id]}
  assert ga[0].group_size == 4 and ga[0].deadline == clock.t + 100
  assert a.poll_lease() == []  # only new grants are returned
  for host, gs in ((a, ga), (b, gb)):
    for g in gs:
      push(host, g)
  assert check(owner)["ready"] == 0  # nothing until the trainer steps
  assert owner.step().collected == 4
  ready = owner.ready()
  assert check(owner)["ready"] == 4
  assert sorted(r.group_id for r in ready) == [0, 1, 2, 3]
  for r in ready:
    assert_result(r)
    assert r.host_id == ("a" if r.lease_id in {g.lease_id for g in ga} else "b")
    assert r.attempts == 1
  assert owner.ready() == []  # delivered once
  for r in ready:
    owner.mark_trained(r.group_id)
    check(owner)
  assert len(result_keys(store)) == 4  # deleted once the state says trained
  owner.step()
  assert result_keys(store) == []
  acc = check(owner)
  assert acc["trained"] == 4 and acc["pending"] == acc["leased"] == acc["ready"] == 0
  assert a.poll_lease() == [] and a.held == {} and a.revoked == {}


def test_admission_limit_counts_leased_and_ready():
  store, clock, owner = make(max_outstanding=3)
  a = QueueClient(store, "a", clock=clock)
  owner.submit(groups(range(10)))
  a.request(10)
  assert owner.step().granted == 3
  grants = a.poll_lease()
  assert [g.group_id for g in grants] == [0, 1, 2]  # in submission order
  push(a, grants[0])
  rep = owner.step()
  assert rep.collected == 1 and rep.granted == 0  # ready but not trained: still outstanding
  acc = check(owner)
  assert acc["leased"] + acc["ready"] == 3 and acc["pending"] == 7
  (r,) = owner.ready()
  owner.mark_trained(r.group_id)
  assert owner.step().granted == 1
  assert [g.group_id for g in a.poll_lease()] == [3]
  a.request(2)  # the host's level drops below what it holds: nothing more, nothing revoked
  owner.mark_dropped(5, "not wanted")  # a pending group
  acc = check(owner)
  assert acc["dropped"] == 1 and owner.dropped_reasons == {"not wanted": 1}
  assert owner.step().granted == 0 and len(a.held) == 3 and a.revoked == {}


def test_lease_expiry_by_deadline_regrants_to_other_host_and_ignores_late_result():
  store, clock, owner = make(lease_s=10.0, ttl=1_000.0)
  a, b = QueueClient(store, "a", clock=clock), QueueClient(store, "b", clock=clock)
  owner.submit(groups([7]))
  a.request(1)
  owner.step()
  (ga,) = a.poll_lease()
  b.request(1)
  owner.step()
  assert b.poll_lease() == []
  clock.t += 10  # deadline reached, not passed
  assert owner.step().expired == 0
  clock.t += 0.5
  rep = owner.step()
  assert rep.expired == 1 and rep.granted == 1  # a has room too; b is preferred
  (gb,) = b.poll_lease()
  assert gb.group_id == 7 and gb.lease_id != ga.lease_id and gb.deadline == clock.t + 10
  acc = check(owner)
  assert acc["expired_leases"] == 1 and acc["leased"] == 1
  push(a, ga)  # a has not noticed
  rep = owner.step()
  assert (rep.collected, rep.late) == (0, 1) and owner.ready() == []
  assert check(owner)["late_results_ignored"] == 1
  assert result_keys(store) == []  # the late result is deleted
  assert a.poll_lease() == [] and a.held == {}
  push(b, gb)
  assert owner.step().collected == 1
  (r,) = owner.ready()
  assert (r.group_id, r.lease_id, r.host_id, r.attempts) == (7, gb.lease_id, "b", 2)
  assert_result(r)
  owner.mark_trained(7)
  owner.step()
  acc = check(owner)
  assert acc["trained"] == 1 and acc["late_results_ignored"] == 1


def test_lease_expiry_by_dead_heartbeat():
  store, clock, owner = make(lease_s=1_000.0, ttl=5.0)
  a, b = QueueClient(store, "a", clock=clock), QueueClient(store, "b", clock=clock)
  owner.submit(groups([0, 1]))
  a.request(2)
  owner.step()
  ga = a.poll_lease()
  assert len(ga) == 2
  b.request(2)
  for _ in range(3):  # b beats, a is silent
    clock.t += 2
    b.heartbeat()
    owner.step()
  acc = check(owner)
  assert acc["expired_leases"] == 2 and acc["leased"] == 2
  gb = b.poll_lease()
  assert sorted(g.group_id for g in gb) == [0, 1]
  a.heartbeat()  # a wakes up: alive again, but its leases are gone
  assert a.poll_lease() == [] and set(a.revoked) == {g.lease_id for g in ga}
  push(a, ga[0])  # a late result from a revoked lease is written and ignored
  push(b, gb[0])
  rep = owner.step()
  assert (rep.collected, rep.late, rep.granted) == (1, 1, 0)
  (r,) = owner.ready()
  assert r.host_id == "b" and r.lease_id == gb[0].lease_id
  assert check(owner)["late_results_ignored"] == 1


def test_trainer_restart_mid_flight():
  store, clock, owner = make(ttl=30.0)
  a, b = QueueClient(store, "a", clock=clock), QueueClient(store, "b", clock=clock)
  owner.submit(groups(range(6)))
  a.request(3)
  b.request(3)
  owner.step()
  ga, gb = a.poll_lease(), b.poll_lease()
  push(a, ga[0])
  push(a, ga[1])
  owner.step()
  r0, r1 = owner.ready()
  owner.mark_trained(r0.group_id)
  owner.step()  # persisted: trained
  owner.mark_trained(r1.group_id)  # never persisted: the process dies first
  owner.submit(groups([6]))  # likewise lost
  push(a, ga[2])  # while the trainer is down
  clock.t += 20
  b.heartbeat()
  a.heartbeat()
  del owner  # kill -9

  owner = QueueOwner.open(store, clock=clock)  # config from storage
  acc = check(owner)
  assert acc == dict(submitted=6, trained=1, dropped=0, pending=0, leased=4, ready=1,
                     expired_leases=0, late_results_ignored=0)
  assert owner.next_group_id == 6
  (again,) = owner.ready()  # delivered before, never trained: delivered again
  assert again.group_id == r1.group_id and again.lease_id == r1.lease_id
  assert_result(again)
  rep = owner.step()
  assert (rep.collected, rep.expired, rep.granted) == (1, 0, 0)  # leases honoured
  (r2,) = owner.ready()
  assert r2.lease_id == ga[2].lease_id
  assert a.poll_lease() == [] and b.poll_lease() == []  # same leases, nothing new
  for g in gb:
    push(b, g)
  owner.step()
  rest = owner.ready()
  trained = [r0.group_id]
  for r in [again, r2, *rest]:
    assert_result(r)
    owner.mark_trained(r.group_id)
    trained.append(r.group_id)
  owner.step()
  assert sorted(trained) == list(range(6))
  acc = check(owner)
  assert acc["trained"] == 6 and acc["pending"] == acc["leased"] == acc["ready"] == 0
  assert result_keys(store) == []
  with pytest.raises(QueueError, match="already finalized"):
    owner.mark_trained(r0.group_id)


class CrashingStore(Store):
  """Dies (raises) on writing lease records while `crash` is set: a trainer killed
  between its state write and its lease-record writes."""
  crash = False

  def write_many(self, items):
    if self.crash and any("/leases/" in k for k in items):
      raise KeyboardInterrupt("killed")
    super().write_many(items)


def test_trainer_killed_between_state_and_lease_records():
  mem = Store.open("memory://")
  store, clock = CrashingStore(mem.kvstore, driver="memory"), Clock()
  owner = QueueOwner.open(store, QueueConfig(1, 100.0, 10.0), clock=clock)
  a = QueueClient(store, "a", clock=clock)
  owner.submit(groups([0, 1]))
  a.request(1)
  owner.step()
  (g0,) = a.poll_lease()
  push(a, g0)
  owner.step()
  (r,) = owner.ready()
  owner.mark_trained(r.group_id)
  store.crash = True
  with pytest.raises(KeyboardInterrupt):
    owner.step()  # state.json says: 0 trained, 1 leased to a; a's record does not
  store.crash = False
  assert a.poll_lease() == [] and len(result_keys(store)) == 1
  owner = QueueOwner.open(store, clock=clock)
  assert result_keys(store) == []  # the consumed result is deleted on open
  (g1,) = a.poll_lease()  # the record is rewritten on open
  assert g1.group_id == 1
  acc = check(owner)
  assert (acc["trained"], acc["leased"], acc["pending"]) == (1, 1, 0)


def test_open_needs_a_queue_or_a_config():
  with pytest.raises(QueueError, match="no queue"):
    QueueOwner.open(Store.open("memory://"))
  store, clock, owner = make(max_outstanding=2)
  assert QueueOwner.open(store).config.max_outstanding == 2
  assert QueueOwner.open(store, QueueConfig(5, 1.0, 1.0)).config.max_outstanding == 5


def test_host_restart_new_incarnation():
  store, clock, owner = make()
  owner.submit(groups(range(3)))
  a = QueueClient(store, "a", clock=clock)
  a.request(3)
  owner.step()
  old = a.poll_lease()
  assert len(old) == 3
  push(a, old[0])  # finished before the crash: salvaged
  a2 = QueueClient(store, "a", clock=clock)  # the restarted process
  assert a2.incarnation != a.incarnation
  assert a2.poll_lease() == []  # the record is for the old incarnation
  a2.request(3)
  rep = owner.step()
  assert (rep.collected, rep.expired, rep.granted) == (1, 2, 2)
  new = a2.poll_lease()
  assert sorted(g.group_id for g in new) == sorted(g.group_id for g in old[1:])
  assert not {g.lease_id for g in new} & {g.lease_id for g in old}
  with pytest.raises(QueueError, match="not a lease of this host"):
    push(a2, old[1])
  push(a, old[1])  # the old process was a zombie after all: its result is ignored
  for g in new:
    push(a2, g)
  rep = owner.step()
  assert (rep.collected, rep.late) == (2, 1)
  ready = owner.ready()
  assert sorted(r.group_id for r in ready) == [0, 1, 2]
  for r in ready:
    assert_result(r)
  assert check(owner)["expired_leases"] == 2


def test_bad_input():
  store, clock, owner = make()
  owner.submit(groups([1, 2]))
  with pytest.raises(QueueError, match="duplicate group id 3"):
    owner.submit(groups([3, 3]))
  with pytest.raises(QueueError, match="duplicate group id 2"):
    owner.submit(groups([4, 2]))
  with pytest.raises(ValueError, match="payload must be a dict"):
    owner.submit([(5, "prompt", 4)])
  with pytest.raises(ValueError, match="group_size"):
    owner.submit([(5, {}, 0)])
  with pytest.raises(ValueError, match="not an int"):
    owner.submit([("5", {}, 4)])
  with pytest.raises(TypeError):
    owner.submit([(5, {"x": object()}, 4)])
  assert check(owner)["submitted"] == 2  # all or nothing
  owner.mark_dropped(1, "bad prompt")
  with pytest.raises(QueueError, match="duplicate group id 1"):
    owner.submit(groups([1]))
  with pytest.raises(QueueError, match="group 9 is unknown"):
    owner.mark_trained(9)
  with pytest.raises(QueueError, match="group 2 is pending, not ready"):
    owner.mark_trained(2)
  with pytest.raises(ValueError, match="host id"):
    QueueClient(store, "a/b")
  a = QueueClient(store, "a", clock=clock)
  with pytest.raises(ValueError, match="max_groups"):
    a.request(-1)
  a.request(1)
  owner.step()
  (g,) = a.poll_lease()
  with pytest.raises(QueueError, match="lease 999 is not a lease of this host"):
    a.push_result(999, g.group_id, {})
  with pytest.raises(QueueError, match="is for group 2, not 7"):
    a.push_result(g.lease_id, 7, {})
  with pytest.raises(ValueError, match="never strings"):
    a.push_result(g.lease_id, g.group_id, {"text": np.array(["hi"])})
  push(a, g)
  with pytest.raises(QueueError, match="already pushed"):
    push(a, g)
  check(owner)


def test_file_store_separate_processes(tmp_path):
  url = f"file://{tmp_path}/root/"
  clock = Clock()
  owner = QueueOwner.open(url, QueueConfig(4, 50.0, 20.0), clock=clock)
  host = QueueClient(url, "host-0.x", clock=clock)  # its own Store: shares only the root
  owner.submit(groups(range(5)))
  host.request(2)
  owner.step()
  grants = host.poll_lease()
  assert len(grants) == 2
  push(host, grants[0])
  del owner  # kill -9
  owner = QueueOwner.open(url, clock=clock)
  owner.step()
  (r,) = owner.ready()
  assert_result(r)
  owner.mark_trained(r.group_id)
  owner.step()
  got = host.poll_lease()
  assert len(got) == 1 and len(host.held) == 2
  assert len(result_keys(Store.open(url))) == 0
  acc = check(owner)
  assert acc["trained"] == 1 and acc["leased"] == 2 and acc["pending"] == 2


# ---- randomized interleavings ----

HOSTS = ("h0", "h1")
OPS = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 3)),
    st.tuples(st.just("request"), st.sampled_from(HOSTS), st.integers(0, 3)),
    st.tuples(st.just("heartbeat"), st.sampled_from(HOSTS)),
    st.tuples(st.just("poll"), st.sampled_from(HOSTS)),
    st.tuples(st.just("push"), st.sampled_from(HOSTS), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 3.0, 6.0, 12.0])),
    st.tuples(st.just("step")),
    st.tuples(st.just("train"), st.booleans()),
    st.tuples(st.just("drop"), st.integers(0, 7)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("kill_trainer")),
    st.tuples(st.just("restart_host"), st.sampled_from(HOSTS), st.booleans()),
)


@settings(max_examples=30, deadline=None)
@given(st.lists(OPS, min_size=5, max_size=40))
def test_accounting_invariant_random_interleaving(ops):
  store, clock, owner = make(max_outstanding=4, lease_s=10.0, ttl=5.0)
  hosts = {h: QueueClient(store, h, clock=clock) for h in HOSTS}
  persisted_ids: set = set()  # submitted, as of the last write of the state
  known_ids: set = set()  # submitted, as the live owner knows
  committed: set = set()  # finalized, as of the last write of the state
  unflushed: set = set()  # finalized since
  delivered: set = set()  # by the live owner

  def persist():
    persisted_ids.update(known_ids)
    committed.update(unflushed)
    unflushed.clear()

  def take_ready(train: bool):
    for r in owner.ready():
      assert r.group_id not in delivered and r.group_id not in committed | unflushed
      assert r.group_id in known_ids
      assert_result(r)
      delivered.add(r.group_id)
      if train:
        owner.mark_trained(r.group_id)
      else:
        owner.mark_dropped(r.group_id, "stale")
      unflushed.add(r.group_id)

  prelude = [("submit", 3), ("request", "h0", 2), ("request", "h1", 2), ("step",),
             ("poll", "h0"), ("poll", "h1")]
  for op in prelude + ops:
    kind = op[0]
    if kind == "submit":
      ids = list(range(owner.next_group_id, owner.next_group_id + op[1]))
      owner.submit(groups(ids))
      known_ids.update(ids)
    elif kind == "request":
      hosts[op[1]].request(op[2])
    elif kind == "heartbeat":
      hosts[op[1]].heartbeat()
    elif kind == "poll":
      hosts[op[1]].poll_lease()
    elif kind == "push":
      host = hosts[op[1]]
      leases = sorted(host.held.values(), key=lambda g: g.lease_id) + \
          sorted(host.revoked.values(), key=lambda g: g.lease_id)
      if leases:
        push(host, leases[op[2] % len(leases)])
    elif kind == "tick":
      clock.t += op[1]
    elif kind == "step":
      owner.step()
      persist()
    elif kind == "train":
      take_ready(op[1])
    elif kind == "drop":
      open_ids = sorted(known_ids - committed - unflushed)
      if open_ids:
        gid = open_ids[op[1] % len(open_ids)]
        owner.mark_dropped(gid, "cancelled")
        unflushed.add(gid)
    elif kind == "flush":
      owner.flush()
      persist()
    elif kind == "kill_trainer":
      owner = QueueOwner.open(store, clock=clock)
      known_ids = set(persisted_ids)
      unflushed.clear()
      delivered.clear()
    elif kind == "restart_host":
      old = hosts[op[1]]
      if op[2] and old.held:  # a result from the dying process
        push(old, min(old.held.values(), key=lambda g: g.lease_id))
      hosts[op[1]] = QueueClient(store, op[1], clock=clock)
    acc = check(owner)
    assert acc["submitted"] == len(known_ids)
    assert acc["trained"] + acc["dropped"] == len(committed | unflushed)
    assert acc["leased"] + acc["ready"] <= 4

  # drain: every known group is finalized exactly once, nothing is left in storage
  for h in hosts.values():
    h.request(4)
  for _ in range(40):
    clock.t += 0.5
    for h in hosts.values():
      h.heartbeat()
    owner.step()
    persist()
    for h in hosts.values():
      h.poll_lease()
      for g in list(h.held.values()):
        push(h, g)
    owner.step()
    persist()
    take_ready(True)
    owner.flush()
    persist()
    check(owner)
    acc = owner.accounting()
    if acc["pending"] + acc["leased"] + acc["ready"] == 0:
      break
  acc = check(owner)
  assert acc["pending"] + acc["leased"] + acc["ready"] == 0, acc
  assert committed == known_ids and acc["submitted"] == len(known_ids)
  assert result_keys(store) == []
