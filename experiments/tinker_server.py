"""A Tinker-compatible training service on rljax (the `tinker` SDK 0.38's HTTP API):

  python experiments/tinker_server.py --config=configs/tiny_moe.py --port=8000
  python experiments/tinker_server.py --config=configs/qwen3_30b_a3b.py \
      --config.init_from=hf:/path/to/Qwen3-30B-A3B --model_name=Qwen/Qwen3-30B-A3B

then, unchanged SDK code: `tinker.ServiceClient(base_url="http://HOST:8000")` (any API key
starting with "tml-"), `create_lora_training_client(base_model=MODEL_NAME, rank=...)`,
`forward_backward` (cross_entropy, importance_sampling, ppo), `forward`, `optim_step`,
sampling clients (`sample`, `compute_logprobs`; stop token ids and, with a tokenizer,
stop strings), `save_state` / `load_state` (orbax, under
--state_dir), `save_weights_external` and its download (`get_external_weights_urls`,
`tinker_cookbook.weights.download`: a PEFT adapter, served from --state_dir).
"""

import os
import tempfile

from absl import app, flags, logging
from ml_collections import config_flags

from rljax import numerics
from rljax.envs.tokenizer import TransformersTokenizer
from rljax.pipeline import core
from rljax.pipeline.config_error import init_from_hf
from rljax.pipeline.run import MODEL_ONLY, build
from rljax.tinker.service import Service
from rljax.tinker.server import make_server

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_moe.py",
                                          "config with `model` (and `init_from`)",
                                          lock_config=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
_PORT = flags.DEFINE_integer("port", 8000, "port (0: any free one, printed)")
_MODEL_NAME = flags.DEFINE_string("model_name", None, "the base_model name clients ask "
                                  "for (default: the checkpoint directory, else "
                                  "config.name, else rljax/base)")
_STATE_DIR = flags.DEFINE_string("state_dir", None, "the local directory save_state writes to "
                                 "(default: a new temporary directory)")
_TOKENIZER_DIR = flags.DEFINE_string("tokenizer_dir", None, "a transformers tokenizer "
                                     "directory: EOS stops sampling, stop strings match "
                                     "its text (default: the hf: checkpoint's directory)")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 0, "longest datum in tokens (0: the "
                                   "model's max_position_embeddings)")


def main(argv):
  del argv
  config = _CONFIG.value
  numerics.set_up_process(config.numerics)
  built = build(config, MODEL_ONLY)
  base = core.initial_params(built, built.cfg.weight_dtype)
  hf_dir = init_from_hf(config)
  name = _MODEL_NAME.value or (os.path.abspath(hf_dir) if hf_dir
                               else config.get("name") or "rljax/base")
  tokenizer_dir = _TOKENIZER_DIR.value or hf_dir
  service = Service(built.cfg, base, numerics=built.numerics, model_name=name,
                    max_tokens=_MAX_TOKENS.value or built.cfg.max_position_embeddings,
                    state_root=_STATE_DIR.value or tempfile.mkdtemp(prefix="rljax-tinker-"),
                    tokenizer_id=os.path.abspath(tokenizer_dir) if tokenizer_dir else None,
                    tokenizer=TransformersTokenizer.from_dir(tokenizer_dir)
                    if tokenizer_dir else None)
  server = make_server(service, _HOST.value, _PORT.value)
  host, port = server.server_address[:2]
  logging.info("Tinker service for %r on http://%s:%d", name, host, port)
  print(f"serving {name!r} at http://{host}:{port}", flush=True)
  server.serve_forever()


if __name__ == "__main__":
  app.run(main)
