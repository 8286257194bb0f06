"""Export trained weights as a Hugging Face checkpoint (safetensors, config.json, tokenizer).

  python experiments/export_hf.py --config=configs/arith_tiny.py \
      --params=<workdir>/final_params --out=/tmp/arith_hf
  python experiments/export_hf.py --config=configs/arith_tiny.py \
      --checkpoint=<root>/trainer/checkpoints --out=/tmp/arith_hf   # an async run's state

`--params`: a params checkpoint (the lockstep loop's `final_params`, an `sft_checkpoint`);
`--checkpoint`: the async trainer's train-state checkpoints (the latest step, or `--step`;
with config.lora, the adapters merged into the frozen base saved beside them).
The weights are written as `--dtype` (default the config's `model.param_dtype`: the serving
params). The tokenizer: `--tokenizer_dir`'s files, else the config's (`tokenizer.kind="hf"`:
its directory, `init_from`'s when `tokenizer.path` is ""), else the char tokenizer in HF form.
`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result. Last line: one
JSON object.

`--peft` (config.lora, `--checkpoint`): the checkpoint's adapters as a PEFT adapter
instead (adapter_model.safetensors + adapter_config.json, rljax.model.lora_export) for
`peft.PeftModel.from_pretrained(base, out)`, `--dtype` default their f32. The base is the
run's frozen one: `init_from`'s checkpoint when no SFT warm start changed it (recorded as
base_model_name_or_path), else `--params=<trainer dir>/lora_base` exported as above and
named by `--base_model`.

  python experiments/export_hf.py --config=configs/arith_tiny_lora.py --peft \
      --checkpoint=<root>/trainer/checkpoints --base_model=/tmp/arith_base_hf --out=/tmp/lora
"""

import json
import tempfile

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from rljax import numerics
from rljax.checkpoint import Checkpointer
from rljax.model import abstract_params, count_params
from rljax.model.hf_export import export_hf
from rljax.model.lora_export import export_peft
from rljax.pipeline import adapter_stream
from rljax.pipeline.run import MODEL_ONLY, build, hf_tokenizer_dir, init_from_hf, make_tokenizer
from rljax.rl import learner

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arith_tiny.py",
                                          "the run's config", lock_config=True)
_PARAMS = flags.DEFINE_string("params", None, "a params checkpoint directory")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a train-state checkpoint directory")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
_OUT = flags.DEFINE_string("out", None, "output directory (must not hold a checkpoint)",
                           required=True)
_DTYPE = flags.DEFINE_string("dtype", None, "dtype of the exported weights")
_TOKENIZER_DIR = flags.DEFINE_string("tokenizer_dir", None, "tokenizer files to copy")
_PEFT = flags.DEFINE_bool("peft", False, "config.lora with --checkpoint: write the adapters "
                          "as a PEFT adapter instead of the merged weights")
_BASE_MODEL = flags.DEFINE_string("base_model", None, "--peft: the base HF checkpoint named in "
                                  "adapter_config.json (default: init_from's, if no SFT)")


def _base_model(config) -> str:
  """adapter_config.json's base_model_name_or_path: --base_model, else init_from's
  directory where the frozen base is its weights (the run had no SFT warm start)."""
  if _BASE_MODEL.value is not None:
    return _BASE_MODEL.value
  sft = config.get("sft")
  hf_dir = init_from_hf(config)
  if hf_dir is None or (sft is not None and (sft.steps or sft.load)):
    raise app.UsageError("--peft: the run's frozen base is not an HF checkpoint (an SFT warm "
                         "start or a random init): export it with --params=<trainer dir>/"
                         "lora_base and name that directory with --base_model")
  return hf_dir


def main(argv):
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore step at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if (_PARAMS.value is None) == (_CHECKPOINT.value is None):
    raise app.UsageError("give exactly one of --params and --checkpoint")
  config = _CONFIG.value
  numerics.set_up_process(config.numerics)
  # the model; the rl block's optimizer for a train state (no env: no verifier processes)
  built = build(config, MODEL_ONLY + (("rl",) if _CHECKPOINT.value else ()), devices=False)
  cfg = built.cfg
  if _PEFT.value:
    if built.lora is None or _CHECKPOINT.value is None:
      raise app.UsageError("--peft writes a config.lora run's adapters: give its config and "
                           "--checkpoint (the trainer's checkpoints)")
    base_model = _base_model(config)
    adapters = adapter_stream.adapters_from_checkpoint(built, _CHECKPOINT.value, _STEP.value)
    files = export_peft(adapters, cfg, built.lora, _OUT.value, dtype=_DTYPE.value,
                        base_model_name_or_path=base_model)
    print(json.dumps({"out": _OUT.value, "files": files, "base_model": base_model,
                      "dtype": str(jnp.dtype(_DTYPE.value or jnp.float32)),
                      "adapter_params": count_params(adapters)}))
    return
  params_abstract = abstract_params(cfg, jnp.float32)
  if _PARAMS.value is not None:
    with Checkpointer(_PARAMS.value, keep_last=1) as ckpt:
      params = ckpt.restore({"params": params_abstract}, _STEP.value).state["params"]
  elif built.lora is not None:  # an async LoRA run's adapters, merged into its base
    params = adapter_stream.merged_from_checkpoint(built, _CHECKPOINT.value, _STEP.value)
  else:
    optimizer = built.rl_optimizer()
    target = learner.TrainState(params_abstract, jax.eval_shape(optimizer.init, params_abstract),
                                jax.ShapeDtypeStruct((), jnp.int32))
    with Checkpointer(_CHECKPOINT.value, keep_last=1) as ckpt:
      params = ckpt.restore({"state": target}, _STEP.value).state["state"].params
  dtype = _DTYPE.value or cfg.param_dtype
  tokenizer = make_tokenizer(config)
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer_dir = _TOKENIZER_DIR.value or hf_tokenizer_dir(config)
    extra = {"eos_token_id": tokenizer.eos_id, "bos_token_id": tokenizer.bos_id,
             "pad_token_id": tokenizer.pad_id}
    if tokenizer_dir is None:  # the char tokenizer, in HF form
      tokenizer.to_hf(cfg.vocab_size).save_pretrained(tmp)
      tokenizer_dir = tmp
    files = export_hf(params, cfg, _OUT.value, dtype=dtype, tokenizer_dir=tokenizer_dir,
                      config_extra=extra)
  print(json.dumps({"out": _OUT.value, "files": files, "dtype": str(jnp.dtype(dtype)),
                    "params": count_params(params)}))


if __name__ == "__main__":
  app.run(main)
