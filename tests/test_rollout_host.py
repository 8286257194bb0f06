"""Rollout hosts of the async pipeline: incremental episodes, a host serving the work queue
from a storage root (weights in, bitwise groups out, version stamps, revoked leases,
run/done), and experiments/rollout_host.py as a real process on a file:// root."""

import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import types

import chex
import jax
import numpy as np
import pytest
import tensorstore as ts

from rljax import envs
from rljax.engine.engine import DecodeEngine
from rljax.model import ModelConfig, init_params
from rljax.numerics import Numerics
from rljax.pipeline import wire
from rljax.pipeline.host import RolloutHost, RunOver
from rljax.pipeline.layout import (DONE_KEY, RootUnreachable, probe_root, publish_fingerprint,
                                   status_key, stream_url)
from rljax.pipeline.queue_client import QueueClient
from rljax.pipeline.queue_owner import QueueOwner
from rljax.pipeline.rollout import EpisodeRunner, FailureLog, generate_groups
from rljax.pipeline.run import ROLLOUT_HOST, build
from rljax.pipeline.work_queue import QueueConfig
from rljax.sync import Publisher, Store, StreamError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sampling_params(config):
  return build(config, ROLLOUT_HOST).sampling
SMALL_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, moe_intermediate_size=16, intermediate_size=32)
GROUP = 4


class Clock:
  """A fake wall clock that moves 1 ms per reading (so polling intervals pass)."""

  def __init__(self, t: float = 1000.0):
    self.t = t

  def __call__(self) -> float:
    self.t += 1e-3
    return self.t


def small_config():
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.model.update(SMALL_MODEL)
  config.numerics = "deterministic"
  config.engine.num_slots = 8
  config.async_rl.poll_s = 1e-6  # every run_once reads storage (tests interleave the owner)
  return config


def params_of(config, seed: int):
  cfg = ModelConfig.from_dict(config.model.to_dict()).resolved(jax.default_backend(),
                                                               config.numerics)
  params = init_params(cfg, jax.random.key(seed), "float32")
  return cfg, jax.tree.map(lambda x: np.asarray(x.astype("bfloat16")), params)


def reference_groups(config, cfg, params, env, tasks, first_id: int, version: int = 0):
  """What generate_groups gives on a fresh engine for these request ids."""
  eng = DecodeEngine(cfg, jax.tree.map(jax.numpy.asarray, params),
                     numerics=Numerics(config.numerics), num_slots=config.engine.num_slots,
                     max_seq_len=config.engine.max_seq_len, eos_id=env.tokenizer.eos_id,
                     version=version)
  return generate_groups(eng, env, tasks, group_size=GROUP, sampling=sampling_params(config),
                         seed=config.seed, first_request_id=first_id)


def assert_same_group(got, want) -> None:
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert (a.sample_index, a.group_id, a.finish_reason, a.outcome) == (
        b.sample_index, b.group_id, b.finish_reason, b.outcome)
    assert a.reward == b.reward
    chex.assert_trees_all_equal(a.tokens, b.tokens)
    chex.assert_trees_all_equal(a.behaviour_logprobs, b.behaviour_logprobs)
    chex.assert_trees_all_equal(a.versions, b.versions)
    chex.assert_trees_all_equal(a.loss_mask, b.loss_mask)
    chex.assert_trees_all_equal(a.expert_ids, b.expert_ids)


def serve_until(host, owner, ids, max_iters=200) -> dict:
  """Interleaves host iterations and owner steps until every group in `ids` is ready."""
  ready = {}
  for _ in range(max_iters):
    assert host.run_once()
    owner.step()
    ready |= {r.group_id: r for r in owner.ready()}
    if set(ids) <= set(ready):
      return ready
  raise AssertionError(f"groups {sorted(set(ids) - set(ready))} never came back")


def test_episode_runner_adds_groups_while_others_run(tiny_cfg, tiny_params):
  # a group added mid-flight samples the same tokens as in one batch: keys are per request
  env = envs.ArithmeticEnv(max_digits=2)
  tasks = env.prompts("train", 3, seed=0)
  sp = sampling_params(small_config())
  make = lambda: DecodeEngine(tiny_cfg, tiny_params, numerics=Numerics("deterministic"),
                              num_slots=4, max_seq_len=32, eos_id=env.tokenizer.eos_id,
                              steps_per_call=2)
  want = generate_groups(make(), env, tasks, group_size=3, sampling=sp, seed=7,
                         first_request_id=5)
  runner = EpisodeRunner(make(), env, sampling=sp, seed=7)
  runner.add(5, tasks[0], 3)
  got = runner.step()
  assert runner.busy and not runner.idle and runner.running == [5]
  runner.add(7, tasks[2], 3)
  runner.add(6, tasks[1], 3)
  while runner.busy:
    got += runner.step()
  assert runner.idle and runner.engine.idle and runner.engine.pool.used_count == 0
  assert sorted(g.request_id for g in got) == [5, 6, 7]
  for g in got:
    assert g.task is tasks[g.request_id - 5]
    assert_same_group(g.trajectories, want[g.request_id - 5].trajectories)
  with pytest.raises(ValueError, match="already running"):
    runner.add(8, tasks[0], 3)
    runner.add(8, tasks[0], 3)
  for bad in (-1, 2**31, 1.5, True):
    with pytest.raises(ValueError, match="request id"):
      runner.add(bad, tasks[0], 3)
  with pytest.raises(ValueError, match="group_size"):
    runner.add(9, tasks[0], 0)


class _CountingSlowEnv(envs.ArithmeticEnv):
  """Each verify sleeps 0.25 s and counts how many verifies are running at once."""

  def __init__(self):
    super().__init__(max_digits=2, latency=envs.LatencyModel("lognormal", scale_s=0.25,
                                                             shape=1e-6))
    self._lock = threading.Lock()
    self.in_flight = self.max_in_flight = self.calls = 0

  def verify(self, task, completion_ids):
    with self._lock:
      self.in_flight += 1
      self.calls += 1
      self.max_in_flight = max(self.max_in_flight, self.in_flight)
    try:
      return super().verify(task, completion_ids)
    finally:
      with self._lock:
        self.in_flight -= 1


def test_env_calls_run_beside_the_engine_and_change_nothing(tiny_cfg, tiny_params):
  # the runner's env threads overlap the 16 slow verifies (one after another they would
  # take 4 s), and the groups are the same as without delay
  slow = _CountingSlowEnv()
  fast = envs.ArithmeticEnv(max_digits=2)
  tasks = fast.prompts("train", 4, seed=0)
  sp = sampling_params(small_config())
  make = lambda: DecodeEngine(tiny_cfg, tiny_params, numerics=Numerics("deterministic"),
                              num_slots=16, max_seq_len=32, eos_id=fast.tokenizer.eos_id)
  want = generate_groups(make(), fast, tasks, group_size=4, sampling=sp, seed=3)
  engine = make()
  generate_groups(engine, fast, tasks, group_size=4, sampling=sp, seed=3)  # compile
  got = generate_groups(engine, slow, tasks, group_size=4, sampling=sp, seed=3)
  assert slow.calls == 16 and slow.max_in_flight > 1, (slow.calls, slow.max_in_flight)
  for g, w in zip(got, want):
    assert_same_group(g.trajectories, w.trajectories)
  with pytest.raises(ValueError, match="env_workers"):
    EpisodeRunner(make(), fast, sampling=sp, seed=0, env_workers=0)


def test_host_serves_the_queue_bitwise_follows_the_stream_and_stops_on_done():
  config = small_config()
  cfg, p0 = params_of(config, 0)
  _, p1 = params_of(config, 1)
  env = envs.make(config.env.name, **config.env.kwargs.to_dict())
  ctx, root = ts.Context(), "memory://"  # one context: both sides see one memory kvstore
  store = Store.open(root, ctx)
  publish_fingerprint(store, config)  # as the trainer does before its first weights
  pub = Publisher(Store.open(stream_url(root), ctx), keyframe_every=10)
  pub.publish(p0, 0)
  owner = QueueOwner.open(store, QueueConfig(max_outstanding=8, lease_s=120.0,
                                             lease_ttl_s=15.0))
  tasks = env.prompts("train", 6, seed=3)
  owner.submit([(10 + i, wire.task_to_payload(t), GROUP) for i, t in enumerate(tasks[:3])])
  host = RolloutHost(root, config, "h0", context=ctx)
  assert host.engine.version == 0 and host.applied[0][0] == 0

  ready = serve_until(host, owner, [10, 11, 12])
  want = reference_groups(config, cfg, p0, env, tasks[:3], first_id=10)
  for i, gid in enumerate([10, 11, 12]):
    r = ready[gid]
    assert r.host_id == "h0" and r.meta["host_id"] == "h0"
    assert r.meta["versions_min"] == r.meta["versions_max"] == 0
    got = wire.group_from_arrays(r.arrays, gid)
    assert_same_group(got, want[i].trajectories)
    assert r.meta["tokens"] == sum(int(t.loss_mask.sum()) for t in got)
    owner.mark_trained(gid)

  # version 1 arrives: the engine takes the subscriber's (donated, in-place) arrays at once
  pub.publish(p1, 1)
  owner.submit([(20 + i, wire.task_to_payload(t), GROUP) for i, t in enumerate(tasks[3:])])
  ready = serve_until(host, owner, [20, 21, 22])
  assert host.engine.version == 1 and [a[0] for a in host.applied] == [0, 1]
  assert all(x is y for x, y in zip(jax.tree.leaves(host.engine.params),
                                    jax.tree.leaves(host.sub.params)))
  assert not any(x.is_deleted() for x in jax.tree.leaves(host.engine.params))
  want = reference_groups(config, cfg, p1, env, tasks[3:], first_id=20, version=1)
  for i, gid in enumerate([20, 21, 22]):
    got = wire.group_from_arrays(ready[gid].arrays, gid)
    assert all(np.all(t.versions[t.loss_mask] == 1) for t in got)
    assert_same_group(got, want[i].trajectories)

  store.write(DONE_KEY, b"done")
  assert host.run(max_seconds=30) == "done"  # the done key, not the 30 s limit
  assert not host.run_once()
  status = json.loads(store.read(status_key("h0")))
  assert status["host_id"] == "h0" and status["incarnation"] == host.client.incarnation
  assert [a[0] for a in status["applied"]] == [0, 1]
  published = [json.loads(Store.open(stream_url(root), ctx).read(f"manifests/{v:012d}.json"))
               ["created_unix"] for v in (0, 1)]
  assert [a[1] for a in status["applied"]] == published
  assert all(a[2] >= a[1] and a[3] >= 0 for a in status["applied"])
  assert status["groups_pushed"] == 6 and status["tokens_generated"] > 0
  assert status["generate_s"] > 0
  request = json.loads(store.read("queue/hosts/h0/request.json"))
  assert request["want"] == 0  # withdrawn on exit


