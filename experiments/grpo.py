"""Lockstep GRPO: SFT warm start -> GRPO with the in-process DecodeEngine -> held-out eval.

  python experiments/grpo.py --config=configs/arith_tiny.py --workdir=/tmp/arith \
      --config.seed=1 --config.rl.group_size=16

Writes <workdir>/metrics.jsonl, TensorBoard events (<workdir>/tb), reward_curve.png, the
SFT checkpoint and a checkpoint every config.rl.checkpoint_every steps (--resume: a
killed run goes on from the latest, same command). The last line printed is one JSON
object: held-out pass@1 before (after SFT) and after GRPO, pass@k, steps, wall_s,
mismatch_max_abs.

Several processes (rljax.distributed flags, `config.mesh` over all their devices): the
same command on each, with one --workdir all of them reach.
"""

import sys
import tempfile

from absl import app, flags, logging
import jax
from ml_collections import config_flags
from tqdm import tqdm

from rljax import compile_cache, distributed, numerics
from rljax.pipeline.lockstep import run_experiment
from rljax.pipeline.metrics import json_line

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arith_tiny.py", "experiment config",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (a fresh temp dir if unset)")
_RESUME = flags.DEFINE_bool("resume", False, "continue the run in --workdir from its latest "
                             "checkpoint (without it, a workdir holding one is refused)")
_PROGRESS = flags.DEFINE_bool("progress", True, "tqdm progress bars on stderr")


def main(argv):
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  numerics.set_up_process(_CONFIG.value.numerics)  # before anything starts JAX's backend
  compile_cache.enable_from_flags()  # --compile_cache_dir
  distributed.initialize_from_flags()  # no-op unless --num_processes>1 / --distributed
  config = _CONFIG.value
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix=f"rljax_{config.name}_")
  logging.info("devices: %s; workdir: %s", jax.devices(), workdir)
  bar = (lambda it, desc: tqdm(it, desc=desc, file=sys.stderr, mininterval=2.0)) \
      if _PROGRESS.value else None
  summary = run_experiment(config, workdir, progress=bar, resume=_RESUME.value)
  print(json_line(summary | {"workdir": workdir}), flush=True)


if __name__ == "__main__":
  app.run(main)
