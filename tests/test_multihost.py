"""The multi-host trainer, simulated: 2 processes x 4 CPU devices joined by
jax.distributed (rljax.distributed) on 127.0.0.1 into one 8-device mesh.

Both processes run the sharded GRPO update (fsdp 4 x expert 2 across processes), publish
each version to a weight stream on gs:// (fake-gcs-server) writing only the shards they
hold, and write their part of one orbax checkpoint. Here, a Subscriber follows the stream
version by version (the workers wait for its ack) and must match, bit for bit, the bf16
params process 0 gathered from both processes. The checkpoint goes to gs:// on the same
fake server (orbax reaches gs:// through etils.epath and gcsfs, pointed at the emulator by
STORAGE_EMULATOR_HOST); the workers restore it onto another 8-device layout (fsdp 2 x
expert 4 over the devices in reverse order) and this process restores it onto one device
(another process count); every leaf of the state is bitwise equal both ways.

This file is also the worker:
`python tests/test_multihost.py WORKDIR STREAM_URL CKPT_DIR PORT ID`.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
BUCKET = "rljax-multihost"
VERSIONS = 3  # v0 (init) + 2 GRPO updates
SMALL_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, moe_intermediate_size=16, intermediate_size=32)
TIMEOUT = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _flat(tree) -> dict:
  import jax
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _wait_for(path: pathlib.Path, procs, timeout=TIMEOUT):
  deadline = time.monotonic() + timeout
  while not path.exists():
    for p in procs:
      if p.poll() is not None and p.returncode != 0:
        raise AssertionError(f"worker exited {p.returncode}:\n{p.stderr.read()[-4000:]}")
    if time.monotonic() > deadline:
      raise TimeoutError(f"no {path}")
    time.sleep(0.05)


@pytest.mark.multidevice
def test_two_process_trainer_streams_and_checkpoints(tmp_path, monkeypatch):
  import rljax  # noqa: F401
  import jax
  import numpy as np
  from rljax.sync import Subscriber
  from rljax.sync import manifest as fmt
  from tests.fake_gcs import fake_gcs

  with fake_gcs(BUCKET) as gcs_url:
    url = f"gs://{BUCKET}/runs/multihost/stream"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_url)  # gcsfs (orbax) -> fake server
    ckpt_dir = f"gs://{BUCKET}/runs/multihost/ckpt"
    port = _free_port()
    env = {**os.environ,
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=4"}
    procs = [subprocess.Popen([sys.executable, str(HERE), str(tmp_path), url, ckpt_dir,
                               str(port), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=str(REPO), env=env) for i in range(2)]
    try:
      sub = Subscriber(url)
      for v in range(VERSIONS):
        _wait_for(tmp_path / f"params_v{v}.npz", procs)
        assert sub.poll() == v
        want = np.load(tmp_path / f"params_v{v}.npz")
        got = {p: np.asarray(x).view(np.uint16) for p, x in fmt.flatten(sub.params).items()}
        assert sorted(got) == sorted(want.files)
        for p in want.files:
          assert np.array_equal(got[p], want[p]), (v, p)
        (tmp_path / f"ack_v{v}").touch()  # the workers publish v+1 only after this
      assert sub.stats.versions_applied == VERSIONS - 1 and not sub.stats.errors
      results = []
      for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.communicate()
    _check(results, tmp_path, ckpt_dir)  # the checkpoint is on the fake server


def _check(results, tmp_path, ckpt_dir):
  import jax
  import numpy as np
  for r in results:
    assert r["process_count"] == 2 and r["device_count"] == 8 and r["local_devices"] == 4
    assert r["foreign_keys"] == [] and r["written"] > 0
    assert r["steps"] == VERSIONS - 1 and not any(r["skipped"])
    assert r["restored_other_layout"] == "bitwise"
  assert results[0]["losses"] == results[1]["losses"]
  assert not set(results[0]["keys"]) & set(results[1]["keys"])  # each its own shards
  assert results[0]["nonlocal_leaves"] > 0  # the mesh really spans both processes

  # The checkpoint both processes wrote, restored onto one device of this process.
  from rljax.checkpoint import Checkpointer
  from etils import epath
  state_dir = epath.Path(ckpt_dir) / str(VERSIONS - 1) / "state"
  assert (state_dir / "ocdbt.process_0").exists() and (state_dir / "ocdbt.process_1").exists()
  want = np.load(tmp_path / "state.npz")
  template = _template(want)
  with Checkpointer(ckpt_dir, async_save=False) as ckpt:
    assert ckpt.steps() == [VERSIONS - 1]
    restored = ckpt.restore(template)
  assert restored.stream_version == VERSIONS - 1 and restored.step == VERSIONS - 1
  flat = _flat(restored.state)
  assert sorted(flat) == sorted(want.files)
  for k in want.files:
    assert flat[k].sharding.device_set == {jax.devices()[0]}
    got = np.asarray(flat[k])
    assert got.dtype == want[k].dtype and got.shape == want[k].shape, k
    assert got.tobytes() == want[k].tobytes(), k  # bitwise


# ---------------------------------------------------------------- the async trainer

PIPELINE = REPO / "experiments" / "pipeline.py"
E2E_STEPS = 3
E2E_FLAGS = [f"--config.model.{k}={v}" for k, v in SMALL_MODEL.items()] + [
    "--config.mesh.fsdp=4", "--config.mesh.expert=2", "--config.sft.steps=0",
    f"--config.rl.steps={E2E_STEPS}", "--config.rl.prompts_per_step=4",
    "--config.rl.group_size=4", "--config.eval.num_tasks=4", "--config.eval.n=2",
    "--config.eval.k=2", "--config.eval.every=0", "--config.engine.num_slots=16",
    "--config.async_rl.host_groups=4", f"--config.async_rl.checkpoint_every={E2E_STEPS}",
    "--config.log.tensorboard=False"]


@pytest.mark.multidevice
def test_two_process_async_trainer_with_a_rollout_host_on_gcs(tmp_path, monkeypatch):
  """experiments/pipeline.py as 2 trainer processes x 4 CPU devices (one 8-device mesh,
  fsdp 4 x expert 2) on a gs:// root (fake-gcs-server); process 0 owns the queue, lineage
  and metrics and starts one rollout host; every update it broadcasts the batch and both
  run the sharded GRPO step, publish their own shards and write their part of the orbax
  checkpoint. Checked here: the run's outputs, each version's shards written once, by one
  process, a subscriber's bits, and the checkpoint restored onto one device."""
  import jax
  import numpy as np
  from rljax.pipeline.metrics import read_jsonl
  from rljax.sync import Store, Subscriber
  from rljax.sync import manifest as fmt
  from tests.fake_gcs import fake_gcs

  with fake_gcs(BUCKET) as gcs_url:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_url)
    root = f"gs://{BUCKET}/runs/async"
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=4"}
    procs = []
    for i in range(2):  # the same command on each trainer host, but for --process_id
      err = open(tmp_path / f"trainer{i}.err", "w", encoding="utf-8")
      procs.append(subprocess.Popen(
          [sys.executable, str(PIPELINE), f"--workdir={tmp_path / f'trainer{i}'}",
           f"--root={root}", "--hosts=1", "--progress=false",
           f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
           f"--process_id={i}", *E2E_FLAGS],
          cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=err, text=True))
    try:
      outs = []
      for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 0, (tmp_path / f"trainer{i}.err").read_text()[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.communicate()
    summary, other = outs

    # the run: process 0's summary, its host, its lineage and queue
    assert summary["processes"] == 2 and summary["devices"] == 8
    assert summary["updates"] == E2E_STEPS and summary["steps"] == E2E_STEPS
    assert summary["host_exit_codes"] == [0]
    q = summary["queue"]
    assert q["trained"] == 4 * E2E_STEPS
    assert q["submitted"] == (q["trained"] + q["dropped"] + q["pending"] + q["leased"]
                              + q["ready"]), q
    assert other == {"process_index": 1, "processes": 2, "updates": E2E_STEPS,
                     "steps": E2E_STEPS, "workdir": str(tmp_path / "trainer1")}
    lineage = read_jsonl(tmp_path / "trainer0" / "trained_groups.jsonl")
    assert [l["update"] for l in lineage] == list(range(1, E2E_STEPS + 1))
    assert [l["version"] for l in lineage] == list(range(1, E2E_STEPS + 1))
    groups = [g for l in lineage for g in l["groups"]]
    assert len(groups) == len(set(groups)) == 4 * E2E_STEPS
    assert {h for l in lineage for h in l["hosts"]} == {"host0"}
    records = read_jsonl(tmp_path / "trainer0" / "metrics.jsonl")
    assert sum(r["phase"] == "async" for r in records) == E2E_STEPS
    assert not (tmp_path / "trainer1" / "metrics.jsonl").exists()  # process 0 owns them

    # the stream: every version's shards written once, by one process, all of them covered
    store = Store.open(f"{root}/stream/")
    for v in range(E2E_STEPS + 1):
      manifest = fmt.Manifest.from_bytes(store.read(fmt.manifest_key(v)))
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
    assert sub.poll() == E2E_STEPS and not sub.stats.errors  # checksums of every delta

    # the checkpoint: both processes' parts, restored onto one device of this process;
    # its serving bits are the stream's newest version
    ckpt_dir = f"{root}/trainer/checkpoints"
    from etils import epath
    state_dir = epath.Path(ckpt_dir) / str(E2E_STEPS) / "state"
    assert (state_dir / "ocdbt.process_0").exists() and (state_dir / "ocdbt.process_1").exists()
    restored = _restore_e2e_on_one_device(ckpt_dir)
    assert restored.step == E2E_STEPS and restored.stream_version == E2E_STEPS
    state = restored.state["state"]
    assert int(state.step) == E2E_STEPS
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(state))
    got = {p: np.asarray(x) for p, x in fmt.flatten(sub.params).items()}
    served = {p: np.asarray(x.astype(got[p].dtype)) for p, x in fmt.flatten(state.params).items()}
    assert sorted(got) == sorted(served)
    for p in got:
      assert got[p].tobytes() == served[p].tobytes(), p