def test_revoked_lease_is_not_pushed_and_a_regrant_reuses_the_running_group():
  config = small_config()
  config.async_rl.weight_update = "recompute"
  _, p0 = params_of(config, 0)
  env = envs.make(config.env.name, **config.env.kwargs.to_dict())
  ctx, root = ts.Context(), "memory://run"
  store = Store.open(root, ctx)
  publish_fingerprint(store, config)
  Publisher(Store.open(stream_url(root), ctx)).publish(p0, 0)
  now = Clock()
  owner = QueueOwner.open(store, QueueConfig(max_outstanding=8, lease_s=10.0,
                                             lease_ttl_s=1e9), clock=now)
  host = RolloutHost(root, config, "h0", context=ctx, clock=now)
  assert host.engine.weight_update == "recompute"
  other = QueueClient(store, "h1", clock=now)
  tasks = env.prompts("train", 2, seed=5)
  owner.submit([(0, wire.task_to_payload(tasks[0]), GROUP)])
  host.client.request(1)
  owner.step()
  host._take_grants()  # noqa: SLF001  (leased and running, not yet decoded)
  assert host.runner.running == [0]
  # the lease expires; only h0 asks for work, so the group comes back to h0: the
  # running group serves the new lease
  now.t += 11.0
  host.client.request(1)
  assert owner.step().expired == 1
  ready = serve_until(host, owner, [0])
  assert ready[0].attempts == 2 and ready[0].lease_id == 2
  # expired again, this time re-granted to another host: h0's result is dropped unsent
  owner.submit([(1, wire.task_to_payload(tasks[1]), GROUP)])
  owner.step()
  host._take_grants()  # noqa: SLF001
  other.request(1)
  now.t += 11.0
  owner.step()
  other.poll_lease()
  assert [g.group_id for g in other.held.values()] == [1]
  while host.runner.busy:
    host.run_once()
  assert host.counts["groups_discarded"] == 1 and host.counts["groups_pushed"] == 1
  assert store.list("queue/hosts/h0/results/") == ["queue/hosts/h0/results/000000000002.npz"]


def test_a_hosts_infra_failures_reach_the_wire_its_status_and_the_trainers_log(caplog):
  """A verifier that raises on a host: each episode's reason crosses the wire, the host
  logs the first of each kind with its traceback once and puts it in its status record,
  which the trainer logs once; every update of them stops the trainer after
  rl.max_all_infra_updates."""
  from rljax.pipeline import async_loop, watch  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.layout import read_host_status  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.metrics import NullLogger  # pylint: disable=import-outside-toplevel
  caplog.set_level("ERROR")
  config = small_config()
  _, p0 = params_of(config, 0)
  env = envs.make(config.env.name, **config.env.kwargs.to_dict())
  ctx, root = ts.Context(), "memory://infra"
  store = Store.open(root, ctx)
  publish_fingerprint(store, config)
  Publisher(Store.open(stream_url(root), ctx)).publish(p0, 0)
  owner = QueueOwner.open(store, QueueConfig(max_outstanding=8, lease_s=120.0,
                                             lease_ttl_s=15.0))
  host = RolloutHost(root, config, "h0", context=ctx)

  def verify(task, completion_ids):
    return {}[task.task_id]  # a KeyError in every episode
  host.env.verify = verify
  owner.submit([(0, wire.task_to_payload(env.prompts("train", 1, seed=1)[0]), GROUP)])
  ready = serve_until(host, owner, [0])
  trajs = wire.group_from_arrays(ready[0].arrays, 0)
  assert {(t.outcome.value, t.infra_reason) for t in trajs} == {("infra_failure", "exception")}
  stats = watch.rollout_stats(trajs)
  assert stats["infra_failures"] == stats["reward_errors"] == stats[
      "infra_failures_exception"] == GROUP
  host.write_status()
  status = read_host_status(store)["h0"]
  assert status["infra_failures"] == {"exception": GROUP}
  (kind, first), = status["first_errors"].items()
  assert kind == "exception: KeyError" and "return {}[task.task_id]" in first["traceback"]
  logged = [r.getMessage() for r in caplog.records]
  assert len(logged) == 1 and logged[0].startswith("rollout host h0: infra failure "
                                                   "(exception: KeyError) of arithmetic")

  # the trainer's side (process 0 of one): the host's first failures logged once, and
  # the stop once every episode of 2 updates was one
  trainer = object.__new__(async_loop.AsyncTrainer)
  trainer.primary, trainer.multi, trainer.store, trainer.host_errors = True, False, store, {}
  trainer.run = run = types.SimpleNamespace(
      watch=watch.RolloutWatch(max_all_infra=2), failures=FailureLog(),
      log=NullLogger("/tmp"), version=7)
  for update in (1, 2):
    trainer._log_host_errors(read_host_status(store))  # noqa: SLF001
    run.watch.update(update, stats, max_new_tokens=8)
    if update == 1:
      trainer._stop_if_only_infra()  # noqa: SLF001
  with pytest.raises(watch.AllInfraFailures, match=r"(?s)last 2 updates.*exception: KeyError "
                     r"\(arithmetic task"):
    trainer._stop_if_only_infra()  # noqa: SLF001
  logged = [r.getMessage() for r in caplog.records]
  assert len(logged) == 2 and logged[1].startswith("rollout host h0: infra failure")
  assert "return {}[task.task_id]" in logged[1]
  host.close()


