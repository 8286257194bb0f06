"""The default experiment (`make run`): the policy core end to end on CPU.

Builds the tiny Qwen3-MoE policy abstract-first on a mesh of the local devices, scores a
packed batch with the training forward, decodes the same sequences one token at a time
through the paged-KV path, and checks that the two give the same bits in deterministic
mode. Last line: one JSON object.
"""

import json
import time

from absl import app, logging
import jax
from ml_collections import config_flags
import numpy as np

from rljax.model import count_params, init_sharded, scoring
from rljax.pipeline.run import MODEL_ONLY, build

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_moe.py", "experiment config")


def main(_):
  config = _CONFIG.value
  built = build(config, MODEL_ONLY)
  cfg, numerics, sharding = built.cfg, built.numerics, built.sharding
  logging.info("devices: %s", jax.devices())
  t0 = time.perf_counter()
  params = init_sharded(cfg, config.seed, sharding)
  rng = np.random.default_rng(config.seed)
  seqs = [rng.integers(1, cfg.vocab_size, size=int(n)) for n in rng.integers(8, 60, size=6)]
  train_lp = scoring.packed_logprobs(params, seqs, cfg=cfg, numerics=numerics, row_len=128,
                                     sharding=sharding)
  decode_lp = scoring.paged_decode_logprobs(params, seqs, cfg=cfg, numerics=numerics,
                                            shuffle_pages_seed=config.seed)
  diff = scoring.max_abs_diff(train_lp, decode_lp)
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