def _restore_e2e_on_one_device(ckpt_dir):
  import jax
  import jax.numpy as jnp
  import optax
  from rljax.checkpoint import Checkpointer
  from rljax.model import ModelConfig, abstract_params
  from rljax.rl import learner
  config = _config()
  c = config.rl
  cfg = ModelConfig.from_dict(config.model.to_dict())
  opt = learner.make_optimizer(optax.constant_schedule(c.learning_rate),
                               weight_decay=c.weight_decay, clip_norm=c.clip_norm, b2=c.adam_b2)
  abstract = jax.eval_shape(lambda p: learner.init_state(p, opt),
                            abstract_params(cfg, jnp.float32))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
  with Checkpointer(ckpt_dir, async_save=False) as ckpt:
    return ckpt.restore({"state": target})


def test_single_process_is_a_noop():
  from rljax import distributed
  assert not distributed.initialize()
  assert not distributed.initialize("127.0.0.1:1", num_processes=1, process_id=0)


def _template(want):
  """The train-state tree of the worker's config as ShapeDtypeStructs on one device."""
  import jax
  import jax.numpy as jnp
  from rljax.model import ModelConfig, abstract_params
  from rljax.rl import learner
  cfg = ModelConfig.from_dict(_config().model.to_dict())
  opt = learner.make_optimizer(1e-3)
  abstract = jax.eval_shape(lambda p: learner.init_state(p, opt),
                            abstract_params(cfg, jnp.float32))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
  assert set(_flat(tree)) == set(want.files)
  return tree


