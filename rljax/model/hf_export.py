"""Export params as a Hugging Face Qwen3-MoE checkpoint: safetensors, config.json, tokenizer.

The exact inverse of `rljax.model.hf_import` (its recipes' `split`): transposes and
per-expert slices only, so `load_hf_params(export_hf(params))` returns the same bits. The
tensors use the hub layout (one tensor per expert and projection), which transformers
loads into its fused in-memory experts. Files are sharded at `max_shard_bytes` (5 GB, as
`save_pretrained`): one file is `model.safetensors`; several are
`model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json` weight map.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import jax
import numpy as np
from safetensors.numpy import save_file

from rljax.model.config import ModelConfig
from rljax.model.hf_import import _is_recipe, _recipes, hf_config_kwargs

SHARD_BYTES = 5 * 10**9
# what a tokenizer directory holds that a checkpoint directory should carry along
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


def hf_tensors(params: Mapping[str, Any], cfg: ModelConfig, dtype: Any = None) -> dict:
  """{HF tensor name: numpy array} for `params` (as `dtype`, default their own dtype)."""
  recipes = _recipes(cfg, set())  # no fused keys: the hub layout
  leaves = jax.tree.leaves(recipes, is_leaf=_is_recipe)
  if jax.tree.structure(params) != jax.tree.structure(
      jax.tree.map(lambda _: 0, recipes, is_leaf=_is_recipe)):
    raise ValueError("params do not have the structure of this model config's params")
  arrays = jax.tree.leaves(params)
  out = {}
  for recipe, x in zip(leaves, arrays):
    x = np.asarray(jax.device_get(x))
    if dtype is not None:
      x = x.astype(dtype)
    for key, shape, t in zip(recipe.keys, recipe.shapes, recipe.split(x)):
      if t.shape != tuple(shape):
        raise ValueError(f"{key}: param gives shape {t.shape}, the config expects {shape}")
      out[key] = np.ascontiguousarray(t)
  return out


def hf_config(cfg: ModelConfig, dtype: str, **extra) -> dict[str, Any]:
  """config.json of the model (`extra`: e.g. bos/eos/pad token ids)."""
  out = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
         "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
         "dtype": dtype, **hf_config_kwargs(cfg)}
  out.update(extra)
  return out


def export_hf(params: Mapping[str, Any], cfg: ModelConfig, out_dir: str, *, dtype: Any = None,
              tokenizer_dir: str | None = None, max_shard_bytes: int = SHARD_BYTES,
              config_extra: Mapping[str, Any] | None = None) -> list[str]:
  """Writes `params` as an HF checkpoint into `out_dir` (created; it must not hold a
  checkpoint already). `tokenizer_dir`: a tokenizer directory whose files are copied.
  Returns the files written."""
  if os.path.exists(os.path.join(out_dir, "config.json")):
    raise FileExistsError(f"{out_dir} already holds a checkpoint (config.json)")
  tensors = hf_tensors(params, cfg, dtype)
  dtypes = {str(t.dtype) for t in tensors.values()}
  if len(dtypes) != 1:
    raise ValueError(f"params have several dtypes {sorted(dtypes)}: pass dtype=")
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for key, t in tensors.items():  # in param order, a shard closes when the next tensor overflows
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][key] = t
    size += t.nbytes
  os.makedirs(out_dir, exist_ok=True)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  written = []
  for name, shard in zip(names, shards):
    save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
    written.append(name)
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
    written.append("model.safetensors.index.json")
  if tokenizer_dir is not None:
    found = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(tokenizer_dir, n))]
    if "tokenizer.json" not in found and "vocab.json" not in found:
      raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir} "
                              "(expected tokenizer.json or vocab.json)")
    for n in found:
      shutil.copyfile(os.path.join(tokenizer_dir, n), os.path.join(out_dir, n))
    written += found
  with open(os.path.join(out_dir, "config.json"), "w") as f:  # last: marks a whole export
    json.dump(hf_config(cfg, dtypes.pop(), **dict(config_extra or {})), f, indent=2)
  return written + ["config.json"]
