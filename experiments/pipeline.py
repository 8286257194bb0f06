"""Async GRPO: this process trains, N rollout-host processes sample.

  python experiments/pipeline.py --config=configs/arith_tiny.py --workdir=/tmp/pipe \
      [--root=file:///tmp/pipe/root] [--hosts=2] [--config.seed=1 ...]

The trainer and its hosts share only the storage root (file:// here; gs:// the same).
Hosts start once version 0 is published, with the same --config flags, and stop when the
trainer writes run/done. A trainer of several processes (rljax.distributed's flags): the
same command on each, with an explicit --root all reach and config.mesh spanning all their
devices; process 0 starts the hosts and prints the summary. Last line: one JSON object.
"""

import os
import sys
import tempfile

from absl import app, flags, logging
import jax
from ml_collections import config_flags
from tqdm import tqdm

from rljax import compile_cache, distributed, numerics
from rljax.pipeline import launch, layout
from rljax.pipeline.metrics import json_line

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arith_tiny.py", "experiment config",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (a fresh temp dir if unset)")
_ROOT = flags.DEFINE_string("root", None, "storage root URL (default file://<workdir>/root)")
_HOSTS = flags.DEFINE_integer("hosts", None, "rollout-host processes to start here "
                              "(default config.async_rl.hosts; 0 = they run elsewhere)")
_PROGRESS = flags.DEFINE_bool("progress", True, "tqdm progress bars on stderr")
_RESUME = flags.DEFINE_bool("resume", False, "continue from the trainer's latest checkpoint "
                            "in --workdir/--root (a restart after a crash or kill); without "
                            "it an earlier run's checkpoint there is an error")


def main(argv):
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  numerics.set_up_process(_CONFIG.value.numerics)  # before anything starts JAX's backend
  compile_cache.enable_from_flags()  # --compile_cache_dir
  distributed.initialize_from_flags()  # no-op unless --num_processes>1 / --distributed
  config, primary = _CONFIG.value, distributed.is_primary()
  if jax.process_count() > 1:
    if _ROOT.value is None:
      raise app.UsageError(f"{jax.process_count()} trainer processes need --root: a storage "
                           "root all of them reach (gs://BUCKET/runs/NAME)")
    try:
      distributed.check_mesh(config.mesh.to_dict())
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  workdir = os.path.abspath(_WORKDIR.value or tempfile.mkdtemp(prefix=f"rljax_{config.name}_"))
  os.makedirs(workdir, exist_ok=True)
  root = _ROOT.value or f"file://{os.path.join(workdir, 'root')}/"
  layout.probe_root_from_flags(root)
  n_hosts = config.async_rl.hosts if _HOSTS.value is None else _HOSTS.value
  bar = (lambda it, desc: tqdm(it, desc=desc, file=sys.stderr, mininterval=2.0)) \
      if _PROGRESS.value and primary else None
  summary = launch.run_with_hosts(config, workdir, root, n_hosts, progress=bar,
                                  resume=_RESUME.value)
  if primary:
    print(launch.summary_table(summary))
  print(json_line(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