def test_host_input_errors(tmp_path):
  config = small_config()
  with pytest.raises(ValueError, match="store URL"):
    stream_url("/not/a/url")
  with pytest.raises(TimeoutError, match=r"no trainer under .*empty \(no run/fingerprint"):
    RolloutHost(f"file://{tmp_path}/empty", config, "h0", first_version_timeout_s=0.3)
  publish_fingerprint(Store.open(f"file://{tmp_path}/started"), config)
  with pytest.raises(TimeoutError, match="no weight-stream version"):
    RolloutHost(f"file://{tmp_path}/started", config, "h0", first_version_timeout_s=0.3)
  Store.open(f"file://{tmp_path}/over").write(DONE_KEY, b"")
  with pytest.raises(RunOver):
    RolloutHost(f"file://{tmp_path}/over", config, "h0", first_version_timeout_s=5)
  with pytest.raises(ValueError, match="host id"):
    RolloutHost(f"file://{tmp_path}/empty", config, "bad/id", first_version_timeout_s=0.1)
  del config.async_rl
  with pytest.raises(ValueError, match="async_rl"):
    RolloutHost(f"file://{tmp_path}/empty", config, "h0", first_version_timeout_s=0.1)


def test_host_waiting_for_the_trainer_says_so(tmp_path, caplog):
  caplog.set_level("WARNING")
  with pytest.raises(TimeoutError):
    RolloutHost(f"file://{tmp_path}/empty", small_config(), "h0", first_version_timeout_s=1.5,
                wait_report_s=0.5)
  waits = [r.getMessage() for r in caplog.records if "waiting for the trainer's start" in
           r.getMessage()]
  assert len(waits) >= 2 and "host h0" in waits[0] and f"{tmp_path}/empty" in waits[0], waits


def test_host_whose_config_differs_from_the_trainers_refuses_to_start(tmp_path):
  trainer, host = small_config(), small_config()
  host.rl.temperature = 0.7
  host.model.hidden_size = 64
  host.engine.num_slots = 3  # not fingerprinted: a host may have more or fewer slots
  root = f"file://{tmp_path}/run"
  publish_fingerprint(Store.open(root), trainer)
  Publisher(stream_url(root)).publish(params_of(trainer, 0)[1], 0)
  with pytest.raises(ValueError, match=r"differs from the trainer's \(run/fingerprint.json\) "
                     r"in 2 field\(s\): config.model.hidden_size: trainer \d+, this host 64; "
                     r"config.rl.temperature: trainer 1.0, this host 0.7"):
    RolloutHost(root, host, "h0", first_version_timeout_s=5)


def test_root_probe_writes_reads_and_deletes_or_names_the_flag(tmp_path):
  probe_root(f"file://{tmp_path}/root")
  assert not list((tmp_path / "root" / "run" / "probe").iterdir())  # cleaned up
  (tmp_path / "file").write_text("")
  with pytest.raises(RootUnreachable, match=r"^--root file://.*/file/root: could not write, "
                     r"read back and delete a key within 2 s \("):
    probe_root(f"file://{tmp_path}/file/root", timeout_s=2.0)


def test_rollout_host_without_gcs_credentials_fails_in_the_probe_time_naming_root(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSTORE_GCS",
                                                                   "GOOGLE_"))}
  env["HOME"] = str(tmp_path)  # no gcloud credentials file
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "rollout_host.py"),
       "--root=gs://rljax-no-such-bucket/run", "--host_id=h0", "--root_probe_s=3"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 1
  assert "error: --root gs://rljax-no-such-bucket/run: could not write, read back and delete " \
         "a key within 3 s" in proc.stderr and "credentials" in proc.stderr, proc.stderr[-2000:]


