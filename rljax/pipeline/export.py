"""Trained weights out of rljax (what `experiments/export_hf.py` runs): a run's params, from
a params checkpoint (the lockstep loop's `final_params`, an `sft_checkpoint`) or the async
trainer's train-state checkpoints (config.lora: the adapters merged into the frozen base
saved beside them), as a Hugging Face checkpoint (`rljax.model.hf_export`); or a
config.lora run's adapters as a PEFT adapter (`rljax.model.lora_export`)."""

from __future__ import annotations

import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from rljax.checkpoint import Checkpointer
from rljax.model import abstract_params, count_params
from rljax.model.hf_export import export_hf
from rljax.model.lora_export import export_peft
from rljax.pipeline import adapter_stream
from rljax.pipeline.run import (MODEL_ONLY, Built, build, env_brings_tokenizer,
                                hf_tokenizer_dir, init_from_hf, make_tokenizer)
from rljax.rl import learner


class ExportError(ValueError):
  """What was asked cannot be exported (the entry point's usage error)."""


def trained_params(built: Built, *, params_dir: str | None = None,
                   checkpoint_dir: str | None = None, step: int | None = None) -> Any:
  """The f32 params of a params checkpoint (`params_dir`) or of a train-state checkpoint
  (`checkpoint_dir`; `built` needs the rl block: its optimizer's state is restored too):
  its latest step, or `step`. A config.lora run's train state: the adapters merged into
  its frozen base."""
  if (params_dir is None) == (checkpoint_dir is None):
    raise ExportError("give exactly one of --params and --checkpoint")
  params_abstract = abstract_params(built.cfg, jnp.float32)
  if params_dir is not None:
    with Checkpointer(params_dir, keep_last=1) as ckpt:
      return ckpt.restore({"params": params_abstract}, step).state["params"]
  if built.lora is not None:
    return adapter_stream.merged_from_checkpoint(built, checkpoint_dir, step)
  optimizer = built.rl_optimizer()
  target = learner.TrainState(params_abstract, jax.eval_shape(optimizer.init, params_abstract),
                              jax.ShapeDtypeStruct((), jnp.int32))
  with Checkpointer(checkpoint_dir, keep_last=1) as ckpt:
    return ckpt.restore({"state": target}, step).state["state"].params


def export_model(config: ml_collections.ConfigDict, out: str, *, params_dir: str | None = None,
                 checkpoint_dir: str | None = None, step: int | None = None,
                 dtype: Any = None, tokenizer_dir: str | None = None) -> dict:
  """The trained params (`trained_params`) as an HF checkpoint in `out`, as `dtype`
  (default config.model's param_dtype: the serving params), with the tokenizer's files:
  `tokenizer_dir`'s, else the config's (`tokenizer.kind="hf"`: its directory, init_from's
  when `tokenizer.path` is ""), else the char tokenizer in HF form. Returns what was
  written (out, files, dtype, params)."""
  # the env's own tokenizer is built with the env, which an export does not make
  own_tokenizer = "env" in config and env_brings_tokenizer(config)
  if own_tokenizer and tokenizer_dir is None:
    raise ExportError(f"config.env.name={config.env.name!r} brings its own tokenizer: "
                      "name its Hugging Face files with --tokenizer_dir")
  # the model; the rl block's optimizer for a train state (no env: no verifier processes)
  built = build(config, MODEL_ONLY + (("rl",) if checkpoint_dir else ()), devices=False)
  cfg = built.cfg
  params = trained_params(built, params_dir=params_dir, checkpoint_dir=checkpoint_dir,
                          step=step)
  dtype = dtype or cfg.param_dtype
  if own_tokenizer:
    return export_with_hf_tokenizer(params, cfg, out, dtype, tokenizer_dir)
  tokenizer = make_tokenizer(config)
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer_dir = tokenizer_dir or hf_tokenizer_dir(config)
    extra = {"eos_token_id": tokenizer.eos_id, "bos_token_id": tokenizer.bos_id,
             "pad_token_id": tokenizer.pad_id}
    if tokenizer_dir is None:  # the char tokenizer, in HF form
      tokenizer.to_hf(cfg.vocab_size).save_pretrained(tmp)
      tokenizer_dir = tmp
    files = export_hf(params, cfg, out, dtype=dtype, tokenizer_dir=tokenizer_dir,
                      config_extra=extra)
  return {"out": out, "files": files, "dtype": str(jnp.dtype(dtype)),
          "params": count_params(params)}


def export_with_hf_tokenizer(params: Any, cfg: Any, out: str, dtype: Any,
                             tokenizer_dir: str) -> dict:
  """export_model's checkpoint with `tokenizer_dir`'s files and special ids."""
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  tok = AutoTokenizer.from_pretrained(tokenizer_dir)
  extra = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
           "pad_token_id": tok.pad_token_id}
  files = export_hf(params, cfg, out, dtype=dtype, tokenizer_dir=tokenizer_dir,
                    config_extra=extra)
  return {"out": out, "files": files, "dtype": str(jnp.dtype(dtype)),
          "params": count_params(params)}


def peft_base_model(config: ml_collections.ConfigDict, base_model: str | None = None) -> str:
  """adapter_config.json's base_model_name_or_path: `base_model`, else init_from's
  directory where the frozen base is its weights (the run had no SFT warm start)."""
  if base_model is not None:
    return base_model
  sft = config.get("sft")
  hf_dir = init_from_hf(config)
  if hf_dir is None or (sft is not None and (sft.steps or sft.load)):
    raise ExportError("--peft: the run's frozen base is not an HF checkpoint (an SFT warm "
                      "start or a random init): export it with --params=<trainer dir>/"
                      "lora_base and name that directory with --base_model")
  return hf_dir


def export_adapters(config: ml_collections.ConfigDict, out: str, checkpoint_dir: str | None, *,
                    step: int | None = None, dtype: Any = None,
                    base_model: str | None = None) -> dict:
  """A config.lora trainer's adapters (its train-state checkpoint's latest step, or
  `step`) as a PEFT adapter in `out` (`dtype`: default their f32), naming `base_model`
  (`peft_base_model`). Returns what was written (out, files, base_model, dtype,
  adapter_params)."""
  built = None if checkpoint_dir is None else build(config, MODEL_ONLY + ("rl",),
                                                     devices=False)
  if built is None or built.lora is None:
    raise ExportError("--peft writes a config.lora run's adapters: give its config and "
                      "--checkpoint (the trainer's checkpoints)")
  base_model = peft_base_model(config, base_model)
  adapters = adapter_stream.adapters_from_checkpoint(built, checkpoint_dir, step)
  files = export_peft(adapters, built.cfg, built.lora, out, dtype=dtype,
                      base_model_name_or_path=base_model)
  return {"out": out, "files": files, "base_model": base_model,
          "dtype": str(jnp.dtype(dtype or jnp.float32)),
          "adapter_params": count_params(adapters)}
