"""The default experiment (`make run`): the policy core end to end on CPU.

Builds the tiny Qwen3-MoE policy abstract-first on a mesh of the local devices, scores a
packed batch with the training forward, decodes the same sequences one token at a time
through the paged-KV path, and checks that the two give the same bits in deterministic
mode. Last line: one JSON object.
"""

import rljax  # noqa: F401  (XLA flags first)

import json
import time

from absl import app, logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from rljax import sharding as sharding_lib
from rljax.model import ModelConfig, PagedKV, count_params, forward, init_sharded
from rljax.model.packing import pack, unpack
from rljax.numerics import Numerics

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_moe.py", "experiment config")


def main(_):
  config = _CONFIG.value
  cfg = ModelConfig.from_dict(config.model.to_dict())
  numerics = Numerics(config.numerics)
  logging.info("devices: %s", jax.devices())
  mesh_shape = {k: v for k, v in config.mesh.items() if v > 1} or None
  sharding = sharding_lib.Sharding(sharding_lib.make_mesh(mesh_shape, jax.devices()[:1]
                                                          if mesh_shape is None else None))
  t0 = time.perf_counter()
  params = init_sharded(cfg, config.seed, sharding)
  rng = np.random.default_rng(config.seed)
  seqs = [rng.integers(1, cfg.vocab_size, size=int(n)) for n in rng.integers(8, 60, size=6)]
  packed = pack(seqs, 128, cfg.page_size)
  targets = np.concatenate([packed.tokens[:, 1:], np.zeros_like(packed.tokens[:, :1])], axis=1)
  train_lp = jax.jit(lambda p: forward(p, packed.tokens, packed.positions, cfg=cfg,
                                       numerics=numerics, segment_ids=packed.segment_ids,
                                       targets=targets, sharding=sharding).logprobs)(params)
  train_lp = [x[:-1] for x in unpack(np.asarray(train_lp), packed)]

  b, n = len(seqs), max(map(len, seqs))
  tokens = np.zeros((b, n), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  blocks = -(-n // cfg.page_size)
  shape = (cfg.num_hidden_layers, 1 + b * blocks, cfg.page_size, cfg.num_key_value_heads,
           cfg.head_dim)
  kv = PagedKV(jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype),
               jnp.asarray(1 + np.arange(b * blocks).reshape(b, blocks), jnp.int32))
  step = jax.jit(lambda p, t, pos, kv, tg: forward(p, t, pos, cfg=cfg, numerics=numerics,
                                                   kv=kv, targets=tg))
  lengths = np.array([len(s) for s in seqs])
  dec = np.zeros((b, n), np.float32)
  for i in range(n - 1):
    pos = np.where(i < lengths, i, -1).astype(np.int32)[:, None]
    res = step(params, tokens[:, i:i + 1], pos, kv, tokens[:, i + 1:i + 2])
    kv, dec[:, i] = res.kv, np.asarray(res.logprobs)[:, 0]
  diff = max(float(np.max(np.abs(t - dec[i, :len(t)]))) for i, t in enumerate(train_lp))
  print(json.dumps({
      "experiment": "policy core: packed training forward vs paged decode",
      "numerics": numerics.mode, "params": count_params(params),
      "sequences": len(seqs), "tokens": int(sum(map(len, seqs))),
      "max_abs_logprob_diff_train_vs_decode": diff,
      "wall_s": round(time.perf_counter() - t0, 2),
  }))
  if numerics.deterministic and diff != 0.0:
    raise SystemExit("deterministic mode must give bitwise-equal log-probs")


if __name__ == "__main__":
  app.run(main)
