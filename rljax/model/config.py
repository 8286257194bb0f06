"""ModelConfig: the static description of a Qwen3-MoE-style decoder."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hashable, so it can be a static argument of jitted functions.

  Field names follow Hugging Face's Qwen3MoeConfig where one exists.
  """

  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  intermediate_size: int = 0  # dense FFN width, for layers in `mlp_only_layers`
  mlp_only_layers: tuple[int, ...] = ()
  decoder_sparse_step: int = 1
  norm_topk_prob: bool = True
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 4096
  page_size: int = 16  # the KV block of attention: keys are reduced in blocks of this size
  # one-token decode steps over paged KV: "auto" = the Pallas kernel on GPU in fast mode,
  # the jnp reference otherwise; "reference"; "pallas"; "pallas_interpret" (CPU tests)
  decode_attention: str = "auto"
  dtype: str = "bfloat16"  # activations and matmul operands
  param_dtype: str = "bfloat16"
  remat: bool = False

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError("need 0 < num_experts_per_tok <= num_experts")
    if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
      raise ValueError(f"mlp_only_layers {self.mlp_only_layers} out of range")
    if self.decode_attention not in ("auto", "reference", "pallas", "pallas_interpret"):
      raise ValueError(f"unknown decode_attention {self.decode_attention!r}")
    if self.dense_layers() and self.intermediate_size <= 0:
      raise ValueError("dense layers need intermediate_size > 0")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise ValueError(f"unknown model config keys: {sorted(unknown)}")
    d = dict(d)
    if "mlp_only_layers" in d:
      d["mlp_only_layers"] = tuple(int(i) for i in d["mlp_only_layers"])
    return cls(**d)

  def is_moe_layer(self, i: int) -> bool:
    return (i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0)

  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

  def dense_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def group_size(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads
