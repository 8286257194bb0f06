"""Serves a config's policy through the OpenAI-compatible endpoint (rljax/serving/)
on this machine, recording every call as a token-space Trajectory:

  .venv/bin/python experiments/serve.py --config=configs/qwen3_30b_a3b.py:tiny \\
      --config.init_from=hf:DIR --port=8000 --groups_dir=/tmp/groups --group_size=4

The weights are `config.init_from`'s (`hf:DIR`; a trained run: `export_hf.py` first), else
a random init from `config.seed`; the engine is `config.engine`'s, the sampling
`config.rl`'s (temperature, top_p, max_new_tokens as the default max_tokens). A harness
registers episodes (`POST /v1/episodes {"episode_id", "group_id"}`), drives them with any
OpenAI client (`base_url=http://127.0.0.1:8000/episodes/<id>/v1`, or
`extra_body={"episode_id": ...}`) and closes each with `POST /v1/episodes/<id>/finish
{"reward": r}`. With --groups_dir every complete group (--group_size finished episodes)
is written there as `group_<n>.npz` (`pipeline/npz.py`: the header names the group and
its episodes, the arrays are `pipeline/wire.py`'s), what a trainer reads like any other
group; registering more than --group_size episodes in a group is a 409 `group_full`.
Requests' `tools` are rendered by the checkpoint's chat template and the model's calls
returned as `message.tool_calls`, read by --tool_parser. Binds 127.0.0.1 unless --host
says otherwise (there is no authentication).
Prints one JSON object when it stops (--max_seconds, or Ctrl-C).
"""

import json
import time

from absl import app, flags
from ml_collections import config_flags

from rljax import compile_cache, numerics
from rljax.pipeline.core import initial_params
from rljax.pipeline.run import build
from rljax.serving import Endpoint
from rljax.serving.group_files import write_groups

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arith_tiny.py", "experiment config",
                                          lock_config=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to bind")
_PORT = flags.DEFINE_integer("port", 8000, "port (0: any free one, printed)")
_SEED = flags.DEFINE_integer("seed", None, "sampling key seed (default config.seed)")
_GROUPS_DIR = flags.DEFINE_string("groups_dir", "", "write complete groups here as .npz")
_GROUP_SIZE = flags.DEFINE_integer("group_size", None, "episodes a group (default "
                                   "config.rl.group_size)")
_MAX_SECONDS = flags.DEFINE_float("max_seconds", None, "stop after this long")
_TOOL_PARSER = flags.DEFINE_string("tool_parser", "hermes", "how the model's tool calls are read "
                                   "from its text: hermes (Qwen3's <tool_call>{json}</tool_call>), "
                                   "none, or package.module:function")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  numerics.set_up_process(config.numerics)  # before anything starts JAX's backend
  compile_cache.enable_from_flags()
  built = build(config, ("model", "env", "engine", "rl"))
  engine = built.make_engine(initial_params(built, built.cfg.param_dtype),
                             sharding=built.engine_sharding())
  seed = config.seed if _SEED.value is None else _SEED.value
  t0 = time.monotonic()
  with Endpoint(engine, built.env.tokenizer, sampling=built.sampling, seed=seed,
                model_name=config.name, host=_HOST.value, port=_PORT.value,
                group_size=_GROUP_SIZE.value or config.rl.group_size,
                tool_parser=_TOOL_PARSER.value) as endpoint:
    print(json.dumps({"url": endpoint.url, "model": config.name}), flush=True)
    written = write_groups(endpoint, _GROUPS_DIR.value, _MAX_SECONDS.value)
    stats = dict(endpoint.stats)
  print(json.dumps({"groups_written": written, "wall_s": round(time.monotonic() - t0, 1),
                    **stats}), flush=True)


if __name__ == "__main__":
  app.run(main)
