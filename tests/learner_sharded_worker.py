"""GRPO step on an 8-device CPU mesh vs one device (run by test_learner.py in its own
process). Prints one JSON object."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import rljax  # noqa: E402,F401

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import tiny_moe  # noqa: E402
from rljax import sharding as sharding_lib  # noqa: E402
from rljax.model import ModelConfig, forward, init_params  # noqa: E402
from rljax.model.params import scale_matrices  # noqa: E402
from rljax.model.packing import pack  # noqa: E402
from rljax.numerics import Numerics  # noqa: E402
from rljax.rl import learner  # noqa: E402
from rljax.rl.batch import TrainBatch, split_microbatches  # noqa: E402
from rljax.rl.losses import LossConfig  # noqa: E402

DET = Numerics("deterministic")


def main():
  cfg = ModelConfig.from_dict(tiny_moe.get_config().model.to_dict()).resolved("cpu", "deterministic")
  params = init_params(cfg, jax.random.key(0), "float32")
  params = scale_matrices(params, 10.0)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(1, cfg.vocab_size, size=int(n)) for n in rng.integers(10, 30, size=16)]
  p = pack(seqs, 64, cfg.page_size, num_rows=8)
  targets = np.concatenate([p.tokens[:, 1:], np.zeros_like(p.tokens[:, :1])], axis=1)
  seq_ids = np.full(p.tokens.shape, -1, np.int32)
  for j, (row, start, n) in enumerate(p.placements):
    seq_ids[row, start:start + n] = j
  mask = seq_ids >= 0
  serving = jax.tree.map(lambda x: x.astype(cfg.param_dtype), params)
  behaviour = np.asarray(forward(serving, p.tokens, p.positions, cfg=cfg, numerics=DET,
                                 segment_ids=p.segment_ids, targets=targets).logprobs)
  batch = TrainBatch(p.tokens, p.positions, p.segment_ids, targets, mask,
                     np.where(mask, behaviour, 0).astype(np.float32),
                     np.zeros_like(seq_ids), seq_ids,
                     rng.standard_normal(16).astype(np.float32), np.ones(16, bool), None)
  micro = split_microbatches(batch, 2)
  opt = optax.sgd(0.1)

  def run(sharding):
    state_sh = None if sharding is None else learner.state_shardings(cfg, opt, sharding)
    state = learner.init_state(params, opt)
    if state_sh is not None:
      state = jax.device_put(state, state_sh)
    step = learner.make_grpo_step(cfg, opt, numerics=DET, loss_cfg=LossConfig(), replay=False,
                                  sharding=sharding, state_sharding=state_sh)
    new, metrics = step(state, micro)
    spec = None if sharding is None else str(new.params["layers"]["moe"]["moe"]["gate"]
                                             .sharding.spec)
    return jax.tree.map(np.asarray, new.params), jax.tree.map(float, metrics), spec

  ref_params, ref_metrics, _ = run(None)
  out = {"single_mismatch_max_abs": ref_metrics["mismatch_max_abs"]}
  for name, shape in {"fsdp8": {"fsdp": 8}, "data2_fsdp2_expert2": {"data": 2, "fsdp": 2,
                                                                      "expert": 2}}.items():
    new, metrics, spec = run(sharding_lib.Sharding(sharding_lib.make_mesh(shape)))
    scale = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree.leaves(ref_params), jax.tree.leaves(jax.tree.map(np.asarray, params))))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(new),
                                                            jax.tree.leaves(ref_params)))
    upd = np.concatenate([(a - b).ravel() for a, b in zip(
        jax.tree.leaves(new), jax.tree.leaves(jax.tree.map(np.asarray, params)))])
    ref_upd = np.concatenate([(a - b).ravel() for a, b in zip(
        jax.tree.leaves(ref_params), jax.tree.leaves(jax.tree.map(np.asarray, params)))])
    cos = float(upd @ ref_upd / (np.linalg.norm(upd) * np.linalg.norm(ref_upd)))
    out[name] = {"update_max_abs_diff_rel": diff / scale, "update_cosine": cos,
                 "gate_spec": spec,
                 "loss_diff": abs(metrics["loss"] - ref_metrics["loss"]),
                 "mismatch_max_abs": metrics["mismatch_max_abs"]}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
