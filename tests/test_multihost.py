"""The multi-host trainer, simulated: experiments/pipeline.py as 2 trainer processes x 4
CPU devices joined by jax.distributed (rljax.distributed) on 127.0.0.1 into one 8-device
mesh, with a rollout host process, on a gs:// root served by fake-gcs-server; kill -9 of
one trainer process in the middle of the run, then both restarted with --resume.

Process 0 owns the work queue, the lineage and the metrics; every update it broadcasts a
plan of the batch, each process reads and feeds its part of it, and both run the sharded
GRPO step (fsdp 4 x expert 2 across processes), publish each version writing only the
shards they hold, and write their part of one orbax checkpoint (on gs:// too: orbax
reaches it through etils.epath and gcsfs, pointed at the emulator by
STORAGE_EMULATOR_HOST). Process 1 is killed after update 3; process 0 aborts once its
heartbeats stop (HEARTBEAT_S); both restart from update 2's checkpoint (the drill is one
module fixture and two tests: the abort, then the resume). Checked here: the
survivor's abort, the resumed run (summary, host exit code, lineage cut back and redone,
no group or task trained twice, queue accounting, trained tokens re-scored on the 8-device
mesh with the weights of their versions: check_versions_groups), every version's shards
written once and by one process, a subscriber's checksums on every delta, and the
checkpoint: both processes' parts, restored onto another process count and layout (fsdp 2
x expert 4 over 8 devices in reverse order, in one process) and onto one device, every
leaf bitwise equal both ways, the params' serving bits the stream's newest version.

This file is also the restore worker: `python tests/test_multihost.py CKPT_DIR OUT.npz`.
"""

import dataclasses
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.process_group import free_port, run_together

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
PIPELINE = REPO / "experiments" / "pipeline.py"
HOST = REPO / "experiments" / "rollout_host.py"
BUCKET = "rljax-multihost"
SMALL_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, moe_intermediate_size=16, intermediate_size=32)
TIMEOUT = 600  # hang guards (the kill drill took 33-81 s on 2 cores, cold cache)
# Heartbeats are sent by a thread of the coordination client that holds no GIL: a loaded
# core does not delay them by seconds. At 10 s the survivor took 10-15 s of the drill's
# 50 (cold cache, alone) to abort.
HEARTBEAT_S = 4
STEPS = 4
FLAGS = [f"--config.model.{k}={v}" for k, v in SMALL_MODEL.items()] + [
    "--config.mesh.fsdp=4", "--config.mesh.expert=2", "--config.sft.steps=0",
    "--config.async_rl.check_versions_groups=1000",
    f"--config.rl.steps={STEPS}", "--config.rl.prompts_per_step=4",
    "--config.rl.group_size=4", "--config.eval.num_tasks=2", "--config.eval.n=2",
    "--config.eval.k=2", "--config.eval.every=0", "--config.engine.num_slots=64",
    "--config.async_rl.host_groups=4", "--config.async_rl.checkpoint_every=2",
    "--config.async_rl.lease_ttl_s=4",
    "--config.log.tensorboard=False",
    # both tests' processes run one set of programs (the compile cache's): deterministic
    # numerics, as the lockstep test's bitwise check needs
    "--config.numerics=deterministic"]


def _flat(tree) -> dict:
  import jax
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _env(devices: int) -> dict:
  return {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
          + f" --xla_force_host_platform_device_count={devices}"}


def _trainer_commands(tmp_path, root, *extra) -> list[list[str]]:
  """The trainer's two processes (the same command on each host, but for --process_id);
  a dead peer is noticed within HEARTBEAT_S (--distributed_heartbeat_s)."""
  port = free_port()
  return [[sys.executable, str(PIPELINE), f"--workdir={tmp_path / f'trainer{i}'}",
           f"--root={root}", "--hosts=0", "--progress=false",
           f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
           f"--process_id={i}", f"--distributed_heartbeat_s={HEARTBEAT_S}", *FLAGS, *extra]
          for i in range(2)]


def _updates_logged(workdir) -> int:
  path = workdir / "metrics.jsonl"
  return path.exists() and sum('"phase": "async"' in line for line in open(path))


