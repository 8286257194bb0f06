"""Parameter tree: specs with logical axes, abstract-first sharded init.

Each leaf's PRNG key is derived from its path name, so adding a layer or a tensor changes
no other tensor's initial value (the penzai convention).
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


def layer_name(i: int) -> str:
  return f"layer_{i:03d}"


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """The nested dict of ParamSpec that defines every parameter."""
  d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  specs: dict[str, Any] = {"embed": {"embedding": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"))}}
  layers = {}
  for i in range(cfg.num_hidden_layers):
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
    layers[layer_name(i)] = layer
  specs["layers"] = layers
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

  def init_leaf(path, spec: ParamSpec):
    if spec.init == "ones":
      return jnp.ones(spec.shape, dtype)
    return (INIT_STD * jax.random.normal(path_key(key, path), spec.shape, jnp.float32)).astype(dtype)

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


def cast(tree: Any, dtype: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(dtype), tree)


