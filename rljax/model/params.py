"""Parameter tree: specs with logical axes, abstract-first sharded init.

Layers are stacked per kind: `params["layers"]["moe"]` and `params["layers"]["dense"]`
(only the kinds the config has) hold every layer of that kind, in layer order, along a
leading axis (logical axis "layers"); `forward` scans over them. Entry j of the "moe"
stack is MoE layer `cfg.moe_layers()[j]` (and routing index j).

Each leaf's PRNG key is derived from its path name, so adding a layer or a tensor changes
no other tensor's initial value (the penzai convention). A stack's entry for layer i takes
the key of the name the layer would have alone, "layers/layer_{i:03d}/...", so stacking
changed no initial value.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding as sharding_lib
from rljax.model.config import ModelConfig

INIT_STD = 0.02  # Hugging Face Qwen3 `initializer_range`


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str = "normal"  # "normal" (std INIT_STD) or "ones"
  # a stack (leading axis "layers"): entry j is layer stack_layers[j]'s tensor, initialised
  # with that layer's own key
  stack_layers: tuple[int, ...] = ()


def layer_name(i: int) -> str:
  """Layer i's name: the name its PRNG keys derive from (and HF-style per-layer views)."""
  return f"layer_{i:03d}"


def stack_layers(cfg: ModelConfig, per_layer: dict[str, Any],
                 stack: Any = None) -> dict[str, Any]:
  """{layer_name(i): tree} -> {"dense": stacked, "moe": stacked} (kinds present only).

  `stack(entries)` combines one leaf's entries in layer order (default `jnp.stack`).
  """
  stack = stack or jnp.stack
  return {kind: jax.tree.map(lambda *xs: stack(list(xs)),
                             *[per_layer[layer_name(i)] for i in layers],
                             is_leaf=lambda x: not isinstance(x, dict))
          for kind, layers in cfg.layer_stacks()}


def layer_params(cfg: ModelConfig, params: dict[str, Any], i: int) -> dict[str, Any]:
  """Layer i's own params (its entry of its kind's stack)."""
  kind, j = cfg.layer_kind(i)
  return jax.tree.map(lambda w: w[j], params["layers"][kind])


def _layer_specs(cfg: ModelConfig, i: int) -> dict[str, Any]:
  d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  layer = {
      "attn_norm": {"scale": ParamSpec((d,), ("embed",), "ones")},
      "attn": {
          "q": ParamSpec((d, h * hd), ("embed", "heads")),
          "k": ParamSpec((d, kv * hd), ("embed", "kv_heads")),
          "v": ParamSpec((d, kv * hd), ("embed", "kv_heads")),
          "o": ParamSpec((h * hd, d), ("heads", "embed")),
          "q_norm": ParamSpec((hd,), ("head_dim",), "ones"),
          "k_norm": ParamSpec((hd,), ("head_dim",), "ones"),
      },
      "mlp_norm": {"scale": ParamSpec((d,), ("embed",), "ones")},
  }
  if cfg.is_moe_layer(i):
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    layer["moe"] = {
        "router": ParamSpec((d, e), ("embed", "router")),
        "gate": ParamSpec((d, e, f), ("embed", "expert", "mlp")),
        "up": ParamSpec((d, e, f), ("embed", "expert", "mlp")),
        "down": ParamSpec((e, f, d), ("expert", "mlp", "embed")),
    }
  else:
    f = cfg.intermediate_size
    layer["mlp"] = {
        "gate": ParamSpec((d, f), ("embed", "mlp")),
        "up": ParamSpec((d, f), ("embed", "mlp")),
        "down": ParamSpec((f, d), ("mlp", "embed")),
    }
  return layer


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """The nested dict of ParamSpec that defines every parameter."""
  d = cfg.hidden_size
  specs: dict[str, Any] = {"embed": {"embedding": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"))}}
  specs["layers"] = {
      kind: jax.tree.map(lambda s, layers=layers: ParamSpec(
          (len(layers), *s.shape), ("layers", *s.axes), s.init, layers),
                         _layer_specs(cfg, layers[0]), is_leaf=_is_spec)
      for kind, layers in cfg.layer_stacks()}
  specs["final_norm"] = {"scale": ParamSpec((d,), ("embed",), "ones")}
  if not cfg.tie_word_embeddings:
    specs["lm_head"] = {"kernel": ParamSpec((d, cfg.vocab_size), ("embed", "vocab"))}
  return specs


def _is_spec(x: Any) -> bool:
  return isinstance(x, ParamSpec)


def logical_axes(cfg: ModelConfig) -> dict[str, Any]:
  """Tree of logical-axes tuples, same structure as the params."""
  return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def path_key(base: jax.Array, path: tuple[Any, ...]) -> jax.Array:
  name = "/".join(str(getattr(p, "key", p)) for p in path)
  return jax.random.fold_in(base, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = None) -> dict[str, Any]:
  """Initial params (unsharded). Use `init_sharded` for anything but tiny models."""
  dtype = jnp.dtype(dtype or cfg.param_dtype)

  def normal(path, shape):
    return (INIT_STD * jax.random.normal(path_key(key, path), shape, jnp.float32)).astype(dtype)

  def init_leaf(path, spec: ParamSpec):
    if spec.init == "ones":
      return jnp.ones(spec.shape, dtype)
    if not spec.stack_layers:
      return normal(path, spec.shape)
    # path is ("layers", kind, ...): entry j is keyed as "layers/layer_{i}/..."
    return jnp.stack([normal((path[0], layer_name(i), *path[2:]), spec.shape[1:])
                      for i in spec.stack_layers])

  return jax.tree_util.tree_map_with_path(init_leaf, param_specs(cfg), is_leaf=_is_spec)


def abstract_params(cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
  return jax.eval_shape(lambda k: init_params(cfg, k, dtype), jax.random.key(0))


def param_shardings(cfg: ModelConfig, sharding: sharding_lib.Sharding) -> dict[str, Any]:
  return sharding.tree_shardings(logical_axes(cfg))


def init_sharded(cfg: ModelConfig, seed: int, sharding: sharding_lib.Sharding | None,
                 dtype: Any = None) -> dict[str, Any]:
  """Abstract-first init: eval_shape -> shardings -> jit(init, out_shardings)."""
  abstract_params(cfg, dtype)  # validates shapes without allocating
  out_shardings = None if sharding is None else param_shardings(cfg, sharding)
  init = jax.jit(lambda k: init_params(cfg, k, dtype), out_shardings=out_shardings)
  return init(jax.random.key(seed))


def count_params(tree: Any) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def active_params(cfg: ModelConfig) -> int:
  """Parameters touched per token: all but the unchosen experts (and the embedding
  table counts once as a lookup plus the LM head, as Qwen reports it)."""
  tree = abstract_params(cfg)
  total = count_params(tree)
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
  return total - len(cfg.moe_layers()) * (e - k) * per_expert


def scale_matrices(params: dict[str, Any], factor: float) -> dict[str, Any]:
  """Every weight matrix times `factor`, vectors (norm scales) unchanged; a layer stack's
  leading axis is not a matrix dimension. Tests and benchmarks sharpen a random init with
  it (x10: routing and attention sharp enough that a one-ulp difference would show)."""
  def scale(path, x):
    per_layer_ndim = x.ndim - (getattr(path[0], "key", None) == "layers")
    return x * factor if per_layer_ndim > 1 else x
  return jax.tree_util.tree_map_with_path(scale, params)


def cast(tree: Any, dtype: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(dtype), tree)


