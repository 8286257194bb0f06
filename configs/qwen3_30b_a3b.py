"""Qwen3-30B-A3B (Hugging Face Qwen/Qwen3-30B-A3B config.json): 30.5B total, 3.3B active.

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
  # a v5p-64 / 8x8 H100 plan: experts over 8 devices, fsdp over the rest
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 8, "expert": 8, "model": 1})
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
      num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
      moe_intermediate_size=768, intermediate_size=6144, mlp_only_layers=(),
      decoder_sparse_step=1, norm_topk_prob=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=False, max_position_embeddings=40960, page_size=16,
      dtype="bfloat16", param_dtype="bfloat16", remat=True))
  return c
