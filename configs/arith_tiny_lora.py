"""arith_tiny with GRPO training LoRA adapters (rank 16) on the frozen SFT warm start.

Every block is arith_tiny's, plus `lora`: rank 16, alpha 32 (scale 2), every attention
projection, the dense MLP and every expert's gate/up/down. Both loops take it:
experiments/grpo.py (lockstep) and experiments/pipeline.py (async: each stream version is
the adapters' f32 masters, the base goes to the hosts once; rljax/pipeline/adapter_stream.py).
The learning rate is arith_tiny's full fine-tuning one; what it reaches with adapters has
not been measured yet.
"""

import ml_collections

from configs import arith_tiny
from rljax.model.lora import DEFAULT_TARGETS


def get_config() -> ml_collections.ConfigDict:
  c = arith_tiny.get_config()
  c.name = "arith_tiny_lora"
  c.lora = ml_collections.ConfigDict(dict(rank=16, alpha=32.0, targets=DEFAULT_TARGETS))
  return c
