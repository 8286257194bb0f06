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


ADAPTER_FILES = ("adapter_model.safetensors",)  # PEFT adapters, not model weights


def checkpoint_files(path: str) -> list[str]:
  """The model's safetensors files: those `model.safetensors.index.json` lists, else
  `model.safetensors`, else every `*.safetensors`. Raises naming a listed file that is
  missing or a PEFT adapter file beside the weights."""
  adapters = [n for n in ADAPTER_FILES if os.path.exists(os.path.join(path, n))]
  if adapters:
    raise ValueError(f"{os.path.join(path, adapters[0])} is a PEFT adapter, not model weights: "
                     "merge it into the base checkpoint, or move it out of the directory")
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index} has no weight_map")
    files = [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
    for fname in files:
      if not os.path.exists(fname):
        raise FileNotFoundError(f"{fname} is listed in {index} but missing")
    return files
  single = os.path.join(path, "model.safetensors")
  files = ([single] if os.path.exists(single)
           else sorted(glob.glob(os.path.join(path, "*.safetensors"))))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  return files


class _Reader:
  """Key index over a checkpoint directory's safetensors files; reads slices of tensors
  (only the bytes of the slice, for memory-mapped raw dtypes only the pages it touches)."""

  def __init__(self, path: str):
    self.where: dict[str, str] = {}
    self.dtype: dict[str, str] = {}
    self.shape: dict[str, tuple[int, ...]] = {}
    self._handles = {}
    for fname in checkpoint_files(path):
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
        weight_map = json.load(f)["weight_map"]
      wrong = sorted(k for k in set(weight_map) | set(self.where)
                     if weight_map.get(k) != os.path.basename(self.where.get(k, "")))
      if wrong:
        raise ValueError(f"{index} does not match its files: {len(wrong)} tensors listed "
                         f"elsewhere or absent, e.g. {wrong[0]!r}")
    self._raw: dict[str, tuple[np.ndarray, dict]] = {}

  def read(self, key: str, index: tuple = ()) -> np.ndarray:
    """Tensor `key`, or its slice `index`."""
    dt = self.dtype[key]
    if dt not in _RAW_DTYPES:
      return self._handles[self.where[key]].get_slice(key)[index or (slice(None),)]
    buf, header = self._raw_file(self.where[key])
    begin, end = header[key]["data_offsets"]
    return np.array(buf[begin:end].view(_RAW_DTYPES[dt]).reshape(self.shape[key])[index])

  def _raw_file(self, fname: str):
    if fname not in self._raw:
      with open(fname, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
      self._raw[fname] = (np.memmap(fname, dtype=np.uint8, mode="r", offset=8 + n), header)
    return self._raw[fname]


Index = tuple[slice, ...]
Fetch = Callable[[str, tuple], np.ndarray]  # (HF tensor name, its index) -> that slice


def _sub(s: slice, n: int, offset: int = 0) -> slice:
  """slice `s` of an axis of length n, as a concrete slice shifted by `offset`."""
  r = range(n)[s]
  return slice(r.start + offset, r.stop + offset, r.step)


@dataclasses.dataclass
class _Recipe:
  """One of our params: which HF tensors (with their HF shapes); `read(fetch, index)`, the
  slice `index` of our param, fetching only the HF tensor slices it needs; and `split`,
  the exact inverse, for export: our param taken apart into the HF tensors."""
  keys: list[str]
  shapes: list[tuple[int, ...]]
  read: Callable[[Fetch, Index], np.ndarray]
  split: Callable[[np.ndarray], list[np.ndarray]] | None = None


def _linear(key, out_dim, in_dim):  # torch Linear [out, in] <-> ours [in, out]
  return _Recipe([key], [(out_dim, in_dim)], lambda fetch, i: fetch(key, (i[1], i[0])).T,
                 lambda x: [x.T])


def _vector(key, shape):  # kept as is (a vector, or the embedding table)
  shape = (shape,) if isinstance(shape, int) else shape
  return _Recipe([key], [shape], lambda fetch, i: fetch(key, i), lambda x: [x])


def _moe_recipes(cfg: ModelConfig, pre: str, keys: set[str]) -> dict[str, _Recipe]:
  d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  out = {"router": _linear(f"{pre}.mlp.gate.weight", e, d)}  # [E, D] -> [D, E]
  fused_gate_up, fused_down = f"{pre}.mlp.experts.gate_up_proj", f"{pre}.mlp.experts.down_proj"
  if fused_gate_up in keys or fused_down in keys:
    # [E, 2F, D]: rows [:F] are gate, [F:] up -> ours [D, E, F]
    def gate_up(offset):
      return _Recipe([fused_gate_up], [(e, 2 * f, d)], lambda fetch, i: fetch(
          fused_gate_up, (i[1], _sub(i[2], f, offset), i[0])).transpose(2, 0, 1))
    out["gate"], out["up"] = gate_up(0), gate_up(f)
    out["down"] = _Recipe([fused_down], [(e, d, f)], lambda fetch, i: fetch(
        fused_down, (i[0], i[2], i[1])).transpose(0, 2, 1))
  else:
    def per_expert(proj, shape, perm):
      # ours = stack(HF tensors over experts).transpose(perm): our axis a is the stack's
      # axis perm[a]; the stack's axis 0 is the expert
      names = [f"{pre}.mlp.experts.{j}.{proj}_proj.weight" for j in range(e)]
      inverse = tuple(int(i) for i in np.argsort(perm))

      def read(fetch, i):
        stacked = [None] * len(perm)
        for a, p in enumerate(perm):
          stacked[p] = i[a]
        return np.stack([fetch(names[j], tuple(stacked[1:])) for j in range(e)[stacked[0]]]
                        ).transpose(perm)

      return _Recipe(names, [shape] * e, read, lambda x: list(x.transpose(inverse)))
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
  """One recipe for a layer stack [L, ...]: entry l is layer l's recipe."""
  def read(fetch, i):
    return np.stack([entries[l].read(fetch, i[1:]) for l in range(len(entries))[i[0]]])

  def split(x):
    return [t for r, layer in zip(entries, x) for t in r.split(layer)]

  return _Recipe([k for r in entries for k in r.keys], [s for r in entries for s in r.shapes],
                 read, split)


def _is_recipe(x):
  return isinstance(x, _Recipe)


def _devices_by_index(sharding, shape) -> list[tuple[Index, list]]:
  """This process's devices grouped by the slice of a `shape` array each holds."""
  groups: dict[tuple, tuple[Index, list]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    bounds = tuple(s.indices(n) for s, n in zip(index, shape))
    groups.setdefault(bounds, (tuple(slice(*b) for b in bounds), []))[1].append(device)
  return list(groups.values())


def load_hf_params(path: str, cfg: ModelConfig, dtype: Any = None,
                   shardings: Any = None) -> dict[str, Any]:
  """Params for `cfg` from the checkpoint in `path` (`checkpoint_files`), as arrays of
  `dtype` (default cfg.param_dtype).

  `shardings` (a tree of `jax.sharding.Sharding` like the params, e.g. `param_shardings`):
  each device's shard is read straight from the files (only its slice of each tensor) and
  placed, one distinct shard at a time; a process reads only what its own devices hold,
  and no param is ever whole in host memory. Without it, whole arrays
  on the default device. Raises ValueError on missing, unexpected or misshapen tensors,
  before reading any tensor data.
  """
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
  bad = [(k, s) for k, s in sorted(needed.items()) if reader.shape[k] != tuple(s)]
  if bad:
    k, s = bad[0]
    raise ValueError(f"{len(bad)} tensors of {path} do not have the model config's shapes, "
                     f"e.g. {k} in {os.path.basename(reader.where[k])}: {reader.shape[k]}, the "
                     f"config (hidden_size {cfg.hidden_size}, heads {cfg.num_attention_heads}x"
                     f"{cfg.head_dim}, kv heads {cfg.num_key_value_heads}, experts "
                     f"{cfg.num_experts}x{cfg.moe_intermediate_size}, vocab {cfg.vocab_size}) "
                     f"expects {tuple(s)}")
  if tied_head and not np.array_equal(reader.read("lm_head.weight"),
                                      reader.read("model.embed_tokens.weight")):
    raise ValueError("tie_word_embeddings is set but lm_head.weight differs from "
                     "model.embed_tokens.weight")

  specs = param_specs(cfg)
  is_spec = lambda s: isinstance(s, ParamSpec)  # noqa: E731
  if jax.tree.structure(recipes, is_leaf=_is_recipe) != jax.tree.structure(specs, is_leaf=is_spec):
    raise AssertionError("importer built a param tree that differs from param_specs")  # a bug here

  def read(recipe: _Recipe, spec: ParamSpec, index: Index) -> np.ndarray:
    x = recipe.read(reader.read, index).astype(dtype)
    want = tuple(len(range(n)[i]) for n, i in zip(spec.shape, index))
    if x.shape != want:
      raise AssertionError(f"built {x.shape} for {index} of {spec.shape}")  # a bug here
    return x

  def load(recipe: _Recipe, spec: ParamSpec, sharding=None) -> jax.Array:
    if sharding is None:
      return jnp.asarray(read(recipe, spec, (slice(None),) * len(spec.shape)))
    # as jax.make_array_from_callback, but one distinct shard in host memory at a time
    # (that function holds every device's array of the param before placing any) and
    # each distinct shard read once, whatever the replication
    placed = {}
    for index, devices in _devices_by_index(sharding, spec.shape):
      x = read(recipe, spec, index)
      placed.update({d: jax.device_put(x, d) for d in devices})
      del x
    return jax.make_array_from_single_device_arrays(spec.shape, sharding,
                                                    list(placed.values()))

  if shardings is None:
    return jax.tree.map(load, recipes, specs, is_leaf=_is_recipe)
  return jax.tree.map(load, recipes, specs, shardings, is_leaf=_is_recipe)


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
