"""The decode engine and a rollout host on a mesh of 8 simulated CPU devices (decode rules:
weights replicated over fsdp, slots and the KV page pool split over data/fsdp/expert).

They run in worker processes (`engine_sharded_worker.py`), started together."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).parent / "engine_sharded_worker.py"


@pytest.fixture(scope="module")
def results():
  procs = {part: subprocess.Popen([sys.executable, str(WORKER), part], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=dict(os.environ))
           for part in ("engine", "kernels", "host")}
  out = {}
  for part, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    out |= json.loads(stdout.strip().splitlines()[-1])
  return out


@pytest.mark.multidevice
@pytest.mark.parametrize("layout", ["data8", "data2_expert4"])
def test_deterministic_sharded_engine_is_bitwise_the_one_device_engine(results, layout):
  r = results["engine"][layout]
  assert r["same_keys"] and r["tokens_equal"]
  assert r["logprob_bits_equal"], r["logprob_max_abs_diff"]


@pytest.mark.multidevice
def test_the_serving_layout_on_a_mesh_changes_no_bit(results):
  r = results["engine"]["serving_layout"]
  assert r["decode_compiled_ahead"] and r["same_keys"] and r["tokens_equal"]
  assert r["logprob_bits_equal"], r["logprob_max_abs_diff"]


@pytest.mark.multidevice
def test_sharded_engine_logprobs_are_the_trainers_bitwise(results):
  assert results["engine"]["data8"]["trainer_bits_equal"]


@pytest.mark.multidevice
def test_the_attention_kernel_on_a_mesh_keeps_engine_and_trainer_bitwise(results):
  """Deterministic attention by the Pallas kernel (interpreted) under shard_map: the engine
  on {data 2, expert 4} (a row's pages gathered, then the packed kernel) and the training
  forward on {data 2, fsdp 2, expert 2} give the 1-device jnp engine's tokens and bits."""
  r = results["kernels"]
  assert r["same_keys"] and r["tokens_equal"]
  assert r["logprob_bits_equal"], r["logprob_max_abs_diff"]
  assert r["trainer_bits_equal"]


@pytest.mark.multidevice
@pytest.mark.parametrize("layout", ["data8", "data2_expert4"])
def test_page_pool_is_split_over_the_devices_not_replicated(results, layout):
  r = results["engine"][layout]
  assert r["pool_pages"] % 8 == 0 and r["pool_pages_per_device"] == r["pool_pages"] // 8, r


@pytest.mark.multidevice
def test_deterministic_engine_refuses_one_slot_per_device(results):
  assert "at least 8 per device (so >= 64), got 16" in results["engine"]["too_few_slots_error"]


@pytest.mark.multidevice
def test_rollout_host_on_an_engine_mesh_follows_the_stream_bitwise(results):
  r = results["host"]
  assert r["sharded"] and r["weights_spec"] == "P(None, None, 'expert', None)"
  assert r["applied"] == [0, 1, 2] and r["version"] == 2 and not r["errors"]
  assert r["groups_equal"] == [True] * 4  # v0 and v1 groups = a 1-device engine's
  assert r["in_place"] and r["engine_holds_subscriber_arrays"]
