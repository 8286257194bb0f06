"""A tiny policy with Qwen3-30B-A3B's expert sparsity (128 experts, top-8: 1/16 of the
experts per token) at tiny width: the workload where computing only the routed experts
matters (`experiments/bench_numerics.py --config=configs/sparse_moe_tiny.py`)."""

import ml_collections

from configs import tiny_moe


def get_config() -> ml_collections.ConfigDict:
  c = tiny_moe.get_config()
  c.model.update(dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32))
  return c
