"""8-device CPU mesh vs one device (the worker runs in its own process, since the device
count must be set before JAX starts). One worker process per (dtype, mode) (f32: per half
of the layouts, each a value-and-grad compile), started by the first test that needs it:
8 layouts x (1 + 7 programs) would make one test wait for all 32 compiles."""

import json
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).parent / "sharded_worker.py"
BITWISE_LAYOUTS = ("data8", "fsdp8", "expert8", "data2_fsdp2_expert2", "expert4_fsdp2")
MODES = ("deterministic", "fast")
F32_PARTS = (("data8", "fsdp8", "expert8", "data2_fsdp2_expert2"),
             ("expert4_fsdp2", "model2_data4", "model4_data2",
              "expert2_model2_data2"))  # every layout of the worker


@pytest.fixture(scope="module")
def results():
  """results(dtype, mode[, layouts]): the worker's JSON for that part, run once per module."""
  done = {}

  def get(dtype, mode, layouts=()):
    if (dtype, mode, layouts) not in done:
      proc = subprocess.run([sys.executable, str(WORKER), dtype, mode, *(
          [",".join(layouts)] if layouts else [])], capture_output=True, text=True, timeout=900)
      assert proc.returncode == 0, proc.stderr[-4000:]
      out = json.loads(proc.stdout.strip().splitlines()[-1])
      assert out and all(k.startswith(f"{dtype}/{mode}/") for k in out), list(out)
      print(json.dumps(out, indent=1))
      done[dtype, mode, layouts] = out
    return done[dtype, mode, layouts]

  return get


@pytest.mark.multidevice
@pytest.mark.parametrize("layout", BITWISE_LAYOUTS)
def test_det_bf16_sharded_logprobs_are_bitwise_single_device(results, layout):
  out = results("bfloat16", "deterministic")
  assert out[f"bfloat16/deterministic/{layout}"]["logprob_max_abs_diff"] == 0.0


@pytest.mark.multidevice
@pytest.mark.parametrize("layouts", F32_PARTS, ids=("first_half", "second_half"))
@pytest.mark.parametrize("mode", MODES)
def test_f32_forward_and_gradients_match_single_device(results, mode, layouts):
  """f32 everywhere, so the only differences are summation orders: the expert-parallel
  backward sums token gradients with a psum_scatter, f32 GEMMs block rows differently
  per shard. Relative gradient error is O(eps_f32 * log(terms)) ~ 1e-6; bound at 1e-5."""
  out = results("float32", mode, layouts)
  assert sorted(out) == sorted(f"float32/{mode}/{name}" for name in layouts)
  for key, entry in out.items():
    assert entry["logprob_max_abs_diff"] < 1e-5, (key, entry)
    assert entry["grad_max_abs_diff_rel"] < 1e-5, (key, entry)


@pytest.mark.multidevice
def test_fast_mode_differences_are_reported_and_small(results):
  out = {**results("bfloat16", "fast"), **results("bfloat16", "deterministic")}
  checked = [k for k in out if k.startswith("bfloat16/fast/") or "model" in k.split("/")[2]]
  assert len(checked) == 8 + 3, checked
  for key in checked:
    # bf16 with a routing flip is the worst case; anything larger is a bug
    assert out[key]["logprob_max_abs_diff"] < 0.5, (key, out[key])
