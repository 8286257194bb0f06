"""config.lora in the async pipeline (rljax.pipeline.adapter_stream): the frozen base goes
to the hosts once, each version of the weight stream is the adapters' f32 masters, hosts
merge with the trainer's jitted merge. A host's weights are the trainer's serving params
bit for bit; an async LoRA run in deterministic numerics has every trained token's
behaviour log-prob equal the trainer's (own-version mismatch 0.0) while its stream
carries a fraction of the model's bytes per version; the checkpoints export the merged
policy; a trainer killed mid-run resumes on the base it saved, checked against the
hosts'."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rljax.model.lora import LoraConfig, init_adapters
from rljax.pipeline import adapter_stream
from rljax.pipeline.host import RolloutHost
from rljax.pipeline.layout import base_url, publish_fingerprint, stream_url
from rljax.pipeline.metrics import read_jsonl
from rljax.pipeline.run import ASYNC_TRAINER, MODEL_ONLY, build
from rljax.rl import learner
from rljax.sync import Manifest, Publisher, Store, Subscriber, StreamError, codecs
from rljax.sync import manifest as fmt
from tests.test_async_pipeline import SMALL, _finish, _stderr
from tests.test_rollout_host import params_of, small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
LORA_CONFIG = "configs/arith_tiny_lora.py"
# rank 2 on SMALL's hidden 64 (as rank 64 would be on a hidden size of 2048): the
# adapters' f32 masters weigh 12% of the model in bf16. Rewards by the answer's length
# parity: groups differ in reward whatever the policy, so every update moves the adapters
RUN = [f"--config={LORA_CONFIG}", *SMALL, "--config.lora.rank=2", "--config.lora.alpha=4.0",
       "--config.env.name=tests.test_lora:parity_arithmetic",
       "--config.numerics=deterministic", "--config.async_rl.weight_update=recompute",
       "--config.async_rl.check_versions_groups=1000", "--config.async_rl.keyframe_every=3",
       "--config.rl.learning_rate=1e-2", "--config.rl.warmup_steps=1"]


# the bitwise run: from the random init (SMALL: no warm start), 3 updates
E2E = ["--config.rl.steps=3"]


def _manifests(stream_dir: pathlib.Path) -> list[Manifest]:
  return [Manifest.from_bytes(p.read_bytes())
          for p in sorted((stream_dir / "manifests").glob("*.json"))]


def _trainer(workdir, root, *overrides, hosts):
  os.makedirs(workdir, exist_ok=True)
  err = open(os.path.join(workdir, "trainer.err"), "a", encoding="utf-8")  # never blocks
  proc = subprocess.Popen(
      [sys.executable, str(ROOT / "experiments" / "pipeline.py"), f"--workdir={workdir}",
       f"--root={root}", f"--hosts={hosts}", "--progress=false", *RUN, *overrides],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
  proc.err_path = err.name
  return proc


def _config(overrides=()):
  """The config the run's processes build from RUN (and `overrides`), in this process."""
  from configs import arith_tiny_lora  # pylint: disable=import-outside-toplevel
  config = arith_tiny_lora.get_config()
  for flag in [*RUN[1:], *overrides]:
    key, value = flag[len("--config."):].split("=", 1)
    *path, leaf = key.split(".")
    node = config
    for part in path:
      node = node[part]
    old = node[leaf]
    node[leaf] = (value == "True" if isinstance(old, bool) else type(old)(value)
                  if old is not None else value)
  return config


@pytest.mark.parametrize("codec", [n for n in codecs.names() if not codecs.get(n).keyframe])
def test_f32_adapters_follow_bit_for_bit_under_every_delta_codec(tiny_cfg, codec):
  # The adapter stream is f32: 4-byte bits, steps of thousands of ulps (Rice escapes,
  # "add" patches whose sign bit is 2**31 on device), sign changes through zero
  lora = LoraConfig(rank=2)
  fresh = init_adapters(tiny_cfg, lora, jax.random.key(0))
  leaves, tree = jax.tree.flatten(fresh)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  moved = jax.tree.unflatten(tree, [x + 1e-3 * jax.random.normal(k, x.shape)
                                    for k, x in zip(keys, leaves)])
  versions = [fresh, moved, jax.tree.map(lambda x: -x * (1 + 1e-5), moved)]
  store = Store.open("memory://")
  pub = Publisher(store, keyframe_every=10, dtype=adapter_stream.ADAPTER_DTYPE,
                  delta_codec=codec)
  sub = Subscriber(store)
  for version, adapters in enumerate(versions):
    pub.publish(adapters, version)
    assert sub.poll() == version, sub.stats.errors
    chex.assert_trees_all_equal(sub.params, adapters)
  assert sub.stats.versions_applied == 2 and sub.stats.keyframes_loaded == 1