def test_rollout_host_process_serves_groups_and_exits_on_done(tmp_path):
  config = small_config()
  cfg, p0 = params_of(config, 0)
  env = envs.make(config.env.name, **config.env.kwargs.to_dict())
  root = f"file://{tmp_path}/run"
  Publisher(stream_url(root)).publish(p0, 0)
  publish_fingerprint(Store.open(root), config)
  owner = QueueOwner.open(root, QueueConfig(max_outstanding=4, lease_s=120.0,
                                            lease_ttl_s=60.0))
  tasks = env.prompts("train", 2, seed=11)
  owner.submit([(100 + i, wire.task_to_payload(t), GROUP) for i, t in enumerate(tasks)])
  overrides = [f"--config.model.{k}={v}" for k, v in SMALL_MODEL.items()] + [
      "--config.numerics=deterministic", "--config.engine.num_slots=8",
      "--config.async_rl.poll_s=0.01"]
  log = open(tmp_path / "host.log", "w")  # pylint: disable=consider-using-with
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / "experiments" / "rollout_host.py"), f"--root={root}",
       "--config=configs/arith_tiny.py", "--host_id=proc-0", "--first_version_timeout_s=60",
       *overrides], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
  try:
    ready, deadline = {}, time.monotonic() + 120
    while len(ready) < 2 and time.monotonic() < deadline and proc.poll() is None:
      owner.step()
      ready |= {r.group_id: r for r in owner.ready()}
      time.sleep(0.05)
    assert len(ready) == 2, (tmp_path / "host.log").read_text()[-3000:]
    Store.open(root).write(DONE_KEY, b"")
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    log.close()
  assert proc.returncode == 0, (tmp_path / "host.log").read_text()[-3000:]
  last = json.loads(out.strip().splitlines()[-1])
  assert last["exit"] == "done" and last["groups_pushed"] == 2 and last["host_id"] == "proc-0"
  # another process, the same tokens: sampling keys are (seed, group id, sample, position)
  want = reference_groups(config, cfg, p0, env, tasks, first_id=100)
  for i, gid in enumerate([100, 101]):
    assert_same_group(wire.group_from_arrays(ready[gid].arrays, gid), want[i].trajectories)


def test_host_survives_a_bad_version_and_moves_on_at_the_next_good_one(monkeypatch):
  config = small_config()
  params = [params_of(config, seed)[1] for seed in range(3)]
  ctx, root = ts.Context(), "memory://bad-version"
  publish_fingerprint(Store.open(root, ctx), config)
  stream = Store.open(stream_url(root), ctx)
  pub = Publisher(stream, keyframe_every=10)
  pub.publish(params[0], 0)
  host = RolloutHost(root, config, "h0", context=ctx)
  pub.publish(params[1], 1)
  stream.write("manifests/000000000001.json", b'["not a manifest"]')  # parses, wrong type
  for _ in range(3):
    assert host.run_once()
  assert host.engine.version == 0 and host.sub.version == 0
  status = host.status()
  assert status["stream_errors"] >= 3 and "manifest 1" in status["last_stream_error"]
  assert any("not an object" in e for e in host.sub.stats.errors)

  def broken_poll():
    raise StreamError("unreadable")

  monkeypatch.setattr(host.sub, "poll", broken_poll)
  assert host.run_once() and host.status()["last_stream_error"] == "poll: unreadable"
  monkeypatch.undo()
  pub.keyframe_every = 2  # version 2 is a keyframe: the way around the bad version 1
  assert pub.publish(params[2], 2).keyframe
  assert host.run_once() and host.engine.version == 2
  chex.assert_trees_all_equal(host.sub.params, params[2])
  assert all(x is y for x, y in zip(jax.tree.leaves(host.engine.params),
                                    jax.tree.leaves(host.sub.params)))
  host.close()
  assert json.loads(Store.open(root, ctx).read(status_key("h0")))["stream_errors"] >= 4
