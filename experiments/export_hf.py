"""Export trained weights as a Hugging Face checkpoint (safetensors, config.json, tokenizer).

  python experiments/export_hf.py --config=configs/arith_tiny.py \
      --params=<workdir>/final_params --out=/tmp/arith_hf
  python experiments/export_hf.py --config=configs/arith_tiny.py \
      --checkpoint=<root>/trainer/checkpoints --out=/tmp/arith_hf   # an async run's state

`--params`: a params checkpoint (the lockstep loop's `final_params`, an `sft_checkpoint`);
`--checkpoint`: the async trainer's train-state checkpoints (the latest step, or `--step`).
The weights are written as `--dtype` (default the config's `model.param_dtype`: the serving
params). The tokenizer: `--tokenizer_dir`'s files, else the config's (`tokenizer.kind="hf"`:
its directory, `init_from`'s when `tokenizer.path` is ""), else the char tokenizer in HF form.
`transformers.AutoModelForCausalLM.from_pretrained(out)` loads the result. Last line: one
JSON object.
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
from rljax.pipeline.run import MODEL_ONLY, build, hf_tokenizer_dir, make_tokenizer
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
  params_abstract = abstract_params(cfg, jnp.float32)
  if _PARAMS.value is not None:
    with Checkpointer(_PARAMS.value, keep_last=1) as ckpt:
      params = ckpt.restore({"params": params_abstract}, _STEP.value).state["params"]
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