def test_a_host_serves_the_trainers_merged_weights_bit_for_bit(tmp_path):
  # The trainer's side by hand: a base saved and published once (adapter_stream), then
  # three versions of adapters on the f32 stream (a fresh B = 0, then moved ones, the
  # third a dense small step as Adam makes). After each, the host's engine weights are
  # `learner.serving_params` of those adapters, which is what the trainer's run.serve
  # computes, bit for bit; the base was read once.
  config = small_config()
  config.lora = ml_collections.ConfigDict(dict(rank=4, alpha=8.0,
                                               targets=LoraConfig().targets))
  lora = build(config, MODEL_ONLY, devices=False).lora
  cfg, base_np = params_of(config, 0)
  base = jax.tree.map(jnp.asarray, base_np)
  fresh = init_adapters(cfg, lora, jax.random.key(1))
  leaves, tree = jax.tree.flatten(fresh)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  moved = jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                    for k, x in zip(keys, leaves)])
  stepped = jax.tree.map(lambda x: x * (1 + 1e-4) + 1e-5, moved)
  versions = [fresh, moved, stepped]

  root = f"file://{tmp_path}/root"
  publish_fingerprint(Store.open(root), config)
  adapter_stream.start_base(root, str(tmp_path), base)  # its checkpoint: tmp_path/lora_base
  with pytest.raises(FileExistsError, match="holds an earlier LoRA run's frozen base"):
    adapter_stream.start_base(root, str(tmp_path), base)
  pub = Publisher(stream_url(root), keyframe_every=10, dtype=adapter_stream.ADAPTER_DTYPE)
  pub.publish(versions[0], 0)
  host = RolloutHost(root, config, "h0")
  for version, adapters in enumerate(versions):
    if version:
      pub.publish(adapters, version)
      assert host.run_once()
    trainer_serves = learner.serving_params(learner.TrainState(adapters, (), None), cfg,
                                            base=base, lora=lora)
    assert host.engine.version == version
    chex.assert_trees_all_equal(host.engine.params, trainer_serves)
    gate = np.asarray(host.engine.params["layers"]["moe"]["moe"]["gate"])
    assert np.any(gate != base_np["layers"]["moe"]["moe"]["gate"]) == (version > 0)
  chex.assert_trees_all_equal(host.engine.params, learner.merged_params(base, stepped, lora))
  # a fresh adapter serves the base itself; the host's base came from base/ once
  assert host.base_sub.stats.keyframes_loaded == 1 and host.base_sub.version == 0
  chex.assert_trees_all_equal(host.base, base_np)
  assert host.sub.stats.versions_applied == 2 and not host.sub.stats.errors
  # the restored checkpoint copy of the base is the published one (what a resume checks)
  restored = adapter_stream.restore_base(str(tmp_path), cfg, None)
  chex.assert_trees_all_equal(restored, base_np)
  adapter_stream.verify_base(root, restored, str(tmp_path))
  other = fmt.flatten(restored)
  other["final_norm/scale" if "final_norm/scale" in other else min(other)] += 1
  with pytest.raises(StreamError, match="is not the one the hosts read from"):
    adapter_stream.verify_base(root, fmt.unflatten(other), str(tmp_path))
  host.close()


