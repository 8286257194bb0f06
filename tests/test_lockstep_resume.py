"""The lockstep loop's checkpoints: a run killed with SIGKILL and resumed with --resume goes
on bitwise as the uninterrupted run (deterministic numerics): its train state, task
stream, request ids (sampling seeds), KL reference and alarms."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rljax.pipeline.metrics import read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a small policy, a short SFT warm start (so episodes end and partial credit gives groups
# an advantage: updates that move the params), a checkpoint every step, 2 evaluations
ARGS = ["--progress=false", "--config.numerics=deterministic",
        "--config.model.hidden_size=32", "--config.model.num_hidden_layers=2",
        "--config.model.num_attention_heads=2", "--config.model.num_key_value_heads=1",
        "--config.model.moe_intermediate_size=16", "--config.model.intermediate_size=32",
        "--config.env.kwargs.partial_credit=0.5", "--config.sft.steps=40",
        "--config.sft.warmup_steps=5", "--config.sft.target_pass1=0",
        "--config.sft.batch_size=16", "--config.sft.log_every=10",
        "--config.rl.steps=8", "--config.rl.prompts_per_step=2", "--config.rl.group_size=4",
        "--config.rl.checkpoint_every=1", "--config.eval.num_tasks=2", "--config.eval.n=2",
        "--config.eval.k=2", "--config.eval.every=3", "--config.log.tensorboard=False"]


def _start(workdir, *flags):
  os.makedirs(workdir, exist_ok=True)
  err = open(os.path.join(workdir, "stderr.txt"), "a", encoding="utf-8")  # never blocks
  proc = subprocess.Popen([sys.executable, str(ROOT / "experiments" / "grpo.py"),
                           f"--workdir={workdir}", *ARGS, *flags],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
  proc.err_path = err.name
  return proc


def _finish(proc) -> dict:
  out, _ = proc.communicate(timeout=300)
  with open(proc.err_path, encoding="utf-8") as f:
    assert proc.returncode == 0, f.read()[-4000:]
  return json.loads(out.strip().splitlines()[-1])


def _checkpoints(workdir) -> list[int]:
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(
      directory) else []


def _untimed(record: dict) -> dict:
  return {k: v for k, v in record.items() if not k.endswith("_s")}


def _tree(path):
  return jax.tree.leaves(ocp.StandardCheckpointer().restore(str(path)))


def _assert_bitwise(a, b):
  a, b = _tree(a), _tree(b)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """Run A: all 8 steps in one process (workdir, summary)."""
  workdir = tmp_path_factory.mktemp("lockstep_a")
  return workdir, _finish(_start(workdir))


def test_a_killed_run_resumes_bitwise_where_its_checkpoint_left_off(uninterrupted, tmp_path):
  a_dir, a = uninterrupted
  b_dir = tmp_path / "b"
  proc = _start(b_dir)
  deadline = time.monotonic() + 120
  while not any(step >= 2 for step in _checkpoints(b_dir)):  # step 2's is on disk
    assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint 2"
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = max(_checkpoints(b_dir))
  assert 2 <= killed_at < 8, killed_at  # killed mid-loop (SFT, checkpoints 1-2 done)
  b = _finish(_start(b_dir, "--resume"))
  assert b["resumed_from_step"] == killed_at and b["steps"] == a["steps"] == 8
  assert "sft_steps" in b and b["sft_nll"] == a["sft_nll"]  # carried, SFT not rerun
  assert _untimed(b) | {"resumed_from_step": 0} == _untimed(a) | {
      "resumed_from_step": 0, "final_params": b["final_params"], "workdir": b["workdir"]}
  a_log, b_log = read_jsonl(str(a_dir / "metrics.jsonl")), read_jsonl(str(b_dir / "metrics.jsonl"))
  assert sum(r["phase"] == "sft" for r in b_log) == sum(r["phase"] == "sft" for r in a_log)
  resumed = b_log[max(i for i, r in enumerate(b_log) if r["phase"] == "run"):]
  after = [_untimed(r) for r in a_log if r["phase"] in ("grpo", "eval") and r["step"] > killed_at]
  assert [_untimed(r) for r in resumed if r["phase"] in ("grpo", "eval")] == after
  assert [r["step"] for r in resumed if r["phase"] == "grpo"] == list(range(killed_at + 1, 9))
  assert any(r["grad_norm"] > 0 for r in resumed if r["phase"] == "grpo")  # params moved
  _assert_bitwise(a_dir / "final_params" / "0" / "state", b_dir / "final_params" / "0" / "state")
  # the whole train state (Adam's moments, its step) of the last checkpoint too
  _assert_bitwise(a_dir / "checkpoints" / "8" / "state", b_dir / "checkpoints" / "8" / "state")


def test_a_workdir_with_a_checkpoint_is_refused_without_resume(uninterrupted, tmp_path):
  a_dir, _ = uninterrupted
  killed = tmp_path / "killed"  # A's workdir as a run killed after its last checkpoint left it
  shutil.copytree(a_dir, killed, ignore=shutil.ignore_patterns("final_params"))
  proc = _start(killed)
  out, _ = proc.communicate(timeout=120)
  with open(proc.err_path, encoding="utf-8") as f:
    err = f.read()
  assert proc.returncode != 0 and "pass --resume to continue it" in err, err[-4000:]
  assert not out.strip()


@pytest.mark.parametrize("value", [-1, True])  # (ml_collections refuses a float or str)
def test_a_bad_checkpoint_every_is_a_config_error(value):
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import run  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.rl.checkpoint_every = value
  with pytest.raises(run.ConfigError, match="config.rl.checkpoint_every must be an int >= 0"):
    run.validate(config, run.LOCKSTEP)