@pytest.mark.multidevice
def test_two_process_lockstep_loop_is_bitwise_engine_equals_trainer(tmp_path):
  # (first in the file: its programs are most of the kill drill's, which then starts warm,
  # 47 -> 40 s alone)
  # experiments/grpo.py on 2 processes x 4 devices, one workdir: one SPMD engine over the
  # 8-device mesh samples every group on both processes, each feeds its part of the batch;
  # deterministic numerics: every trained token's log-prob equals the engine's, bit for bit
  port = free_port()
  flags = [f for f in FLAGS if "async_rl" not in f and "rl.steps" not in f] + [
      "--config.rl.steps=2"]  # FLAGS: no SFT, deterministic
  outs = run_together(
      [[sys.executable, str(REPO / "experiments" / "grpo.py"), f"--workdir={tmp_path / 'run'}",
        "--progress=false", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
        f"--process_id={i}", "--distributed_heartbeat_s=10", *flags] for i in range(2)],
      timeout_s=TIMEOUT, logs=tmp_path / "lockstep", cwd=str(REPO), env=_env(4))
  summary, other = outs
  assert summary["steps"] == 2 and summary["mismatch_tokens"] > 0
  assert summary["mismatch_max_abs"] == 0.0  # the trainer re-scored every sampled token
  for key in ("heldout_pass1_before", "heldout_pass1_after", "heldout_pass2_after",
              "mismatch_max_abs", "mismatch_tokens"):
    assert other[key] == summary[key], key  # one SPMD run: the same figures everywhere
  state = tmp_path / "run" / "final_params" / "0" / "state"
  assert (state / "ocdbt.process_0").exists() and (state / "ocdbt.process_1").exists()
  records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert sum('"phase": "grpo"' in r for r in records) == 2  # process 0's only


@dataclasses.dataclass
class _Drill:
  tmp_path: pathlib.Path
  root: str
  survivor_code: int
  survivor_err: str
  host: subprocess.Popen


@pytest.fixture(scope="module")
def kill_drill(tmp_path_factory):
  """The async run (2 trainer processes, a rollout host, a gs:// root on fake-gcs-server)
  with process 1 killed -9 after update 3 (update 2's checkpoint written), and the
  survivor's exit. Yields with the server and the host still up: one test checks the
  abort, the next resumes the run (two tests of one drill: each under the 60 s budget)."""
  from tests.fake_gcs import fake_gcs
  tmp_path = tmp_path_factory.mktemp("kill_drill")
  with fake_gcs(BUCKET) as gcs_url, pytest.MonkeyPatch.context() as env:
    env.setenv("STORAGE_EMULATOR_HOST", gcs_url)  # gcsfs (orbax) -> fake server
    # no bucket-type probe through the storage-control API (the emulator has none)
    env.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    root = f"gs://{BUCKET}/runs/async"
    procs = []
    for i, command in enumerate(_trainer_commands(tmp_path, root)):
      err = open(tmp_path / f"trainer{i}.err", "w", encoding="utf-8")  # never blocks
      procs.append(subprocess.Popen(command, cwd=str(REPO), env=_env(4),
                                    stdout=subprocess.DEVNULL, stderr=err))
    host_log = open(tmp_path / "host.log", "a", encoding="utf-8")
    host = subprocess.Popen([sys.executable, str(HOST), f"--root={root}", "--host_id=host0",
                             *FLAGS], cwd=str(REPO), stdout=host_log, stderr=subprocess.STDOUT)
    try:
      # kill -9 process 1 after the checkpoint of update 2, in the middle of the run
      deadline = time.monotonic() + TIMEOUT
      while _updates_logged(tmp_path / "trainer0") < 3:
        assert procs[0].poll() is None and time.monotonic() < deadline, (
            (tmp_path / "trainer0.err").read_text()[-4000:])
        time.sleep(0.5)
      procs[1].send_signal(signal.SIGKILL)
      procs[1].wait()
      code = procs[0].wait(timeout=120)
      yield _Drill(tmp_path, root, code, (tmp_path / "trainer0.err").read_text(), host)
    finally:
      for p in [*procs, host]:
        if p.poll() is None:
          p.kill()
          p.wait()
      host_log.close()


@pytest.mark.multidevice
def test_kill_9_of_one_trainer_process_aborts_the_other(kill_drill):
  # the survivor does not hang in a collective: it aborts, told of the death by the
  # coordination service's heartbeats ("another task died"), or first by Gloo, whose
  # connection to the dead process breaks mid-collective ("Gloo all-reduce failed: ...
  # Connection reset by peer", or a torn message: "gloo::EnforceNotMet ... Received
  # data size doesn't match expected size")
  assert kill_drill.survivor_code != 0
  assert re.search(r"another task died|Gloo [\w-]+ failed|gloo::", kill_drill.survivor_err), (
      kill_drill.survivor_err[-4000:])


