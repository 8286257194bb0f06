"""experiments/device_check.py --quick on CPU: rc 0, the last line one JSON object, and its
checks passed. It runs in two halves (`--sections`): the kernels with engine = trainer,
and the det/fast step cost, on tiny_moe here (the default, sparse_moe_tiny's 128 experts,
compiles for ~50 s per mode on a slow CPU: that is the device run's workload, not the
smoke test's); a third run checks that a failing section is reported in the JSON while
the others still run."""

import json
import math
import os
import pathlib
import subprocess
import sys

from tests.xla_flags import production_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "device_check.py"


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"} if env is None else env
  proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300,
                        check=False)  # a hang guard
  lines = proc.stdout.strip().splitlines()
  assert lines, proc.stderr[-3000:]
  return proc.returncode, json.loads(lines[-1])


def test_kernels_and_engine_equals_trainer():
  # compiled as the product compiles (the rest of the suite runs LLVM at -O0): engine =
  # trainer bitwise at XLA's default optimization level
  rc, report = _run("--sections=platform,grouped_matmul,paged_attention,engine_vs_trainer",
                    env=production_env(JAX_PLATFORMS="cpu"))
  assert rc == 0 and report["ok"] is True, report
  assert report["platform"]["backend"] == "cpu"
  gmm = report["grouped_matmul"]
  assert gmm["batch_invariant_bitwise"] is True
  assert gmm["small"]["batch_invariance"] == {"n1": True, "n5": True, "permuted": True}
  assert 0.0 <= gmm["small"]["max_diff_over_bound"] <= 1.0
  assert "skipped" in gmm["qwen3_30b_a3b"]
  assert report["paged_attention"]["ok"] is True
  assert report["engine_vs_trainer"]["deterministic_max_abs_logprob_diff"] == 0.0
  assert math.isfinite(report["engine_vs_trainer"]["fast_max_abs_logprob_diff"])


def test_det_fast_cost_in_separate_processes():
  rc, report = _run("--sections=det_fast_cost", "--config=configs/tiny_moe.py")
  assert rc == 0 and report["ok"] is True, report
  cost = report["det_fast_cost"]
  assert cost["separate_processes"] is True
  for key in ("det_over_fast_train_step", "det_over_fast_decode_step"):
    assert math.isfinite(cost[key]) and cost[key] > 0, cost
  assert cost["paths"]["deterministic"]["train_experts"] == "tiled"


def test_a_failing_section_is_reported_and_the_rest_run():
  rc, report = _run("--sections=platform,det_fast_cost", "--config=configs/no_such.py")
  assert rc == 1 and report["ok"] is False and report["failed"] == ["det_fast_cost"], report
  assert "no_such.py" in report["det_fast_cost"]["error"]
  assert report["platform"]["ok"] is True
