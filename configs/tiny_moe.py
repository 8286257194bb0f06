"""A tiny Qwen3-MoE-shaped policy that runs on a laptop CPU (tests, benchmarks)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.numerics = "deterministic"
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "expert": 1, "model": 1})
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
      moe_intermediate_size=32, intermediate_size=96, mlp_only_layers=(0,),
      decoder_sparse_step=1, norm_topk_prob=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=False, max_position_embeddings=256, page_size=16,
      dtype="auto", param_dtype="bfloat16", remat=False))
  return c
