"""Qwen3-235B-A22B (Hugging Face Qwen/Qwen3-235B-A22B config.json): 235B total, 22B active.

`get_config("tiny")` is the same architecture shrunk to run on a CPU.
"""

import ml_collections

from configs import tiny_moe


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
  if variant == "tiny":
    c = tiny_moe.get_config()
    c.model.num_experts_per_tok = 2
    return c
  if variant != "full":
    raise ValueError(f"unknown variant {variant!r}; use 'full' or 'tiny'")
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.numerics = "fast"
  # a 256-chip plan (v5p-512, or 32 nodes of 8x H100): experts over 8 x 8 (expert x fsdp),
  # tensor parallel over 4 (one KV head per device, so the KV pages shard 4 ways too)
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 8, "expert": 8, "model": 4})
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
      num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
      moe_intermediate_size=1536, intermediate_size=12288, mlp_only_layers=(),
      decoder_sparse_step=1, norm_topk_prob=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=False, max_position_embeddings=40960, page_size=16,
      dtype="bfloat16", param_dtype="bfloat16", remat=True))
  return c
