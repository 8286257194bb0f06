"""The decode engine SPMD over two jax.distributed processes (4 simulated CPU devices each,
one 8-device mesh: the trainer's config.mesh fsdp 4 x expert 2 with the decode rules).

Both processes run `engine_multiprocess_worker.py` in lockstep; process 0 also serves the
same requests on a 1-device engine."""

import pathlib
import sys

import chex
import numpy as np
import pytest

from tests.process_group import free_port, run_together

WORKER = pathlib.Path(__file__).parent / "engine_multiprocess_worker.py"
TIMEOUT = 600


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  port = free_port()
  return run_together([[sys.executable, str(WORKER), str(port), str(i)] for i in range(2)],
                      TIMEOUT, tmp_path_factory.mktemp("engine_multiprocess"))


def _arrays(records: dict) -> dict:
  """Each sample's records as numpy arrays (log-probs as their uint32 bits)."""
  return {key: {field: np.asarray(value) for field, value in r.items()}
          for key, r in records.items()}


@pytest.mark.multidevice
def test_both_processes_read_back_the_same_samples(results):
  assert [r["process"] for r in results] == [0, 1]
  chex.assert_trees_all_equal(_arrays(results[0]["engine"]), _arrays(results[1]["engine"]))


@pytest.mark.multidevice
def test_cross_process_engine_is_bitwise_the_one_device_engine(results):
  got, want = _arrays(results[0]["engine"]), _arrays(results[0]["reference"])
  assert sorted(got) == sorted(want) and len(got) == 4 * 4 + 2
  chex.assert_trees_all_equal(got, want)  # token ids, log-prob bits, versions, routing
  versions = {k: set(r["versions"].tolist()) for k, r in got.items()}
  assert all(v <= {0, 1} for v in versions.values())
  assert sum(v == {0, 1} for v in versions.values()) >= 8, versions  # new weights mid-way


@pytest.mark.multidevice
def test_the_serving_layout_across_processes_changes_no_bit(results):
  for r in results:
    assert r["serving_layout_chosen"]
    chex.assert_trees_all_equal(_arrays(r["serving_layout"]), _arrays(results[0]["reference"]))


@pytest.mark.multidevice
def test_trainer_layout_params_are_resharded_by_the_decode_rules(results):
  for r in results:
    p = r["placement"]
    assert p["trainer_gate_spec"] == "P(None, 'fsdp', 'expert', None)"
    assert not p["trainer_gate_fully_addressable"]
    # replicated over fsdp, split over expert: each device holds half the experts
    assert p["engine_gate_spec"] == "P(None, None, 'expert', None)"
    assert p["engine_gate_block"][2] * 2 == p["engine_gate_shape"][2]
    # resharding (an all-gather over fsdp) never made a value larger than one device's
    # block of the tensor on the engine: no full copy anywhere
    assert p["reshard_largest_value"] == 1, p
    assert p["pool_pages"] % 8 == 0 and p["pool_pages_per_device"] * 8 == p["pool_pages"]


@pytest.mark.multidevice
def test_env_answers_are_process_0_s_on_every_process(results):
  # each process's env answers differently (observation tokens and length, step info,
  # reward, outcome); both processes drive one engine, and every episode is process 0's
  mine, theirs = results[0]["episodes"], results[1]["episodes"]
  assert mine == theirs and len(mine) == 6
  for key, e in mine.items():
    mask = np.asarray(e["loss_mask"])
    observation = np.asarray(e["completion"])[~mask]
    assert observation.tolist() == [5, 5], key  # process 0's: 2 tokens of id 5
    assert e["info"] == {"turns": 2, "tool_calls": 1.0}, key
    assert e["outcome"] == "model_failure", key
    assert e["reward"] == 0.25 + len(e["completion"]) % 3, key
