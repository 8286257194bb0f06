"""Low-rank adapters (LoRA): their own pytree beside the frozen base params.

A target weight W (per layer: [in, out], or per expert [in, E, out] / [E, in, out]) gets
A (W's shape with `out` replaced by the rank r) and B (W's shape without `in`, r before
`out`), so that for every expert e

    W'[.., e, ..] = W + scale * A[.., e, ..] @ B[e, ..],    scale = alpha / rank,

and `forward(merge(base, adapters, lora), ...)` is the adapted model: x @ W' is
x @ W + scale * (x @ A) @ B up to rounding. The adapters are stacked per layer kind like
the base (`params["layers"][kind]`, leading axis "layers") and carry logical axes: A
keeps W's axes with `out` unsharded, B keeps W's with `in` dropped and the rank
unsharded, so each shards like its base weight (`adapter_axes`).

The merge is elementwise: the rank sum runs in f32, in a fixed order (r = 0, 1, ...), as
multiplies and adds of whole tensors, never a dot whose summation order XLA may choose by
context. So a trainer that merges inside its jitted, differentiated step and an engine
that merges once per version compute the same W' bits from the same adapters, and in
deterministic numerics the engine's log-probs stay bitwise the trainer's. B starts at
zero, so a fresh adapter's W' is W exactly (bf16 -> f32, + 0, -> bf16). Where the
adapted model is exported, W' is the merged HF weight.

The merge costs rank multiply-adds per element of every target weight (a few ms per
version of a 30B model on an accelerator); the trainer differentiates through it, so its
gradient reaches A and B only (`value_and_grad` over the adapters, the base a constant).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from rljax.model.config import ModelConfig
from rljax.model.params import INIT_STD, ParamSpec, param_specs, path_key

# target name -> (block, weight) of the per-layer params; "moe.*" are per expert
TARGETS = {
    "attn.q": ("attn", "q"), "attn.k": ("attn", "k"), "attn.v": ("attn", "v"),
    "attn.o": ("attn", "o"),
    "mlp.gate": ("mlp", "gate"), "mlp.up": ("mlp", "up"), "mlp.down": ("mlp", "down"),
    "moe.gate": ("moe", "gate"), "moe.up": ("moe", "up"), "moe.down": ("moe", "down"),
    "moe.router": ("moe", "router"),
}
# the logical axis each weight's input comes in on, and its output goes out on
_IN_OUT = {"q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
           "o": ("heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"),
           "down": ("mlp", "embed"), "router": ("embed", "router")}
DEFAULT_TARGETS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down",
                   "moe.gate", "moe.up", "moe.down")
RANK_AXIS = None  # the rank is never sharded: r is small and every shard needs all of it


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """`config.lora`: rank r, alpha (scale = alpha / r) and the target weights (TARGETS'
  names; a target the model lacks, e.g. "mlp.*" in an all-MoE model, adapts nothing)."""

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = DEFAULT_TARGETS

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(f"lora rank must be an int >= 1, not {self.rank!r}")
    if not self.alpha > 0:
      raise ValueError(f"lora alpha must be > 0, not {self.alpha!r}")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"lora targets {unknown or '()'} are not among {list(TARGETS)}")
    if len(set(self.targets)) != len(self.targets):
      raise ValueError(f"lora targets repeat: {list(self.targets)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "LoraConfig":
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown lora fields {sorted(unknown)}")
    return cls(**dict(d))


def _factor_specs(spec: ParamSpec, weight: str, rank: int) -> dict[str, ParamSpec]:
  """A and B specs of one stacked target weight (leading axis "layers")."""
  in_axis, out_axis = _IN_OUT[weight]
  axes = spec.axes
  i, o = axes.index(in_axis), axes.index(out_axis)
  if o != len(axes) - 1:
    raise ValueError(f"{weight}: its output axis must be last, axes {axes}")
  a_shape = spec.shape[:o] + (rank,)
  a_axes = axes[:o] + (RANK_AXIS,)
  b_shape = spec.shape[:i] + spec.shape[i + 1:o] + (rank, spec.shape[o])
  b_axes = axes[:i] + axes[i + 1:o] + (RANK_AXIS, out_axis)
  # A like a fresh base weight (the Kaiming-like normal of PEFT's default is a scale
  # away: std 0.02 here, as every other init); B zero: a fresh adapter changes nothing
  return {"a": ParamSpec(a_shape, a_axes, "normal", spec.stack_layers),
          "b": ParamSpec(b_shape, b_axes, "zeros", spec.stack_layers)}


def adapter_specs(cfg: ModelConfig, lora: LoraConfig) -> dict[str, Any]:
  """{"layers": {kind: {block: {weight: {"a": spec, "b": spec}}}}} for the targets the
  model has; the same nesting as the base params' layers."""
  base = param_specs(cfg)["layers"]
  out: dict[str, Any] = {}
  for kind, blocks in base.items():
    for target in lora.targets:
      block, weight = TARGETS[target]
      if block in blocks and weight in blocks[block]:
        out.setdefault(kind, {}).setdefault(block, {})[weight] = _factor_specs(
            blocks[block][weight], weight, lora.rank)
  if not out:
    raise ValueError(f"lora targets {list(lora.targets)}: the model has none of them")
  return {"layers": out}


