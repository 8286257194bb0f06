"""The async pipeline end to end: a trainer process and rollout-host processes that share
only a storage root; kill -9 drills; a gs:// root on fake-gcs-server; async fidelity."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rljax.pipeline.async_loop import group_staleness
from rljax.pipeline.metrics import read_jsonl
from rljax.rl.trajectory import FinishReason, Trajectory
from tests.fake_gcs import fake_gcs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "experiments" / "pipeline.py"
HOST = ROOT / "experiments" / "rollout_host.py"

# a smaller policy than arith_tiny's (compiles faster), short phases: no SFT warm start
# (nothing here tests it; test_lora_stream's killed trainer adds one), 4 eval tasks
SMALL = ["--config.model.hidden_size=64", "--config.model.num_hidden_layers=2",
         "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2",
         "--config.model.moe_intermediate_size=64", "--config.model.intermediate_size=128",
         "--config.sft.steps=0", "--config.sft.target_pass1=0", "--config.sft.log_every=10",
         "--config.rl.prompts_per_step=4", "--config.rl.group_size=4",
         "--config.eval.num_tasks=4", "--config.eval.n=2", "--config.eval.k=2",
         "--config.eval.every=0", "--config.engine.num_slots=16",
         "--config.async_rl.host_groups=4", "--config.async_rl.checkpoint_every=2",
         "--config.rl.dynamic_sampling_rounds=1",
         "--config.log.tensorboard=False"]
# the two end-to-end runs' processes share their programs (the compile cache's):
# deterministic numerics, every group's tokens re-scored (the check's program)
SHARED = ["--config.numerics=deterministic", "--config.async_rl.check_versions_groups=1000"]


def _strict_json(line: str) -> dict:
  def bad(name):
    raise ValueError(f"non-JSON constant {name}")
  return json.loads(line, parse_constant=bad)


def _trainer(workdir, root, *overrides, hosts):
  os.makedirs(workdir, exist_ok=True)
  err = open(os.path.join(workdir, "trainer.err"), "a", encoding="utf-8")  # never blocks
  proc = subprocess.Popen(
      [sys.executable, str(PIPELINE), f"--workdir={workdir}", f"--root={root}",
       f"--hosts={hosts}", "--progress=false", *SMALL, *overrides],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
  proc.err_path = err.name
  return proc


def _stderr(proc) -> str:
  with open(proc.err_path, encoding="utf-8") as f:
    return f.read()[-4000:]


def _host(root, host_id, *overrides, log):
  return subprocess.Popen(
      [sys.executable, str(HOST), f"--root={root}", f"--host_id={host_id}", *SMALL, *overrides],
      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _finish(proc, timeout=600) -> dict:
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, _stderr(proc)
  return _strict_json(out.strip().splitlines()[-1])


def _updates_logged(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  return sum(r["phase"] == "async" for r in read_jsonl(path))


def _wait_for(predicate, what, proc, timeout=300):
  deadline = time.monotonic() + timeout
  while not predicate():
    if proc.poll() is not None:
      raise AssertionError(f"trainer exited ({proc.returncode}) waiting for {what}: "
                           f"{_stderr(proc)}")
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.5)


def _accounting_holds(queue: dict) -> None:
  assert queue["submitted"] == (queue["trained"] + queue["dropped"] + queue["pending"]
                                + queue["leased"] + queue["ready"]), queue


def test_group_staleness_is_trainer_version_minus_oldest_sampling_version():
  def traj(versions):
    versions = np.asarray(versions, np.int32)
    return Trajectory(np.array([1, 2], np.int32), np.arange(len(versions), dtype=np.int32),
                      versions >= 0, np.zeros(len(versions), np.float32), versions, None,
                      FinishReason.EOS)
  assert group_staleness(7, [traj([5, 6, -1]), traj([6, 7])]) == 2
  assert group_staleness(7, [traj([-1])]) == 0  # nothing sampled: nothing stale


def test_the_kl_reference_is_saved_once_and_restored_bitwise(tmp_path):
  # rl.kl_to_start (arith_tiny's) in the async trainer: the start policy is saved beside
  # the checkpoints when a run starts and restored by --resume (the KL stays to the start)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.model import init_params  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import async_loop  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import ASYNC_TRAINER, build  # pylint: disable=import-outside-toplevel
  built = build(arith_tiny.get_config(), ASYNC_TRAINER)
  assert built.kl_to_start
  start = jax.tree.map(lambda x: x.astype(built.cfg.weight_dtype),
                       init_params(built.cfg, jax.random.key(3), jnp.float32))
  with pytest.raises(FileNotFoundError, match="kl_to_start=False"):
    async_loop.restore_reference(str(tmp_path), built)
  async_loop.save_reference(str(tmp_path), start)
  restored = async_loop.restore_reference(str(tmp_path), built)
  for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(restored)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(FileExistsError, match="start policy"):
    async_loop.save_reference(str(tmp_path), start)
  # a fresh run's reference is placed as a restored one is (committed to the device): jit
  # compiled the GRPO step again, 10-15 s, in every resumed trainer
  from rljax.pipeline import core, grpo_update  # pylint: disable=import-outside-toplevel
  fresh = grpo_update.grpo_learner(core.setup(built, str(tmp_path / "w"), engine=False))
  for a, b in zip(jax.tree.leaves(fresh.ref_params), jax.tree.leaves(restored)):
    assert a.committed and b.committed and a.sharding == b.sharding


def test_pipeline_on_gcs_two_hosts_deterministic_every_token_matches_its_version(tmp_path):
  # Trainer + 2 host processes on a gs:// root; deterministic numerics with KV recomputed
  # on weight updates: every trained token's behaviour log-prob equals the trainer's
  # log-prob under the weights of the version that sampled it, bit for bit.
  with fake_gcs("rljax-async"):
    proc = _trainer(tmp_path / "run", "gs://rljax-async/run", "--config.rl.steps=4", *SHARED,
                    "--config.async_rl.weight_update=recompute",
                    "--config.rl.dynamic_sampling_rounds=2", hosts=2)
    summary = _finish(proc)
  assert summary["updates"] == 4 and summary["host_exit_codes"] == [0, 0]
  assert summary["own_version_mismatch_max_abs"] == 0.0
  assert summary["own_version_tokens"]["checked"] > 0
  # tokens of the version being trained: 0.0 over the ones there were, null if none
  if summary["mismatch_tokens"]:
    assert summary["mismatch_max_abs"] == 0.0
  else:
    assert summary["mismatch_max_abs"] is None
  queue = summary["queue"]
  _accounting_holds(queue)
  assert queue["trained"] == 4 * 4
  # dynamic sampling: up to 2 * (2 - 1) * 4 groups whose rewards tie dropped per update
  assert queue["dropped"] == summary["dropped_no_signal"] + summary["dropped_stale"]
  assert summary["dropped_no_signal"] <= 4 * 8
  assert 0.0 <= summary["mean_staleness"] <= 2 and summary["ttb_s"] > 0
  run = tmp_path / "run"
  assert (run / "reward_curve.png").exists()
  records = [r for r in read_jsonl(str(run / "metrics.jsonl")) if r["phase"] == "async"]
  assert len(records) == 4
  for key in ("ttb_s", "trainer_stall_s", "staleness_mean", "staleness_max", "train_s",
              "dropped_stale", "success_frac", "mismatch_k3_kl"):
    assert key in records[-1], key
  assert any(k.endswith("_publish_to_apply_s") for r in records for k in r)
  assert any(k.endswith("_apply_pause_s") for r in records for k in r)
  trained = [g for line in (run / "trained_groups.jsonl").read_text().splitlines()
             for g in json.loads(line)["groups"]]
  assert len(trained) == len(set(trained)) == 16
  # the final train state exports to a checkpoint transformers loads (mapping and parity:
  # test_hf_import.py); its last update's checkpoint is the one exported
  out = tmp_path / "hf"
  proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "export_hf.py"),
                         f"--checkpoint={run / 'checkpoints'}", f"--out={out}", *SMALL],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
  import transformers  # pylint: disable=g-import-not-at-top  (test extras)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
  assert sum(p.numel() for p in model.parameters()) == json.loads(
      proc.stdout.strip().splitlines()[-1])["params"]


def test_kill_a_host_then_the_trainer_and_the_run_finishes(tmp_path):
  # kill -9 a host mid-run (its leases expire, its groups go to the other host or to its
  # restarted self, which rejoins the stream from a keyframe); then kill -9 the trainer
  # (a restart resumes from its checkpoint and the stream version it recorded; the hosts
  # carry on). No group is lost or trained twice; every prompt is accounted for.
  workdir, root = tmp_path / "run", f"file://{tmp_path / 'root'}/"
  overrides = ["--config.rl.steps=8", *SHARED, "--config.async_rl.lease_ttl_s=4"]
  logs = [open(tmp_path / f"host{i}.log", "a", encoding="utf-8") for i in range(2)]
  trainer = _trainer(workdir, root, *overrides, hosts=0)
  hosts = [_host(root, f"host{i}", *overrides, log=logs[i]) for i in range(2)]
  try:
    _wait_for(lambda: _updates_logged(workdir) >= 2, "2 updates", trainer)
    hosts[0].send_signal(signal.SIGKILL)
    hosts[0].wait()
    hosts[0] = _host(root, "host0", *overrides, log=logs[0])
    _wait_for(lambda: _updates_logged(workdir) >= 5, "5 updates", trainer)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    again = _trainer(workdir, root, *overrides, hosts=0)  # without --resume: refused
    assert again.wait(timeout=300) != 0 and "pass --resume to continue it" in _stderr(again)
    trainer = _trainer(workdir, root, *overrides, "--resume", hosts=0)
    summary = _finish(trainer)
    codes = [h.wait(timeout=120) for h in hosts]
  finally:
    for p in [trainer, *hosts]:
      if p.poll() is None:
        p.kill()
    for log in logs:
      log.close()
  assert codes == [0, 0]
  assert summary["updates"] == 8 and summary["resumed_from_update"] >= 2
  _accounting_holds(summary["queue"])
  # trained_groups.jsonl is the run's lineage: updates after the checkpoint the restart
  # resumed from were rolled back (their tasks requeued), then trained again
  lines = [json.loads(l) for l in (workdir / "trained_groups.jsonl").read_text().splitlines()]
  assert [l["update"] for l in lines] == list(range(1, 9))
  groups = [g for l in lines for g in l["groups"]]
  assert len(groups) == len(set(groups)) == 8 * 4  # none trained twice
  tasks = [t["task_id"] for l in lines for t in l["tasks"]]
  assert len(tasks) == len(set(tasks))  # a requeued task is not trained twice either
  status = json.loads(pathlib.Path(tmp_path / "root" / "run" / "hosts" / "host0.json")
                      .read_text())
  assert status["applied"][0][0] > 0  # the restarted host joined a later version