def test_an_async_lora_run_is_bitwise_on_policy_and_streams_a_fraction_of_the_model(tmp_path):
  # Trainer + 1 host process on a file:// root, deterministic numerics, KV recomputed on
  # weight updates: every trained token's behaviour log-prob (the host's engine on the
  # merged weights) equals the trainer's log-prob under its own version's weights.
  workdir, root_dir = tmp_path / "run", tmp_path / "root"
  summary = _finish(_trainer(workdir, f"file://{root_dir}/", *E2E, hosts=1))
  assert summary["updates"] == 3 and summary["host_exit_codes"] == [0]
  assert summary["own_version_mismatch_max_abs"] == 0.0
  assert summary["own_version_tokens"]["checked"] > 0
  assert summary["lora_base"] == str(workdir / "lora_base")
  base_manifests = _manifests(root_dir / "base")
  assert [m.version for m in base_manifests] == [0] and base_manifests[0].keyframe
  base_bytes = base_manifests[0].full_bytes  # the model in bf16: what a version would weigh
  stream = _manifests(root_dir / "stream")
  assert [m.version for m in stream] == [0, 1, 2, 3]
  assert [m.keyframe for m in stream] == [True, False, False, True]  # keyframe_every=3
  assert all(t.dtype == "float32" and path.endswith(("/a", "/b"))
             for m in stream for path, t in m.tensors.items())
  # each version's download for a host that follows: its delta against the parent, at
  # most the adapters' own f32 bytes (measured: 476, 14705 and 28501 of 36352, the model
  # 313088): under 13% of the model in bf16, every version
  adapter_bytes = stream[0].full_bytes
  per_version = [m.delta_bytes for m in stream[1:]]
  print("adapter stream bytes per version", per_version, "adapters f32", adapter_bytes,
        "model bf16", base_bytes)
  assert adapter_bytes < 0.125 * base_bytes
  assert max(per_version) < 1.05 * adapter_bytes
  # the last checkpoint's adapters (experiments/export_hf.py --checkpoint) are the last
  # version's: merged into the saved base they are what the hosts served
  config = _config(E2E)
  built = build(config, ASYNC_TRAINER, devices=False)
  merged = adapter_stream.merged_from_checkpoint(built, summary["checkpoints"])
  base_sub, sub = Subscriber(Store.open(base_url(f"file://{root_dir}/"))), Subscriber(
      Store.open(stream_url(f"file://{root_dir}/")))
  assert base_sub.poll() == 0 and sub.poll() == 3
  served = learner.merged_params(base_sub.params, sub.params, built.lora)
  chex.assert_trees_all_equal(merged, jax.tree.map(lambda x: x.astype(jnp.float32), served))
  moe_gate = np.asarray(served["layers"]["moe"]["moe"]["gate"])
  assert np.any(moe_gate != np.asarray(base_sub.params["layers"]["moe"]["moe"]["gate"]))


def test_a_killed_lora_trainer_resumes_on_the_base_it_saved(tmp_path):
  # kill -9 the trainer once its checkpoint at update 2 is on disk; the restart restores
  # the adapters' state and the frozen base saved beside it, checks the base against the
  # hosts' (base/) and its adapters against the stream version its checkpoint recorded,
  # and publishes on; the host keeps its base and follows, and every trained token still
  # matches its own version's weights bit for bit.
  workdir, root = tmp_path / "run", f"file://{tmp_path / 'root'}/"
  # an SFT warm start of the base (SMALL has none): 3 steps, the second and third at the
  # full rate (step 1's lr is 0 with any warmup)
  overrides = ["--config.rl.steps=5", "--config.async_rl.lease_ttl_s=4",
               "--config.sft.steps=3", "--config.sft.warmup_steps=1"]
  log = open(tmp_path / "host.log", "a", encoding="utf-8")  # pylint: disable=consider-using-with
  trainer = _trainer(workdir, root, *overrides, hosts=0)
  host = subprocess.Popen(
      [sys.executable, str(ROOT / "experiments" / "rollout_host.py"), f"--root={root}",
       "--host_id=host0", *RUN, *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  try:
    first = workdir / "checkpoints" / "2" / "commit_success.txt"
    deadline = time.monotonic() + 300
    while not first.exists():  # polled often: with groups ready, updates take ~0.1 s
      assert trainer.poll() is None and time.monotonic() < deadline, _stderr(trainer)
      time.sleep(0.01)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    trainer = _trainer(workdir, root, *overrides, "--resume", hosts=0)
    summary = _finish(trainer)
    code = host.wait(timeout=120)
  finally:
    for p in (trainer, host):
      if p.poll() is None:
        p.kill()
    log.close()
  assert code == 0, (tmp_path / "host.log").read_text()[-3000:]
  # resumed from update 2, or from 4 where two more updates were quicker than the kill
  # (the host had their groups ready)
  assert summary["updates"] == 5 and summary["resumed_from_update"] in (2, 4), summary
  assert summary["own_version_mismatch_max_abs"] == 0.0
  assert summary["own_version_tokens"]["checked"] > 0
  status = json.loads((tmp_path / "root" / "run" / "hosts" / "host0.json").read_text())
  assert status["stream_errors"] == 0, status
  # the base was SFT'd (not the init): a resume that rebuilt it would not have verified
  records = read_jsonl(str(workdir / "metrics.jsonl"))
  assert any(r["phase"] == "sft" for r in records)
  # a resume whose saved base is gone is refused, naming it
  os.rename(workdir / "lora_base", workdir / "lora_base.moved")
  again = _trainer(workdir, root, *overrides, "--resume", hosts=0)
  assert again.wait(timeout=300) != 0
  assert f"{workdir / 'lora_base'} is missing" in _stderr(again)
