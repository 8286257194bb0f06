"""GRPO step on an 8-device CPU mesh vs one device (run by test_learner.py in its own
process): the gradient each layout computed (recorded in the optimizer state), whether the
update applied is exactly SGD of it, and the same error measure on deliberately broken
gradients. Prints one JSON object."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rljax.numerics import install_deterministic_xla_flags  # noqa: E402

install_deterministic_xla_flags()  # both modes run here

import json  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from tests.shapes import TINY  # noqa: E402
from rljax import sharding as sharding_lib  # noqa: E402
from rljax.model import ModelConfig, forward, init_params, scoring  # noqa: E402
from rljax.model.params import scale_matrices  # noqa: E402
from rljax.model.packing import pack  # noqa: E402
from rljax.numerics import Numerics  # noqa: E402
from rljax.rl import learner  # noqa: E402
from rljax.rl.batch import TrainBatch, split_microbatches  # noqa: E402
from rljax.rl.losses import LossConfig  # noqa: E402

DET = Numerics("deterministic")
LR = 0.1


class _Recorded(NamedTuple):
  grads: Any


def record_gradients() -> optax.GradientTransformation:
  """Passes the step's (accumulated, f32) gradient on unchanged and keeps it in its state,
  sharded like the params: what the mesh computed, before any optimizer rescales it."""
  return optax.GradientTransformation(
      lambda params: _Recorded(jax.tree.map(jnp.zeros_like, params)),
      lambda grads, state, params=None: (grads, _Recorded(grads)))


def flat(tree) -> list[np.ndarray]:
  return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def grad_rel_err(leaves, ref_leaves) -> float:
  """max over leaves of ||g - g_ref|| / ||g_ref|| (NaN anywhere -> NaN; a leaf whose
  reference is exactly zero must be exactly zero: inf otherwise)."""
  errs = []
  for g, r in zip(leaves, ref_leaves):
    d, n = float(np.linalg.norm(g - r)), float(np.linalg.norm(r))
    errs.append(d / n if n > 0 else (0.0 if d == 0 else np.inf))
  return scoring.nan_max(errs)


def cosine(leaves, ref_leaves) -> float:
  a, b = np.concatenate([x.ravel() for x in leaves]), np.concatenate(
      [x.ravel() for x in ref_leaves])
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main():
  cfg = ModelConfig(**TINY).resolved("cpu", DET)
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
  opt = optax.chain(record_gradients(), optax.sgd(LR))

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
    grads = jax.tree.map(np.asarray, new.opt_state[0].grads)
    return jax.tree.map(np.asarray, new.params), grads, jax.tree.map(float, metrics), spec

  masters = jax.tree.map(np.asarray, learner.init_state(params, opt).params)
  _, ref_grads, ref_metrics, _ = run(None)
  out = {"single_mismatch_max_abs": ref_metrics["mismatch_max_abs"]}
  for name, shape in {"fsdp8": {"fsdp": 8}, "data2_fsdp2_expert2": {"data": 2, "fsdp": 2,
                                                                      "expert": 2}}.items():
    new, grads, metrics, spec = run(sharding_lib.Sharding(sharding_lib.make_mesh(shape)))
    leaves, ref_leaves = flat(grads), flat(ref_grads)
    # the mesh's update is exactly sgd of the mesh's own gradient: p + (-lr * g) in f32
    applied = all(np.array_equal(n, m + np.float32(-LR) * g) for n, m, g in zip(
        flat(new), flat(masters), leaves))
    out[name] = {"grad_rel_err": grad_rel_err(leaves, ref_leaves),
                 "grad_cosine": cosine(leaves, ref_leaves), "update_is_sgd_of_grad": applied,
                 "gate_spec": spec,
                 "loss_diff": abs(metrics["loss"] - ref_metrics["loss"]),
                 "mismatch_max_abs": metrics["mismatch_max_abs"]}
    # what a sharding bug would look like, through the same measure, on the smallest
    # gradient (the hardest to see in a global norm): doubled (a reduction applied twice),
    # dropped, one of 8 shards lost
    i = min((j for j, r in enumerate(ref_leaves) if r.shape[0] >= 8 and np.any(r)),
            key=lambda j: np.linalg.norm(ref_leaves[j]))
    g, lost = leaves[i], len(leaves[i]) // 8
    bugs = {"doubled": 2 * g, "dropped": 0 * g,
            "one_shard_lost": np.concatenate([0 * g[:lost], g[lost:]])}
    out[name]["bug_grad_rel_err"] = {
        bug: grad_rel_err(leaves[:i] + [b] + leaves[i + 1:], ref_leaves)
        for bug, b in bugs.items()}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
