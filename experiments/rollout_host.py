"""One rollout host of the async pipeline: follows the weight stream under --root, serves
the prompt groups the trainer leases it, pushes the finished groups back, and exits 0 when
the trainer writes `run/done` (see rljax/pipeline/host.py for the protocol).

  python experiments/rollout_host.py --root=file:///shared/run1 \
      --config=configs/arith_tiny.py --host_id=host-0

The last line printed is one JSON object: the host's final status record plus "exit"
("done" or "max_seconds").
"""

import json

from absl import app, flags, logging
from ml_collections import config_flags

from rljax import compile_cache, numerics
from rljax.pipeline import layout
from rljax.pipeline.host import RolloutHost, RunOver

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arith_tiny.py", "experiment config",
                                          lock_config=True)
_ROOT = flags.DEFINE_string("root", None, "storage root shared with the trainer "
                            "(file:///abs/dir, gs://bucket/prefix)", required=True)
_HOST_ID = flags.DEFINE_string("host_id", None, "this host's id (letters, digits, _ . -); "
                               "one live process per id", required=True)
_MAX_SECONDS = flags.DEFINE_float("max_seconds", None, "stop after this long even if the run "
                                  "is not over (default: run until run/done)")
_FIRST_VERSION_TIMEOUT_S = flags.DEFINE_float("first_version_timeout_s", 600.0,
                                              "give up if no weights appear in this long")


def main(argv):
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _ROOT.value.startswith("memory://"):
    raise app.UsageError("a memory:// root is private to one process; use file:// or gs://")
  layout.probe_root_from_flags(_ROOT.value)
  numerics.set_up_process(_CONFIG.value.numerics)  # before anything starts JAX's backend
  compile_cache.enable_from_flags()  # --compile_cache_dir
  try:
    host = RolloutHost(_ROOT.value, _CONFIG.value, _HOST_ID.value,
                       first_version_timeout_s=_FIRST_VERSION_TIMEOUT_S.value)
  except RunOver as e:
    logging.warning("%s", e)
    print(json.dumps({"host_id": _HOST_ID.value, "exit": "done"}), flush=True)
    return
  logging.info("host %s serving %s from version %d", host.host_id, _ROOT.value,
               host.engine.version)
  reason = host.run(max_seconds=_MAX_SECONDS.value)
  print(json.dumps(host.status() | {"exit": reason}), flush=True)


if __name__ == "__main__":
  app.run(main)