def _is_spec(x: Any) -> bool:
  return isinstance(x, ParamSpec)


def adapter_axes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, Any]:
  """Logical axes of every adapter leaf (for `Sharding.tree_shardings`)."""
  return jax.tree.map(lambda s: s.axes, adapter_specs(cfg, lora), is_leaf=_is_spec)


def init_adapters(cfg: ModelConfig, lora: LoraConfig, key: jax.Array,
                  dtype: Any = jnp.float32) -> dict[str, Any]:
  """Fresh adapters: A normal (std 0.02, keyed by its path), B zeros."""
  def leaf(path, spec: ParamSpec):
    if spec.init == "zeros":
      return jnp.zeros(spec.shape, dtype)
    return (INIT_STD * jax.random.normal(path_key(key, ("lora", *path)), spec.shape,
                                         jnp.float32)).astype(dtype)

  return jax.tree_util.tree_map_with_path(leaf, adapter_specs(cfg, lora), is_leaf=_is_spec)


def _in_index(weight: str, ndim: int) -> int:
  """Where a stacked target weight's input axis is: [L, in, out], [L, in, E, out] (expert
  gate/up) or [L, E, in, out] (expert down)."""
  return 1 if ndim == 4 and weight in ("gate", "up") else ndim - 2


def delta(a: jax.Array, b: jax.Array, weight: str) -> jax.Array:
  """sum_r A[.., r] * B[.., r, :] with W's shape (stacked: leading "layers"), in f32, r in
  order, as elementwise multiplies and adds only."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  i = _in_index(weight, a.ndim)
  acc = None
  for r in range(a.shape[-1]):
    term = a[..., r][..., None] * jnp.expand_dims(b[..., r, :], i)
    acc = term if acc is None else acc + term
  return acc


def merge(params: dict[str, Any], adapters: dict[str, Any], lora: LoraConfig
          ) -> dict[str, Any]:
  """The base params with every adapted weight W replaced by W + scale * A @ B, cast
  back to W's dtype; every other leaf is the base's own (the same array)."""
  layers = dict(params["layers"])
  for kind, blocks in adapters["layers"].items():
    stack = dict(layers[kind])
    for block, weights in blocks.items():
      merged = dict(stack[block])
      for weight, ab in weights.items():
        w = merged[weight]
        d = delta(ab["a"], ab["b"], weight)
        merged[weight] = (w.astype(jnp.float32) + jnp.float32(lora.scale) * d).astype(w.dtype)
      stack[block] = merged
    layers[kind] = stack
  return {**params, "layers": layers}
