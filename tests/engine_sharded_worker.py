"""Runs in its own process with 8 simulated CPU devices (see test_engine_sharded.py).

Prints one JSON object:
* engine: per decode mesh layout (`DECODE_RULES`: weights replicated over fsdp, the KV
  page pool split like the slots), whether the deterministic engine's tokens and
  log-prob bits equal the 1-device engine's, the max |difference|, and how the page pool
  is placed; whether the 1-device trainer's log-probs equal the sharded engine's; the
  error for too few slots per device.
* kernels: the deterministic attention kernel (interpreted) under `shard_map` on a mesh:
  an engine on {data: 2, expert: 4} and the training forward on {data: 2, fsdp: 2,
  expert: 2}, against the 1-device jnp engine: tokens and log-prob bits. (The expert
  kernel is the TPU kernel, whose interpreter simulates the mesh's devices with one
  barrier shared by every kernel call: a program with several calls per device deadlocked
  here. Its sharded programs are compiled by Mosaic in test_tpu_compile.)
* host: a RolloutHost with `config.engine.mesh` = {data: 2, expert: 4} following a keyframe
  and a delta: its groups against a 1-device engine's, bitwise; the subscriber's arrays
  sharded by the decode rules, patched in place.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

from rljax.numerics import install_deterministic_xla_flags  # noqa: E402

install_deterministic_xla_flags()

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

from rljax import envs  # noqa: E402
from rljax import sharding as sharding_lib  # noqa: E402
from rljax.engine.engine import DecodeEngine, Request, SamplingParams  # noqa: E402
from rljax.model import ModelConfig, forward, init_params, param_shardings  # noqa: E402
from rljax.model.packing import pack, unpack  # noqa: E402
from rljax.model.params import cast, scale_matrices  # noqa: E402
from rljax.numerics import Numerics  # noqa: E402
from rljax.pipeline import wire  # noqa: E402
from rljax.sync import Publisher, Store  # noqa: E402

DET = Numerics("deterministic")
SLOTS = 64  # 8 per device on 8: the fewest deterministic numerics allows
# (model: 2 with data: 4 was bitwise too when measured, but tensor parallelism is not
# promised: more than 2 shards do not sum in a fixed order)
LAYOUTS = {"data8": {"data": 8}, "data2_expert4": {"data": 2, "expert": 4}}
MODEL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, intermediate_size=96, mlp_only_layers=(0,),
             max_position_embeddings=256, page_size=16)


def records(trajs):
  return {(t.request_id, t.sample_index): (np.asarray(t.completion_ids),
                                           np.asarray(t.behaviour_logprobs)) for t in trajs}


def trainer_logprobs(cfg, params, trajs, sharding=None):
  """The training forward's log-probs of each completion (packed rows; one device, or the
  rows split over `sharding`'s mesh)."""
  p = pack([t.tokens for t in trajs], 128, cfg.page_size, num_rows=8 if sharding else None)
  targets = np.concatenate([p.tokens[:, 1:], np.zeros_like(p.tokens[:, :1])], axis=1)
  batch = (p.tokens, p.positions, p.segment_ids, targets)
  if sharding is not None:
    params = jax.device_put(params, param_shardings(cfg, sharding))
    batch = jax.device_put(batch, sharding.named(("batch", None)))
  out = jax.jit(lambda prm, b: forward(prm, b[0], b[1], cfg=cfg, numerics=DET, segment_ids=b[2],
                                       targets=b[3], sharding=sharding))(params, batch)
  lps = unpack(np.asarray(out.logprobs), p)
  return {(t.request_id, t.sample_index): lp[len(t.prompt_ids) - 1:len(t.tokens) - 1]
          for t, lp in zip(trajs, lps)}


def _setup():
  cfg = ModelConfig(**MODEL).resolved("cpu", "deterministic")
  params = cast(scale_matrices(init_params(cfg, jax.random.key(0), "float32"), 10.0),
                "bfloat16")
  rng = np.random.default_rng(0)
  reqs = [Request(request_id=100 + i, prompt_ids=rng.integers(3, cfg.vocab_size,
                                                              size=int(rng.integers(3, 16))),
                  n=4, seed=11, sampling=SamplingParams(max_new_tokens=16)) for i in range(6)]
  return cfg, params, reqs


def _run(cfg, params, reqs, sharding, **engine_kw):
  t0 = time.perf_counter()
  eng = DecodeEngine(cfg, params, numerics=DET, num_slots=SLOTS, max_seq_len=64, eos_id=2,
                     sharding=sharding, **engine_kw)
  trajs = eng.generate(reqs)
  print(f"engine {sharding and dict(sharding.mesh.shape)}: {time.perf_counter() - t0:.1f} s "
        f"traces {dict(eng.trace_counts)}", file=sys.stderr)
  return eng, trajs


def _compare(got, ref):
  return {
      "same_keys": sorted(got) == sorted(ref),
      "tokens_equal": all(np.array_equal(got[k][0], ref[k][0]) for k in ref),
      "logprob_bits_equal": all(np.array_equal(got[k][1].view(np.uint32),
                                               ref[k][1].view(np.uint32)) for k in ref),
      "logprob_max_abs_diff": max(float(np.max(np.abs(got[k][1] - ref[k][1])))
                                  for k in ref if got[k][1].shape == ref[k][1].shape)}


def _decode_sharding(shape):
  return sharding_lib.Sharding(sharding_lib.make_mesh(shape), sharding_lib.DECODE_RULES)


def engine_results():
  cfg, params, reqs = _setup()
  _, ref_trajs = _run(cfg, params, reqs, None)
  ref = records(ref_trajs)
  out = {}
  for name, shape in LAYOUTS.items():
    eng, trajs = _run(cfg, params, reqs, _decode_sharding(shape))
    got = records(trajs)
    pool = eng.pools[0]
    out[name] = {
        **_compare(got, ref),
        "pool_spec": str(pool.sharding.spec),
        "pool_pages": pool.shape[1],
        "pool_pages_per_device": pool.addressable_shards[0].data.shape[1],
    }
    if name == "data8":
      train = trainer_logprobs(cfg, params, trajs)
      out[name]["trainer_bits_equal"] = all(
          np.array_equal(train[k].view(np.uint32), got[k][1].view(np.uint32)) for k in got)
  # the params in the decode loop's own layout on the mesh (what accelerators run)
  eng, trajs = _run(cfg, params, reqs, _decode_sharding(LAYOUTS["data2_expert4"]),
                    serving_layout=True)
  out["serving_layout"] = _compare(records(trajs), ref) | {
      "decode_compiled_ahead": isinstance(eng.programs.decode, jax.stages.Compiled)}
  try:
    DecodeEngine(cfg, params, numerics=DET, num_slots=16, max_seq_len=64,
                 sharding=sharding_lib.Sharding(sharding_lib.make_mesh({"data": 8}),
                                                sharding_lib.DECODE_RULES))
    out["too_few_slots_error"] = None
  except ValueError as e:
    out["too_few_slots_error"] = str(e)
  return out


def kernel_results():
  """The attention kernel (interpreted: the jnp path's bits) on meshes, against the jnp
  engine on one device: engine tokens and log-prob bits, and the sharded trainer's."""
  cfg, params, reqs = _setup()
  _, ref_trajs = _run(cfg, params, reqs, None)
  ref = records(ref_trajs)
  kernels = dataclasses.replace(cfg, det_attention="pallas_interpret")
  _, trajs = _run(kernels, params, reqs, _decode_sharding({"data": 2, "expert": 4}))
  out = _compare(records(trajs), ref)
  train = trainer_logprobs(kernels, params, trajs, sharding_lib.Sharding(
      sharding_lib.make_mesh({"data": 2, "fsdp": 2, "expert": 2})))
  out["trainer_bits_equal"] = all(
      np.array_equal(train[k].view(np.uint32), ref[k][1].view(np.uint32)) for k in ref)
  return out


def host_results():
  from test_rollout_host import (GROUP, assert_same_group, params_of, reference_groups,
                                 serve_until, small_config)
  from rljax.pipeline.host import RolloutHost
  from rljax.pipeline.layout import publish_fingerprint, stream_url
  from rljax.pipeline.queue_owner import QueueOwner
  from rljax.pipeline.work_queue import QueueConfig

  config = small_config()
  config.engine.num_slots = SLOTS
  config.engine.mesh = {"data": 2, "expert": 4}
  cfg, p0 = params_of(config, 0)
  p1 = jax.tree.map(lambda x: x.copy(), p0)  # version 1: a delta touching a MoE weight
  name = "gate"  # [L, embed, expert, mlp]: split over expert, a non-leading axis
  p1["layers"]["moe"]["moe"][name].reshape(-1)[::7] *= 1.5
  env = envs.make(config.env.name, **config.env.kwargs.to_dict())
  ctx, root = ts.Context(), "memory://"
  store = Store.open(root, ctx)
  publish_fingerprint(store, config)
  pub = Publisher(Store.open(stream_url(root), ctx), keyframe_every=10)
  pub.publish(p0, 0)
  owner = QueueOwner.open(store, QueueConfig(max_outstanding=8, lease_s=120.0,
                                             lease_ttl_s=15.0))
  tasks = env.prompts("train", 4, seed=3)
  host = RolloutHost(root, config, "h0", context=ctx)
  out = {"sharded": host.sharding is not None,
         "weights_spec": str(host.sub.params["layers"]["moe"]["moe"][name].sharding.spec)}

  def serve_and_compare(first_id, group_tasks, params, version):
    """Serves the groups and compares each with a 1-device engine's; True per group."""
    ids = [first_id + i for i in range(len(group_tasks))]
    owner.submit([(gid, wire.task_to_payload(t), GROUP) for gid, t in zip(ids, group_tasks)])
    ready = serve_until(host, owner, ids)
    want = reference_groups(config, cfg, params, env, group_tasks, first_id=first_id,
                            version=version)
    equal = []
    for gid, w in zip(ids, want):
      try:
        assert_same_group(wire.group_from_arrays(ready[gid].arrays, gid), w.trajectories)
        equal.append(True)
      except AssertionError:
        equal.append(False)
      owner.mark_trained(gid)
    return equal

  equal = serve_and_compare(10, tasks[:2], p0, 0)
  pub.publish(p1, 1)
  equal += serve_and_compare(20, tasks[2:], p1, 1)

  # a second delta lands in the same device buffers (the first may copy once: CPU
  # device_put buffers are not donatable)
  def pointers():
    return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(host.sub.params)
            for s in x.addressable_shards]

  before = pointers()
  p2 = jax.tree.map(lambda x: x.copy(), p1)
  p2["layers"]["moe"]["moe"][name].reshape(-1)[3::11] *= -1
  pub.publish(p2, 2)
  host.sync_weights()
  out |= {"groups_equal": equal, "version": host.engine.version,
          "applied": [a[0] for a in host.applied], "errors": host.sub.stats.errors,
          "in_place": before == pointers(),
          "engine_holds_subscriber_arrays": all(
              x is y for x, y in zip(jax.tree.leaves(host.engine.params),
                                     jax.tree.leaves(host.sub.params)))}
  host.close()
  return out


def main():
  assert jax.device_count() == 8, jax.devices()
  parts = sys.argv[1:] or ["engine", "kernels", "host"]
  print(json.dumps({part: {"engine": engine_results, "kernels": kernel_results,
                           "host": host_results}[part]() for part in parts}))


if __name__ == "__main__":
  main()