@pytest.mark.multidevice
def test_the_killed_two_process_run_on_gcs_resumes_from_its_checkpoint(kill_drill):
  tmp_path, root = kill_drill.tmp_path, kill_drill.root
  outs = run_together(_trainer_commands(tmp_path, root, "--resume"),  # from the checkpoint
                      timeout_s=TIMEOUT, logs=tmp_path / "resumed", cwd=str(REPO), env=_env(4))
  host_code = kill_drill.host.wait(timeout=120)
  summary, other = outs
  # the checkpoint restored in another process (8 devices, another layout): started now,
  # it loads while this process checks the run and the stream
  ckpt_dir = f"{root}/trainer/checkpoints"
  worker_out = open(tmp_path / "restore.out", "w+", encoding="utf-8")
  worker_err = open(tmp_path / "restore.err", "w+", encoding="utf-8")
  worker = subprocess.Popen([sys.executable, str(HERE), ckpt_dir, str(tmp_path / "other.npz")],
                            cwd=str(REPO), env=_env(8), stdout=worker_out, stderr=worker_err,
                            text=True)
  try:
    _check_run_stream_and_checkpoint(tmp_path, root, ckpt_dir, summary, other, host_code,
                                     worker)
  finally:
    if worker.poll() is None:
      worker.kill()
      worker.wait()
    worker_out.close()
    worker_err.close()


def _check_run_stream_and_checkpoint(tmp_path, root, ckpt_dir, summary, other, host_code,
                                     worker):
  import jax
  import numpy as np
  from rljax.pipeline.metrics import read_jsonl
  from rljax.sync import Store, Subscriber
  from rljax.sync import manifest as fmt
  # the run: process 0's summary, lineage and queue, resumed; process 1 wrote nothing
  assert summary["processes"] == 2 and summary["devices"] == 8
  assert summary["updates"] == STEPS and summary["resumed_from_update"] == 2
  assert summary["resumed_stream_version"] == 2 and host_code == 0
  final = summary["steps"]  # versions the dead run published after update 2 are skipped
  q = summary["queue"]
  assert q["trained"] == 4 * STEPS + summary["requeued_after_rollback"]  # lost ones too
  assert q["submitted"] == (q["trained"] + q["dropped"] + q["pending"] + q["leased"]
                            + q["ready"]), q
  assert other == {"process_index": 1, "processes": 2, "updates": STEPS, "steps": final,
                   "workdir": str(tmp_path / "trainer1"),
                   "heldout_pass1_after": summary["heldout_pass1_after"]}  # one SPMD eval
  lineage = read_jsonl(tmp_path / "trainer0" / "trained_groups.jsonl")
  assert [l["update"] for l in lineage] == list(range(1, STEPS + 1))  # cut back, redone
  versions = [l["version"] for l in lineage]
  assert versions[:2] == [1, 2] and versions == sorted(versions) and versions[-1] == final
  groups = [g for l in lineage for g in l["groups"]]
  assert len(groups) == len(set(groups)) == 4 * STEPS  # none trained twice
  tasks = [t["task_id"] for l in lineage for t in l["tasks"]]
  assert len(tasks) == len(set(tasks))  # a requeued task is not trained twice either
  assert {h for l in lineage for h in l["hosts"]} == {"host0"}
  records = read_jsonl(tmp_path / "trainer0" / "metrics.jsonl")
  trained = [r["updates"] for r in records if r["phase"] == "async"]
  assert trained[:3] == [1, 2, 3] and trained[-2:] == [3, 4], trained  # 3: the lost one
  tokens = summary["own_version_tokens"]  # every token re-scored with its version ...
  assert tokens["checked"] > 0  # ... but the abandoned versions' (no longer held)
  evals = [r for r in records if r["phase"] == "eval"]
  assert len(evals) == 4  # init, before; before (resumed), after
  assert not (tmp_path / "trainer1" / "metrics.jsonl").exists()

  # the stream: every version's shards written once, by one process, all of them covered
  store = Store.open(f"{root}/stream/")
  for v in range(final + 1):
    raw = store.read(fmt.manifest_key(v))
    if raw is None:  # the dead run's, cut short
      continue
    manifest = fmt.Manifest.from_bytes(raw)
    by_process = []
    for proc in range(2):
      index = json.loads(store.read(fmt.index_key(v, proc)))
      by_process.append({e["key"] for group in index.values() for entries in group.values()
                         for e in entries})
    assert by_process[0] and by_process[1] and not by_process[0] & by_process[1], v
    want = {s.key for group in (manifest.tensors, manifest.deltas or {})
            for t in group.values() for s in t.shards}
    assert by_process[0] | by_process[1] == want, v
  sub = Subscriber(f"{root}/stream/")
  assert sub.poll() == final and not sub.stats.errors  # checksums of every delta

  # the checkpoint: both processes' parts; restored in another process onto 8 devices
  # in another layout, and here onto one device; the serving bits are the stream's
  from etils import epath
  state_dir = epath.Path(ckpt_dir) / str(STEPS) / "state"
  assert (state_dir / "ocdbt.process_0").exists() and (state_dir / "ocdbt.process_1").exists()
  restored = _restore(ckpt_dir, None)
  assert restored.step == STEPS and restored.stream_version == final
  state = restored.state["state"]
  assert int(state.step) == STEPS
  flat = _flat(state)
  code = worker.wait(timeout=TIMEOUT)
  assert code == 0, (tmp_path / "restore.err").read_text()[-4000:]
  assert json.loads((tmp_path / "restore.out").read_text().strip().splitlines()[-1])[
      "resharded_leaves"] > 0
  other_layout = np.load(tmp_path / "other.npz")
  assert sorted(flat) == sorted(other_layout.files)
  for k, x in flat.items():
    assert x.sharding.device_set == {jax.devices()[0]}
    got = np.asarray(x)
    assert got.dtype == other_layout[k].dtype and got.tobytes() == other_layout[k].tobytes(), k
  streamed = {p: np.asarray(x) for p, x in fmt.flatten(sub.params).items()}
  served = {p: np.asarray(x.astype(streamed[p].dtype))
            for p, x in fmt.flatten(state.params).items()}
  assert sorted(streamed) == sorted(served)
  for p in streamed:
    assert streamed[p].tobytes() == served[p].tobytes(), p


