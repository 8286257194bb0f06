"""Runs in its own process with 8 simulated CPU devices (see test_sharded.py).

  sharded_worker.py [DTYPE [MODE [LAYOUT,...]]]   bfloat16 | float32, deterministic | fast,
                                                names of LAYOUTS (default: all)

Prints one JSON object: per mesh layout, the max |difference| of det/fast log-probs from
the single-device run, and of gradients (f32) from the single-device gradients. The test
runs one (dtype, mode) per process, so no test waits for all four.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rljax.numerics import install_deterministic_xla_flags  # noqa: E402

install_deterministic_xla_flags()  # both modes run here

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tests.shapes import TINY  # noqa: E402
from rljax import sharding as sharding_lib  # noqa: E402
from rljax.model import ModelConfig, forward, init_params, param_shardings  # noqa: E402
from rljax.model.params import cast, scale_matrices  # noqa: E402
from rljax.model import scoring  # noqa: E402
from rljax.model.packing import pack  # noqa: E402
from rljax.numerics import Numerics  # noqa: E402

LAYOUTS = {
    "data8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "expert8": {"expert": 8},
    "data2_fsdp2_expert2": {"data": 2, "fsdp": 2, "expert": 2},
    "expert4_fsdp2": {"expert": 4, "fsdp": 2},
    # tensor parallel splits contractions over devices: 2 shards sum exactly (a+b == b+a),
    # more do not sum in a fixed order, so these are reported, not promised
    "model2_data4": {"model": 2, "data": 4},
    "model4_data2": {"model": 4, "data": 2},
    # experts under shard_map with a model axis: weights gathered over it, tokens split
    # (split expert widths left each model shard a partial sum: log-probs off by 1.5)
    "expert2_model2_data2": {"expert": 2, "model": 2, "data": 2},
}


def main(dtypes=("bfloat16", "float32"), modes=("deterministic", "fast"), layouts=tuple(LAYOUTS)):
  assert jax.device_count() == 8, jax.devices()
  base = ModelConfig(**TINY)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(1, base.vocab_size, size=n) for n in
          (37, 20, 9, 16, 30, 5, 44, 17, 26, 12, 3, 40, 28, 8, 19, 33)]
  p = pack(seqs, 64, base.page_size, num_rows=8)
  targets = np.concatenate([p.tokens[:, 1:], np.zeros_like(p.tokens[:, :1])], axis=1)
  mask = (p.segment_ids > 0).astype(np.float32)

  def run(cfg, params, numerics, sharding):
    def lp(params, batch):
      return forward(params, *batch[:2], cfg=cfg, numerics=numerics, segment_ids=batch[2],
                     targets=batch[3], sharding=sharding).logprobs

    def loss(params, batch):
      logprobs = lp(params, batch)
      return -jnp.sum(logprobs * batch[4]) / batch[4].sum(), logprobs

    batch = (p.tokens, p.positions, p.segment_ids, targets, mask)
    if sharding is not None:
      params = jax.device_put(params, param_shardings(cfg, sharding))
      batch = jax.device_put(batch, sharding.named(("batch", None)))
    if cfg.dtype != "float32":
      return np.asarray(jax.jit(lp)(params, batch)), None
    # f32: the log-probs and the gradients from one program (one compile per layout)
    (_, logprobs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, batch)
    return np.asarray(logprobs), grads

  results = {}
  for dtype in dtypes:
    cfg = ModelConfig(**{**TINY, "dtype": dtype, "param_dtype": dtype}).resolved(
        "cpu", "deterministic")
    params = init_params(cfg, jax.random.key(0), "float32")
    params = cast(scale_matrices(params, 10.0), dtype)
    for mode in modes:
      numerics = Numerics(mode)
      ref_lp, ref_grads = run(cfg, params, numerics, None)
      for name in layouts:
        sharding = sharding_lib.Sharding(sharding_lib.make_mesh(LAYOUTS[name]))
        lp, grads = run(cfg, params, numerics, sharding)
        entry = {"logprob_max_abs_diff": float(np.max(np.abs(lp - ref_lp) * mask))}
        if grads is not None:
          scale = scoring.nan_max(np.abs(g) for g in jax.tree.leaves(ref_grads))
          entry["grad_max_abs_diff_rel"] = scoring.max_abs_diff(
              jax.tree.leaves(grads), jax.tree.leaves(ref_grads)) / scale
        results[f"{dtype}/{mode}/{name}"] = entry
  print(json.dumps(results))


if __name__ == "__main__":
  main(*([a] for a in sys.argv[1:3]), *(a.split(",") for a in sys.argv[3:4]))