def _config():
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.model.update(SMALL_MODEL)
  return config


# ---------------------------------------------------------------- worker


def _trajectories(cfg, n: int, seed: int = 0):
  import numpy as np
  from rljax.rl.trajectory import FinishReason, Trajectory
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    p, c = int(rng.integers(3, 8)), int(rng.integers(4, 12))
    out.append(Trajectory(
        prompt_ids=rng.integers(1, cfg.vocab_size, p).astype(np.int32),
        completion_ids=rng.integers(1, cfg.vocab_size, c).astype(np.int32),
        loss_mask=np.ones(c, bool),
        behaviour_logprobs=-rng.uniform(0.5, 5.0, c).astype(np.float32),
        versions=np.zeros(c, np.int32), expert_ids=None, finish_reason=FinishReason.STOP))
  return out


def worker(workdir: pathlib.Path, url: str, ckpt_dir: str, port: int, process_id: int):
  sys.path.insert(0, str(REPO))
  import rljax  # noqa: F401
  from rljax import distributed
  assert distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from rljax import sharding as sharding_lib
  from rljax.checkpoint import Checkpointer
  from rljax.model import ModelConfig, init_sharded
  from rljax.numerics import Numerics
  from rljax.rl import learner
  from rljax.rl.batch import build_batch, split_microbatches
  from rljax.rl.losses import LossConfig
  from rljax.sync import Publisher, Store
  from rljax.sync import manifest as fmt

  config = _config()
  cfg = ModelConfig.from_dict(config.model.to_dict())
  sharding = sharding_lib.Sharding(sharding_lib.make_mesh({"fsdp": 4, "expert": 2}))
  opt = learner.make_optimizer(1e-3)
  state_sh = learner.state_shardings(cfg, opt, sharding)
  state = jax.device_put(learner.init_state(init_sharded(cfg, 0, sharding, jnp.float32), opt),
                         state_sh)
  step = learner.make_grpo_step(cfg, opt, numerics=Numerics("deterministic"),
                                loss_cfg=LossConfig(), replay=False, sharding=sharding,
                                state_sharding=state_sh)
  trajs = _trajectories(cfg, 16)  # the same batch on every process (same seed)
  adv = np.random.default_rng(1).standard_normal(16).astype(np.float32)
  batch = split_microbatches(build_batch(trajs, adv, np.ones(16, bool), row_len=64,
                                         num_rows=8, num_seqs=16,
                                         page_size=cfg.page_size), 1)

  class Recording(Store):
    keys: list = []

    def write_many(self, items):
      Recording.keys.extend(items)
      super().write_many(items)

  inner = Store.open(url)
  pub = Publisher(Recording(inner.kvstore, driver=inner.driver), keyframe_every=10)
  mine, losses, skipped = set(), [], []
  for v in range(VERSIONS):
    if v:
      state, metrics = step(state, batch, v - 1)
      losses.append(float(metrics["loss"]))
      skipped.append(bool(metrics["skipped"]))
    pub.publish(state.params, v)
    for path, x in fmt.flatten(state.params).items():
      for s in x.addressable_shards:
        if s.replica_id == 0:
          mine.add(fmt.object_key(v, path, fmt.region_of(s.index, x.shape)))
    full = {p: np.asarray(multihost_utils.process_allgather(
        x.astype(jnp.bfloat16), tiled=True)).view(np.uint16)
            for p, x in fmt.flatten(state.params).items()}
    if process_id == 0:
      np.savez(workdir / "tmp_params.npz", **full)
      os.replace(workdir / "tmp_params.npz", workdir / f"params_v{v}.npz")
    deadline = time.monotonic() + TIMEOUT
    while not (workdir / f"ack_v{v}").exists():  # the subscriber has checked version v
      if time.monotonic() > deadline:
        raise TimeoutError(f"no ack for version {v}")
      time.sleep(0.05)

  ckpt = Checkpointer(ckpt_dir, async_save=False)
  ckpt.save(VERSIONS - 1, state, stream_version=VERSIONS - 1)
  ckpt.close()
  gathered = {k: np.asarray(multihost_utils.process_allgather(x, tiled=True))
              for k, x in _flat(state).items()}
  if process_id == 0:
    np.savez(workdir / "state.npz", **gathered)
  restored_other_layout = _restore_other_layout(ckpt_dir, state, gathered, cfg, opt)
  objects = [k for k in Recording.keys if "/_index/" not in k and k.startswith(fmt.OBJECTS)]
  print(json.dumps({
      "process_count": jax.process_count(), "device_count": jax.device_count(),
      "local_devices": jax.local_device_count(), "steps": int(state.step),
      "losses": losses, "skipped": skipped, "written": len(objects), "keys": objects,
      "foreign_keys": sorted(set(objects) - mine),
      "nonlocal_leaves": sum(not x.is_fully_addressable for x in jax.tree.leaves(state)),
      "restored_other_layout": restored_other_layout}))
  jax.distributed.shutdown()


def _restore_other_layout(ckpt_dir, state, gathered, cfg, opt) -> str:
  """Restores the checkpoint onto fsdp 2 x expert 4 over the devices in reverse order
  (every leaf sharded differently, shards crossing processes the other way) and compares
  each leaf, gathered, with the saved state's bits."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from rljax import sharding as sharding_lib
  from rljax.checkpoint import Checkpointer, abstract_like
  from rljax.rl import learner
  other = sharding_lib.Sharding(sharding_lib.make_mesh({"fsdp": 2, "expert": 4},
                                                       jax.devices()[::-1]))
  target = abstract_like(state, learner.state_shardings(cfg, opt, other))
  with Checkpointer(ckpt_dir, async_save=False) as ckpt:
    restored = ckpt.restore(target)
  moved = 0
  for (k, x), (_, y) in zip(_flat(restored.state).items(), _flat(state).items()):
    if x.sharding != y.sharding:
      moved += 1
    got = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if got.dtype != gathered[k].dtype or got.tobytes() != gathered[k].tobytes():
      return f"differs at {k}"
  return "bitwise" if moved and restored.stream_version == VERSIONS - 1 else "not moved"


if __name__ == "__main__":
  worker(pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
