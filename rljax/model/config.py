"""ModelConfig: the static description of a Qwen3-MoE-style decoder."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax.numpy as jnp

from pallas_kernels.det_attention import tpu_block_error

_AUTO_FIELDS = ("decode_attention", "det_attention", "train_experts", "engine_experts",
                "expert_kernel", "dtype")
_EXPERT_PATHS = ("auto", "dense", "ragged", "tiled", "by_tokens")
# what runs the expert tiles (`expert_kernel`) and deterministic attention (`det_attention`)
KERNELS = ("jnp", "pallas_tpu", "pallas_gpu", "pallas_interpret")
_KERNEL_CHOICES = ("auto",) + KERNELS


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
  """Whether this host's CPU has bf16 dot instructions (x86 AVX512_BF16 or AMX-BF16)."""
  try:
    with open("/proc/cpuinfo") as f:
      flags = f.read()
  except OSError:
    return False
  return " avx512_bf16" in flags or " amx_bf16" in flags


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
  # Backend choices; "auto" is turned into a concrete choice once, by `resolved(backend,
  # numerics)`, before any `forward` (which refuses "auto").
  # One-token decode steps over paged KV: "reference" (jnp), "pallas", "pallas_interpret"
  # (CPU tests); "auto" = "pallas" on GPU in fast mode, "reference" otherwise.
  decode_attention: str = "auto"
  # Deterministic numerics' attention, in the training forward, prefill and decode alike:
  # "jnp" (rljax.block_attention: what CPUs run), "pallas_tpu" / "pallas_gpu"
  # (pallas_kernels.det_attention, the same tiling; on a mesh each device's rows and
  # heads), "pallas_interpret" (the GPU kernel interpreted on CPU: the jnp bits, tests).
  # "auto" = "pallas_tpu" on TPU in deterministic numerics where Mosaic takes the blocks
  # (head_dim a multiple of 128, page_size of 8; Qwen3's shapes), else "jnp". Mosaic
  # compiles it, packed row and paged decode, in Qwen3-30B-A3B's GRPO step, decode loop
  # and prefill and in sharded programs; interpreted it gives the jnp path's bits (tested).
  det_attention: str = "auto"
  # Expert paths (rljax.model.moe): "ragged" (sorted `lax.ragged_dot`, a grouped GEMM on
  # GPU/TPU), "tiled" (only the routed experts, in fixed tiles of `expert_row_tile` rows,
  # one batched dot) or "dense" (every expert for every token; in fast numerics on one
  # device `moe.dense_mixture`, the combine folded into the down projection's dot), or
  # (fast numerics) "by_tokens": per call, "tiled" when dense would compute enough more
  # rows (prefills), else "dense" (moe.tiled_beats_dense, measured). XLA:CPU expands
  # `ragged_dot` densely over every expert, so "auto" = on CPU "tiled" for the training forward
  # (thousands of tokens) and "by_tokens" for the engine's forward (decode steps of a few
  # tokens per slot, prefills of many); "ragged" elsewhere. Deterministic
  # mode: "auto" = "tiled" for both (batch-invariant: every tile is one fixed-shape dot;
  # "ragged" there also runs "tiled"); "dense" is its own path with other bits, allowed
  # only for both forwards at once. The row tile bounds the padding (under one tile per
  # expert); at 32, Qwen3-30B-A3B's tiles on 4,096 tokens cost at most 1.125x the routed
  # expert FLOPs (the whole MoE layer 1.14x in XLA's cost analysis), and it was the
  # fastest tile on CPU for 128 experts top-8 (bench_numerics).
  train_experts: str = "auto"
  engine_experts: str = "auto"
  expert_row_tile: int = 32
  # What multiplies the routed tiles (rljax.model.moe_tiles.tile_matmul): "jnp" (one batched
  # dot; what CPUs run), "pallas_tpu" / "pallas_gpu" (pallas_kernels.grouped_matmul:
  # weights read in place by each tile's expert), "pallas_interpret" (the TPU kernel
  # interpreted on CPU: the jnp kernel's bits, tests). The TPU kernels also take the
  # backward: the tiles' on grouped_matmul and megablox tgmm (moe_tiles._routed_tiles_bwd), the
  # "ragged" path's weight gradients on tgmm (grouped_matmul.ragged_dot_tgmm; XLA's
  # transpose of ragged_dot there is a dense masked convolution over every expert).
  # "auto" = "pallas_tpu" on TPU (compiled by Mosaic at Qwen3-30B-A3B's shapes, on a mesh
  # per device under shard_map; interpreted it gives the jnp kernel's bits: tested): the
  # 30B GRPO step on v5p:4x4x4 in deterministic numerics takes 26 GiB a chip (the jnp
  # backward 135 GB), in fast numerics 4.1x fewer FLOPs; else "jnp" (on GPU "pallas_gpu"
  # stays opt-in).
  expert_kernel: str = "auto"
  # Activations and matmul operands. "auto" = "bfloat16", except fast mode on a CPU
  # without native bf16 dot instructions (AVX512_BF16/AMX): there "float32", which is
  # faster (bf16 dots are emulated; measured in experiments/bench_numerics.py).
  # Deterministic mode resolves "auto" to bf16: its bitwise guarantee is for bf16 dots.
  dtype: str = "auto"
  param_dtype: str = "bfloat16"
  remat: bool = False  # rematerialise each layer in the backward pass
  # one lax.scan per run of same-kind layers (`layer_runs`); False unrolls the layers
  # (the reference the scan is tested bitwise against)
  scan_layers: bool = True

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError("need 0 < num_experts_per_tok <= num_experts")
    if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
      raise ValueError(f"mlp_only_layers {self.mlp_only_layers} out of range")
    if self.decode_attention not in ("auto", "reference", "pallas", "pallas_interpret"):
      raise ValueError(f"unknown decode_attention {self.decode_attention!r}")
    for name in ("train_experts", "engine_experts"):
      if getattr(self, name) not in _EXPERT_PATHS:
        raise ValueError(f"unknown {name} {getattr(self, name)!r}; expected one of "
                         f"{_EXPERT_PATHS}")
    for name in ("det_attention", "expert_kernel"):
      if getattr(self, name) not in _KERNEL_CHOICES:
        raise ValueError(f"unknown {name} {getattr(self, name)!r}; expected one of "
                         f"{_KERNEL_CHOICES}")
    if self.expert_row_tile < 1:
      raise ValueError(f"expert_row_tile must be >= 1, got {self.expert_row_tile}")
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

  def resolved(self, backend: str, numerics: str | Any) -> "ModelConfig":
    """This config with every "auto" backend choice made for `backend` ("cpu", "gpu" (or
    "cuda", "rocm"), "tpu": `jax.default_backend()`, or the platform an AOT check lowers
    for) and `numerics` (a mode name or a `Numerics`). Concrete choices are kept."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)
    if platform not in ("cpu", "gpu", "tpu"):
      raise ValueError(f"unknown backend {backend!r}; expected cpu, gpu (cuda, rocm) or tpu")
    mode = getattr(numerics, "mode", numerics)
    if mode not in ("fast", "deterministic"):
      raise ValueError(f"unknown numerics mode {mode!r}")
    choices = {}
    if self.decode_attention == "auto":
      fast_gpu = platform == "gpu" and mode == "fast"
      # deterministic mode keeps the reference: the kernel's exp and reductions are not
      # the training forward's
      choices["decode_attention"] = "pallas" if fast_gpu else "reference"
    deterministic = mode == "deterministic"
    if self.det_attention == "auto":
      kernel_fits = tpu_block_error(self.page_size, self.head_dim,
                                    self.num_key_value_heads) is None
      tpu_kernel = platform == "tpu" and deterministic and kernel_fits
      choices["det_attention"] = "pallas_tpu" if tpu_kernel else "jnp"
    if self.expert_kernel == "auto":
      choices["expert_kernel"] = "pallas_tpu" if platform == "tpu" else "jnp"
    if self.train_experts == "auto":
      choices["train_experts"] = "tiled" if platform == "cpu" or deterministic else "ragged"
    if self.engine_experts == "auto":
      fast_engine = "by_tokens" if platform == "cpu" else "ragged"
      choices["engine_experts"] = "tiled" if deterministic else fast_engine
    paths = {choices.get(f, getattr(self, f)) for f in ("train_experts", "engine_experts")}
    if deterministic and "by_tokens" in paths:
      raise ValueError("deterministic numerics: the 'by_tokens' expert path mixes the dense "
                       "and tiled paths' bits (use 'tiled' or 'dense')")
    if deterministic and "dense" in paths and len(paths) > 1:
      raise ValueError(
          "deterministic numerics: train_experts and engine_experts must both be 'dense' "
          f"or neither (got {self.train_experts!r} and {self.engine_experts!r}): the dense "
          "path's expert outputs are not the routed tiles' bits")
    if self.dtype == "auto":
      emulated_bf16 = platform == "cpu" and not cpu_has_native_bf16()
      choices["dtype"] = "float32" if mode == "fast" and emulated_bf16 else "bfloat16"
    return dataclasses.replace(self, **choices)

  def check_resolved(self) -> None:
    """Raises unless every backend choice is concrete (see `resolved`)."""
    auto = [f for f in _AUTO_FIELDS if getattr(self, f) == "auto"]
    if auto:
      raise ValueError(f"ModelConfig.{'/'.join(auto)} is 'auto': resolve the config once "
                       "with cfg.resolved(jax.default_backend(), numerics) before calling "
                       "the model")

  def is_moe_layer(self, i: int) -> bool:
    return (i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0)

  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

  def dense_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

  def layer_stacks(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(kind, layers) of each param stack, "dense" then "moe", kinds present only."""
    return tuple((kind, layers) for kind, layers in
                 (("dense", self.dense_layers()), ("moe", self.moe_layers())) if layers)

  def layer_kind(self, i: int) -> tuple[str, int]:
    """("dense" | "moe", index of layer i in its kind's stack)."""
    kind = "moe" if self.is_moe_layer(i) else "dense"
    return kind, dict(self.layer_stacks())[kind].index(i)

  def layer_runs(self) -> tuple[tuple[str, int, int, int], ...]:
    """Maximal runs of consecutive layers of one kind, in layer order: (kind, first
    layer, first stack index, length). `forward` runs one `lax.scan` per run, so a uniform
    model is one scan whatever its depth."""
    runs = []
    for i in range(self.num_hidden_layers):
      kind, j = self.layer_kind(i)
      if runs and runs[-1][0] == kind:
        runs[-1][3] += 1
      else:
        runs.append([kind, i, j, 1])
    return tuple(tuple(r) for r in runs)

  @property
  def compute_dtype(self):
    if self.dtype == "auto":
      self.check_resolved()
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def group_size(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads
