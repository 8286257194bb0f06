"""Export LoRA adapters (rljax.model.lora) as a PEFT adapter of the Hugging Face model that
`rljax.model.hf_export` writes: `adapter_model.safetensors` + `adapter_config.json`, which
`peft.PeftModel.from_pretrained(base, dir)` loads onto that model.

PEFT stores one lora_A [r, in] and lora_B [out, r] per adapted torch module, whose weight
W_hf [out, in] becomes W_hf + scale * lora_B @ lora_A, scale = lora_alpha / r. Ours
adapts W = W_hf.T [in, out] by scale * A @ B with A [in, r], B [r, out], so per layer (and
expert) lora_A = A.T and lora_B = B.T: transposes only, and alpha / rank is PEFT's scale.

Where each target goes (layer i, expert e):

  attn.q/k/v/o     model.layers.i.self_attn.{q,k,v,o}_proj        target_modules
  moe.gate/up/down model.layers.i.mlp.experts.e.{gate,up,down}_proj target_modules
  moe.router       model.layers.i.mlp.gate                         target_modules
  mlp.gate/up/down model.layers.i.mlp.{gate,up,down}_proj          target_parameters

The experts use the hub's per-expert names, as `hf_export` writes the base. transformers 5
holds the experts fused (gate_up_proj [E, 2F, D], down_proj [E, D, F] as nn.Parameters),
and peft (0.21, pinned; peft/utils/transformers_weight_conversion.py) converts such an
adapter on load: the experts' A and B are stacked, the gate's and up's fused with A
concatenated and B block-diagonal at rank 2r and alpha 2 * alpha (the same scale), so the
fused delta is exactly the two deltas. That conversion refuses gate_proj without up_proj
(or the reverse), and loads gate/up without down_proj under the wrong key (PEFT warns of
missing keys and the experts stay unadapted). So any expert target exports all three
projections, those `lora.targets` lacks with zero factors: an exact zero delta.

The same conversion renames every `gate_proj` / `up_proj` / `down_proj` in target_modules
to the fused experts, so a dense layer's MLP (a Qwen3-MoE with `mlp_only_layers` or
`decoder_sparse_step` > 1) named there would be dropped on load. The dense MLP targets are
therefore `target_parameters` ("mlp.gate_proj.weight", ...: PEFT's ParamWrapper adapts the
nn.Linear's weight with the same lora_A / lora_B keys and the same delta); these names
match only the dense layers, whose MLP is the only `mlp.*_proj` with a `weight`. Loaders
that read target_modules with transformers 4's per-expert modules (no conversion) would
also match a dense layer's projections by the expert names; with all-MoE models (every
released Qwen3-MoE) the two readings agree.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import numpy as np
from safetensors.numpy import save_file

from rljax.model.config import ModelConfig
from rljax.model.lora import TARGETS, LoraConfig, adapter_specs
from rljax.model.params import ParamSpec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# PEFT's state-dict prefix: PeftModel.base_model (LoraModel) .model (the HF model)
PEFT_PREFIX = "base_model.model."
_PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
         "up": "up_proj", "down": "down_proj"}
_TARGET_OF = {bw: name for name, bw in TARGETS.items()}  # (block, weight) -> target name


def _flat(tree: Any, is_leaf=None) -> dict[str, Any]:
  """{"layers/moe/moe/gate/a": leaf, ...} of a nested dict tree."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {"/".join(str(k.key) for k in path): leaf for path, leaf in leaves}


def check_adapters(adapters: Mapping[str, Any], cfg: ModelConfig, lora: LoraConfig) -> None:
  """Raises ValueError unless `adapters` are `lora`'s adapters of `cfg` (the tree
  `init_adapters(cfg, lora)` makes, in any dtype): naming the adapted weight that is
  missing, unexpected (a target `lora.targets` lacks) or of the wrong shape."""
  if not isinstance(adapters, Mapping) or set(adapters) != {"layers"}:
    raise ValueError("adapters must be {'layers': {kind: {block: {weight: {'a', 'b'}}}}}, "
                     f"got keys {sorted(adapters) if isinstance(adapters, Mapping) else adapters}")
  want = _flat(adapter_specs(cfg, lora), is_leaf=lambda x: isinstance(x, ParamSpec))
  got = _flat(adapters)

  def target(path):  # "layers/moe/moe/gate/a" -> "moe.gate (moe layers)"
    parts = path.split("/")
    name = _TARGET_OF.get(tuple(parts[2:4]), ".".join(parts[2:4]))
    return f"{name} ({parts[1]} layers, factor {parts[-1].upper()})"

  extra = sorted(set(got) - set(want))
  if extra:
    raise ValueError(f"adapters hold {[target(p) for p in extra]}, which are not adapters "
                     f"of lora.targets {list(lora.targets)} in this model")
  missing = sorted(set(want) - set(got))
  if missing:
    raise ValueError(f"adapters lack {[target(p) for p in missing]} of lora.targets "
                     f"{list(lora.targets)}")
  for path, spec in want.items():
    shape = tuple(np.shape(got[path]))
    if shape != spec.shape:
      raise ValueError(f"adapter {target(path)} has shape {shape}; rank {lora.rank} in this "
                       f"model config expects {spec.shape}")


def peft_tensors(adapters: Mapping[str, Any], cfg: ModelConfig, lora: LoraConfig,
                 dtype: Any = None) -> dict[str, np.ndarray]:
  """{PEFT key: numpy array} of `adapters` (as `dtype`, default their own), in layer order:
  `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], ...
  `lora_B.weight` [out, r]."""
  check_adapters(adapters, cfg, lora)
  stacks = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), adapters["layers"])
  out: dict[str, np.ndarray] = {}

  def put(module: str, a: np.ndarray, b: np.ndarray):  # a [in, r], b [r, out]: ours
    for factor, t in (("lora_A", a.T), ("lora_B", b.T)):
      t = t if dtype is None else t.astype(dtype)
      out[f"{PEFT_PREFIX}{module}.{factor}.weight"] = np.ascontiguousarray(t)

  for i in range(cfg.num_hidden_layers):
    kind, j = cfg.layer_kind(i)
    pre = f"model.layers.{i}"
    blocks = stacks.get(kind, {})
    for weight, ab in blocks.get("attn", {}).items():
      put(f"{pre}.self_attn.{_PROJ[weight]}", ab["a"][j], ab["b"][j])
    for weight, ab in blocks.get("mlp", {}).items():
      put(f"{pre}.mlp.{_PROJ[weight]}", ab["a"][j], ab["b"][j])
    moe = blocks.get("moe", {})
    if "router" in moe:
      put(f"{pre}.mlp.gate", moe["router"]["a"][j], moe["router"]["b"][j])
    experts = {w: (ab["a"][j], ab["b"][j]) for w, ab in moe.items() if w != "router"}
    if not experts:
      continue
    e, d, f, r = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, lora.rank
    own = next(iter(experts.values()))[0].dtype
    for weight in ("gate", "up", "down"):
      if weight in experts:  # gate/up: a [D, E, r]; down: a [E, F, r]; b [E, r, out]
        a, b = experts[weight]
        a = a.transpose(1, 0, 2) if weight != "down" else a  # -> [E, in, r]
      else:  # not a target: zero factors, so PEFT's fused experts load (module docstring)
        a = np.zeros((e, f if weight == "down" else d, r), own)
        b = np.zeros((e, r, d if weight == "down" else f), own)
      for k in range(e):
        put(f"{pre}.mlp.experts.{k}.{_PROJ[weight]}", a[k], b[k])
  return out


def peft_config(adapters: Mapping[str, Any], cfg: ModelConfig, lora: LoraConfig,
                base_model_name_or_path: str = "") -> dict[str, Any]:
  """adapter_config.json of `adapters` (see the module docstring for the targets)."""
  check_adapters(adapters, cfg, lora)
  modules, parameters = set(), set()
  for blocks in adapters["layers"].values():
    modules |= {_PROJ[w] for w in blocks.get("attn", {})}
    parameters |= {f"mlp.{_PROJ[w]}.weight" for w in blocks.get("mlp", {})}
    moe = blocks.get("moe", {})
    if "router" in moe:
      modules.add("gate")
    if {"gate", "up", "down"} & set(moe):  # with zero factors for those not adapted
      modules |= {"gate_proj", "up_proj", "down_proj"}
  alpha = lora.alpha
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "r": lora.rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
      "target_modules": sorted(modules) or None,
      "target_parameters": sorted(parameters) or None,
      # the merge W + (alpha / r) A @ B: no dropout, bias, rsLoRA's alpha / sqrt(r) or
      # DoRA; PEFT's ParamWrapper (the fused experts, target_parameters) requires as much
      "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
      "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
      "modules_to_save": None, "inference_mode": True,
  }


def export_peft(adapters: Mapping[str, Any], cfg: ModelConfig, lora: LoraConfig, out_dir: str,
                *, base_model_name_or_path: str = "", dtype: Any = None) -> list[str]:
  """Writes `adapters` as a PEFT adapter into `out_dir` (created; it must not hold an
  adapter already). `base_model_name_or_path`: the base HF checkpoint it adapts (recorded
  in adapter_config.json, where `AutoPeftModelForCausalLM` looks for it). Returns the
  files written."""
  if os.path.exists(os.path.join(out_dir, ADAPTER_CONFIG)):
    raise FileExistsError(f"{out_dir} already holds an adapter ({ADAPTER_CONFIG})")
  tensors = peft_tensors(adapters, cfg, lora, dtype)
  config = peft_config(adapters, cfg, lora, base_model_name_or_path)
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:  # last: marks a whole export
    json.dump(config, f, indent=2)
  return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
