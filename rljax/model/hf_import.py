"""Import a Hugging Face Qwen3-MoE checkpoint (config.json + *.safetensors) as our params.

Two expert layouts are read, per MoE layer:

* the hub layout, one tensor per expert and projection (what the released Qwen3-MoE
  checkpoints hold, and what `save_pretrained` of transformers 5.x writes by default,
  because `save_original_format=True` reverts the in-memory fused tensors):
  `model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight` [F, D] and
  `...experts.{e}.down_proj.weight` [D, F];
* the fused layout of transformers 5.x's in-memory `Qwen3MoeExperts` (what
  `save_pretrained(..., save_original_format=False)` writes):
  `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2F, D], gate rows first then up rows
  (the `qwen2_moe` WeightConverter in transformers/conversion_mapping.py builds it with
  MergeModulelist(dim=0) then Concatenate(dim=1) of [gate, up]; the forward splits it
  with `.chunk(2, dim=-1)`), and `model.layers.{i}.mlp.experts.down_proj` [E, D, F].

Every tensor in the files must be used and every parameter found; all missing and all
unexpected keys are reported together, before any tensor data is read.

Reading: `safetensors.safe_open(..., framework="numpy")` (safetensors 0.8.0) lists keys,
dtypes and shapes, and reads tensors of the dtypes numpy has. It cannot return BF16 (nor
F8) tensors: both the "numpy" and the "flax" frameworks fail with "data type 'bfloat16'
not understood". For those dtypes the bytes are read through the file's own header
(8-byte little-endian header length, JSON header with `data_offsets` relative to the end
of the header) from a read-only memory map and viewed as the `ml_dtypes` type.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import struct
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from rljax.model.config import ModelConfig
from rljax.model.params import ParamSpec, layer_name, param_specs, stack_layers

# Defaults of transformers' Qwen3MoeConfig for keys a config.json may leave out.
_HF_DEFAULTS = dict(intermediate_size=6144, mlp_only_layers=(), decoder_sparse_step=1,
                    norm_topk_prob=False, rope_theta=10000.0, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, max_position_embeddings=32768)
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "num_experts_per_tok", "moe_intermediate_size")

# safetensors dtypes numpy cannot name; read as raw bytes and viewed as these.
_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
               "F8_E5M2": ml_dtypes.float8_e5m2}


def _rope_theta(hf: Mapping[str, Any]) -> float:
  """rope_theta from transformers 5 `rope_parameters`, or 4.x top-level `rope_theta` +
  `rope_scaling`. Only plain ("default") RoPE is supported."""
  params = {}
  for name in ("rope_parameters", "rope_scaling"):
    p = hf.get(name)
    if p is None:
      continue
    if not isinstance(p, Mapping):
      raise ValueError(f"{name} must be a dict or null, got {p!r}")
    if p and all(isinstance(v, Mapping) for v in p.values()):
      raise ValueError(f"per-layer-type {name} {dict(p)} not supported (Qwen3-MoE has one RoPE)")
    params.update(p)
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in (None, "default"):
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r} ({dict(params)}): the model "
                     "implements plain RoPE only")
  partial = params.get("partial_rotary_factor", 1.0)
  if partial != 1.0:
    raise ValueError(f"unsupported partial_rotary_factor {partial}: the model rotates the "
                     "whole head")
  theta = params.get("rope_theta", hf.get("rope_theta"))
  return float(_HF_DEFAULTS["rope_theta"] if theta is None else theta)


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
  """Keyword arguments of `transformers.Qwen3MoeConfig` for the same architecture (the
  inverse of `config_from_hf`), to build a Hugging Face twin of an rljax model."""
  return dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
      num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
      num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_intermediate_size, intermediate_size=cfg.intermediate_size,
      mlp_only_layers=list(cfg.mlp_only_layers), decoder_sparse_step=cfg.decoder_sparse_step,
      norm_topk_prob=cfg.norm_topk_prob, max_position_embeddings=cfg.max_position_embeddings,
      rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
      tie_word_embeddings=cfg.tie_word_embeddings)


def config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """ModelConfig from a Hugging Face Qwen3MoeConfig dict (a config.json).

  Keys the dict leaves out take transformers' Qwen3MoeConfig defaults (note
  `norm_topk_prob` defaults to False there, and `rope_theta` to 10000). `overrides` are
  ModelConfig fields set on top (e.g. dtype, param_dtype, page_size, remat).
  """
  model_type = hf.get("model_type", "qwen3_moe")
  if model_type != "qwen3_moe":
    raise ValueError(f"expected a qwen3_moe config, got model_type {model_type!r}")
  if hf.get("use_sliding_window", False):
    raise ValueError("use_sliding_window=true is not supported: the model has full causal "
                     "attention only")
  if hf.get("attention_bias", False):
    raise ValueError("attention_bias=true is not supported: the model's q/k/v/o projections "
                     "have no bias")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"hidden_act {act!r} not supported: the model's MLPs use silu")
  missing = [k for k in _REQUIRED if hf.get(k) is None]
  # transformers 5 writes `num_local_experts` (attribute_map num_experts -> num_local_experts)
  num_experts = hf.get("num_experts", hf.get("num_local_experts"))
  if num_experts is None:
    missing.append("num_experts (or num_local_experts)")
  if missing:
    raise ValueError(f"HF config lacks required keys: {missing}")

  def get(name):
    value = hf.get(name)
    return _HF_DEFAULTS[name] if value is None else value

  head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
  fields = dict(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
      num_hidden_layers=int(hf["num_hidden_layers"]),
      num_attention_heads=int(hf["num_attention_heads"]),
      num_key_value_heads=int(hf["num_key_value_heads"]), head_dim=int(head_dim),
      num_experts=int(num_experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
      moe_intermediate_size=int(hf["moe_intermediate_size"]),
      intermediate_size=int(get("intermediate_size")),
      mlp_only_layers=tuple(int(i) for i in get("mlp_only_layers")),
      decoder_sparse_step=int(get("decoder_sparse_step")),
      norm_topk_prob=bool(get("norm_topk_prob")), rope_theta=_rope_theta(hf),
      rms_norm_eps=float(get("rms_norm_eps")),
      tie_word_embeddings=bool(get("tie_word_embeddings")),
      max_position_embeddings=int(get("max_position_embeddings")))
  fields.update(overrides)
  return ModelConfig.from_dict(fields)


class _Reader:
  """Key index over a checkpoint directory's safetensors files."""

  def __init__(self, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
      raise FileNotFoundError(f"no *.safetensors files in {path}")
    self.where: dict[str, str] = {}
    self.dtype: dict[str, str] = {}
    self.shape: dict[str, tuple[int, ...]] = {}
    self._handles = {}
    for fname in files:
      handle = safe_open(fname, framework="numpy")
      self._handles[fname] = handle
      for key in handle.keys():
        if key in self.where:
          raise ValueError(f"tensor {key!r} is in both {self.where[key]} and {fname}")
        s = handle.get_slice(key)
        self.where[key], self.dtype[key] = fname, s.get_dtype()
        self.shape[key] = tuple(s.get_shape())
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f).get("weight_map", {})
      listed, found = set(weight_map), set(self.where)
      if listed != found:
        raise ValueError(f"{index} does not match the safetensors files: listed but absent "
                         f"{sorted(listed - found)}, present but unlisted {sorted(found - listed)}")
    self._raw: dict[str, tuple[np.ndarray, dict]] = {}

  def read(self, key: str) -> np.ndarray:
    dt = self.dtype[key]
    if dt not in _RAW_DTYPES:
      return self._handles[self.where[key]].get_tensor(key)
    buf, header = self._raw_file(self.where[key])
    begin, end = header[key]["data_offsets"]
    return buf[begin:end].view(_RAW_DTYPES[dt]).reshape(self.shape[key])

  def _raw_file(self, fname: str):
    if fname not in self._raw:
      with open(fname, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
      self._raw[fname] = (np.memmap(fname, dtype=np.uint8, mode="r", offset=8 + n), header)
    return self._raw[fname]


@dataclasses.dataclass
class _Recipe:
  """One of our params: which HF tensors (with their HF shapes), how to combine them, and
  (`split`, the exact inverse, for export) how to take ours apart into them."""
  keys: list[str]
  shapes: list[tuple[int, ...]]
  build: Callable[[list[np.ndarray]], np.ndarray]
  split: Callable[[np.ndarray], list[np.ndarray]] | None = None


def _linear(key, out_dim, in_dim):  # torch Linear [out, in] <-> ours [in, out]
  return _Recipe([key], [(out_dim, in_dim)], lambda ts: ts[0].T, lambda x: [x.T])


def _vector(key, shape):  # kept as is (a vector, or the embedding table)
  shape = (shape,) if isinstance(shape, int) else shape
  return _Recipe([key], [shape], lambda ts: ts[0], lambda x: [x])


def _moe_recipes(cfg: ModelConfig, pre: str, keys: set[str]) -> dict[str, _Recipe]:
  d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  out = {"router": _linear(f"{pre}.mlp.gate.weight", e, d)}  # [E, D] -> [D, E]
  fused_gate_up, fused_down = f"{pre}.mlp.experts.gate_up_proj", f"{pre}.mlp.experts.down_proj"
  if fused_gate_up in keys or fused_down in keys:
    # [E, 2F, D]: rows [:F] are gate, [F:] up -> ours [D, E, F]
    out["gate"] = _Recipe([fused_gate_up], [(e, 2 * f, d)],
                          lambda ts: ts[0][:, :f].transpose(2, 0, 1))
    out["up"] = _Recipe([fused_gate_up], [(e, 2 * f, d)],
                        lambda ts: ts[0][:, f:].transpose(2, 0, 1))
    out["down"] = _Recipe([fused_down], [(e, d, f)], lambda ts: ts[0].transpose(0, 2, 1))
  else:
    def per_expert(proj, shape, perm):
      inverse = tuple(int(i) for i in np.argsort(perm))
      return _Recipe([f"{pre}.mlp.experts.{j}.{proj}_proj.weight" for j in range(e)], [shape] * e,
                     lambda ts: np.stack(ts).transpose(perm),
                     lambda x: list(x.transpose(inverse)))
    out["gate"] = per_expert("gate", (f, d), (2, 0, 1))  # [E, F, D] -> [D, E, F]
    out["up"] = per_expert("up", (f, d), (2, 0, 1))
    out["down"] = per_expert("down", (d, f), (0, 2, 1))  # [E, D, F] -> [E, F, D]
  return out


def _recipes(cfg: ModelConfig, keys: set[str]) -> dict[str, Any]:
  """The param tree with a _Recipe at each leaf."""
  d, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
  h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
  tree: dict[str, Any] = {"embed": {"embedding": _vector("model.embed_tokens.weight", (v, d))}}
  layers = {}
  for i in range(cfg.num_hidden_layers):
    pre = f"model.layers.{i}"
    layer = {
        "attn_norm": {"scale": _vector(f"{pre}.input_layernorm.weight", d)},
        "attn": {
            "q": _linear(f"{pre}.self_attn.q_proj.weight", h * hd, d),
            "k": _linear(f"{pre}.self_attn.k_proj.weight", kv * hd, d),
            "v": _linear(f"{pre}.self_attn.v_proj.weight", kv * hd, d),
            "o": _linear(f"{pre}.self_attn.o_proj.weight", d, h * hd),
            "q_norm": _vector(f"{pre}.self_attn.q_norm.weight", hd),
            "k_norm": _vector(f"{pre}.self_attn.k_norm.weight", hd),
        },
        "mlp_norm": {"scale": _vector(f"{pre}.post_attention_layernorm.weight", d)},
    }
    if cfg.is_moe_layer(i):
      layer["moe"] = _moe_recipes(cfg, pre, keys)
    else:
      ff = cfg.intermediate_size
      layer["mlp"] = {"gate": _linear(f"{pre}.mlp.gate_proj.weight", ff, d),
                      "up": _linear(f"{pre}.mlp.up_proj.weight", ff, d),
                      "down": _linear(f"{pre}.mlp.down_proj.weight", d, ff)}
    layers[layer_name(i)] = layer
  tree["layers"] = stack_layers(cfg, layers, _stack_recipes)
  tree["final_norm"] = {"scale": _vector("model.norm.weight", d)}
  if not cfg.tie_word_embeddings:
    tree["lm_head"] = {"kernel": _linear("lm_head.weight", v, d)}
  return tree


def _stack_recipes(entries: list[_Recipe]) -> _Recipe:
  """One recipe for a layer stack: every entry's tensors, each built, stacked in order."""
  counts = [len(r.keys) for r in entries]
  starts = np.cumsum([0, *counts])

  def build(ts):
    return np.stack([r.build(ts[a:b]) for r, a, b in zip(entries, starts[:-1], starts[1:])])

  def split(x):
    return [t for r, layer in zip(entries, x) for t in r.split(layer)]

  return _Recipe([k for r in entries for k in r.keys], [s for r in entries for s in r.shapes],
                 build, split)


def _is_recipe(x):
  return isinstance(x, _Recipe)


def load_hf_params(path: str, cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
  """Params for `cfg` from the safetensors files in `path`, as jnp arrays of `dtype`
  (default cfg.param_dtype). Raises ValueError listing every missing and every unexpected
  tensor, or every shape mismatch, before reading any tensor data."""
  dtype = jnp.dtype(dtype or cfg.param_dtype)
  reader = _Reader(path)
  keys = set(reader.where)
  recipes = _recipes(cfg, keys)
  leaves = jax.tree.leaves(recipes, is_leaf=_is_recipe)
  needed = {k: s for r in leaves for k, s in zip(r.keys, r.shapes)}
  tied_head = cfg.tie_word_embeddings and "lm_head.weight" in keys
  if tied_head:  # some tied checkpoints still store the head: accept it if it is the embedding
    needed["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)

  missing = sorted(set(needed) - keys)
  unexpected = sorted(keys - set(needed))
  if missing or unexpected:
    raise ValueError(
        f"checkpoint {path} does not match the model config:\n"
        f"  missing tensors ({len(missing)}): {missing}\n"
        f"  unexpected tensors ({len(unexpected)}): {unexpected}")
  bad = [f"{k}: checkpoint {reader.shape[k]}, expected {s}" for k, s in sorted(needed.items())
         if reader.shape[k] != tuple(s)]
  if bad:
    raise ValueError(f"checkpoint {path}: tensor shapes do not match the model config:\n  "
                     + "\n  ".join(bad))
  if tied_head and not np.array_equal(reader.read("lm_head.weight"),
                                      reader.read("model.embed_tokens.weight")):
    raise ValueError("tie_word_embeddings is set but lm_head.weight differs from "
                     "model.embed_tokens.weight")

  def load(recipe: _Recipe) -> jax.Array:
    x = recipe.build([reader.read(k) for k in recipe.keys])
    return jnp.asarray(np.asarray(x).astype(dtype))

  params = jax.tree.map(load, recipes, is_leaf=_is_recipe)
  specs = param_specs(cfg)
  is_spec = lambda s: isinstance(s, ParamSpec)  # noqa: E731
  if jax.tree.structure(params) != jax.tree.structure(specs, is_leaf=is_spec):
    raise AssertionError("importer built a param tree that differs from param_specs")  # a bug here
  for (path_, x), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(specs, is_leaf=is_spec)):
    if x.shape != spec.shape:
      raise AssertionError(f"{jax.tree_util.keystr(path_)}: built {x.shape}, spec {spec.shape}")
  return params


def load_hf_checkpoint(path: str, dtype: Any = "float32", **config_overrides):
  """(ModelConfig, params) from a Hugging Face Qwen3-MoE checkpoint directory.

  `dtype` is the dtype of the returned arrays. Because it takes the name `dtype`,
  ModelConfig's compute `dtype` field is overridden here as `compute_dtype=`; both the
  config's `param_dtype` and its compute `dtype` default to `dtype`. Other keyword
  arguments override ModelConfig fields (page_size, remat, ...).
  """
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  overrides = dict(config_overrides)
  overrides["dtype"] = overrides.pop("compute_dtype", str(jnp.dtype(dtype)))
  overrides.setdefault("param_dtype", str(jnp.dtype(dtype)))
  cfg = config_from_hf(hf, **overrides)
  return cfg, load_hf_params(path, cfg, dtype)
