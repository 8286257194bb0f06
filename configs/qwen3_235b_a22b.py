"""Qwen3-235B-A22B (Hugging Face Qwen/Qwen3-235B-A22B config.json): 235B total, 22B active.

Qwen3-30B-A3B's architecture (configs/qwen3_30b_a3b.py) at the larger shape, with a
256-chip mesh plan and a 16-chip rollout host (`engine`: experts split 16 ways, 44 GiB of
weights + KV a chip): `model`, `mesh` and `engine` only, for the AOT check (no env, rl or
async_rl blocks yet). `get_config("tiny")` / `get_config("tiny_random")` are qwen3_30b_a3b's
tiny variants (the blocks shrunk to run on a CPU; a checkpoint's architecture, or
tiny_moe's randomly initialised).
"""

import ml_collections

from configs import qwen3_30b_a3b


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
  c = qwen3_30b_a3b.get_config(variant)
  if variant in ("tiny", "tiny_random"):
    return c
  c = ml_collections.ConfigDict(dict(name="qwen3_235b_a22b", seed=c.seed,
                                     numerics=c.numerics, model=c.model))
  # a 256-chip plan (v5p-512, or 32 nodes of 8x H100): experts over 8 x 8 (expert x fsdp),
  # tensor parallel over 4 (one KV head per device, so the KV pages shard 4 ways too)
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 8, "expert": 8, "model": 4})
  # a prefill call of at most 8 rows x 4,096 tokens: 64 x 4,096 at once would need 109 GB
  # of temporaries a chip on a 16-chip v5p host; 8 rows need 14.6 GiB, peak 67% of HBM
  # (the TPU compiler: experiments/aot_check.py --topology=v5p:8x8x4)
  c.engine = ml_collections.ConfigDict(dict(num_slots=64, max_seq_len=4096,
                                            mesh={"expert": 16}, max_prefill_tokens=8 * 4096))
  c.model.update(dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                      moe_intermediate_size=1536, intermediate_size=12288))
  return c
