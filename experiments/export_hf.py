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

from absl import app, flags, logging
from ml_collections import config_flags

from rljax import numerics
from rljax.pipeline import export

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


def main(argv):
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore step at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if (_PARAMS.value is None) == (_CHECKPOINT.value is None):
    raise app.UsageError("give exactly one of --params and --checkpoint")
  config = _CONFIG.value
  numerics.set_up_process(config.numerics)
  try:
    if _PEFT.value:
      out = export.export_adapters(config, _OUT.value, _CHECKPOINT.value, step=_STEP.value,
                                   dtype=_DTYPE.value, base_model=_BASE_MODEL.value)
    else:
      out = export.export_model(config, _OUT.value, params_dir=_PARAMS.value,
                                checkpoint_dir=_CHECKPOINT.value, step=_STEP.value,
                                dtype=_DTYPE.value, tokenizer_dir=_TOKENIZER_DIR.value)
  except export.ExportError as e:
    raise app.UsageError(str(e)) from None
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