def _config():
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.model.update(SMALL_MODEL)
  return config


def _restore(ckpt_dir, sharding):
  """The run's checkpoint onto `sharding` (a rljax Sharding), or onto device 0 if None."""
  import jax
  import jax.numpy as jnp
  import optax
  from rljax.checkpoint import Checkpointer, abstract_like
  from rljax.model import ModelConfig, abstract_params
  from rljax.rl import learner
  config = _config()
  c = config.rl
  cfg = ModelConfig.from_dict(config.model.to_dict())
  opt = learner.make_optimizer(optax.constant_schedule(c.learning_rate),  # same state tree
                               weight_decay=c.weight_decay, clip_norm=c.clip_norm, b2=c.adam_b2)
  abstract = jax.eval_shape(lambda p: learner.init_state(p, opt),
                            abstract_params(cfg, jnp.float32))
  if sharding is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          abstract)
  else:
    target = abstract_like(abstract, learner.state_shardings(cfg, opt, sharding))
  with Checkpointer(ckpt_dir, async_save=False) as ckpt:
    return ckpt.restore({"state": target})


def restore_worker(ckpt_dir: str, out: str) -> None:
  """One process, 8 devices: the checkpoint 2 processes x 4 devices wrote on fsdp 4 x
  expert 2, restored onto fsdp 2 x expert 4 over the devices in reverse order."""
  sys.path.insert(0, str(REPO))
  import jax
  import numpy as np
  from rljax import sharding as sharding_lib
  assert jax.device_count() == 8 and jax.process_count() == 1
  other = sharding_lib.Sharding(sharding_lib.make_mesh({"fsdp": 2, "expert": 4},
                                                       jax.devices()[::-1]))
  restored = _restore(ckpt_dir, other)
  flat = _flat(restored.state["state"])
  np.savez(out, **{k: np.asarray(x) for k, x in flat.items()})
  print(json.dumps({"resharded_leaves": sum(len(x.sharding.device_set) > 1
                                            and not x.sharding.is_fully_replicated
                                            for x in flat.values())}))


def test_single_process_is_a_noop():
  from rljax import distributed
  assert not distributed.initialize()
  assert not distributed.initialize("127.0.0.1:1", num_processes=1, process_id=0)
  assert distributed.broadcast_bytes(b"x") == b"x"
  distributed.check_mesh({"data": 3})  # one process: any mesh of its devices


def test_an_unreachable_coordinator_fails_within_the_timeout_naming_the_flag():
  from rljax import distributed
  with socket.socket() as s:  # a port nobody listens on: bound, never listening
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TimeoutError, match=r"--coordinator_address 127\.0\.0\.1:\d+: no "
                       r"coordinator answered within 2 s"):
      distributed.initialize(address, num_processes=2, process_id=1, timeout_s=2.0)
  with pytest.raises(ValueError, match="HOST:PORT"):
    distributed.wait_for_coordinator("no-port", 1.0)


def test_several_processes_need_a_mesh_of_every_device_and_a_shared_root(monkeypatch):
  import jax
  from rljax import distributed
  from rljax.pipeline import layout
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  distributed.check_mesh({"fsdp": 4, "expert": 2, "data": 1})
  with pytest.raises(ValueError, match=r"has 4 devices but the 2 processes hold 8"):
    distributed.check_mesh({"fsdp": 4})
  assert layout.trainer_dir("gs://b/run/", "/w") == "gs://b/run/trainer"
  assert layout.trainer_dir("file:///shared/run", "/w") == "/shared/run/trainer"
  with pytest.raises(ValueError, match="needs a root they all reach"):
    layout.trainer_dir("memory://run", "/w")


if __name__ == "__main__":
  restore_worker(sys.argv[1], sys.argv[2])
