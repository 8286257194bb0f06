"""Async GRPO: this process trains, N rollout-host processes sample.

  python experiments/pipeline.py --config=configs/arith_tiny.py --workdir=/tmp/pipe \
      [--root=file:///tmp/pipe/root] [--hosts=2] [--config.seed=1 ...]

A trainer of several processes (one per host; rljax.distributed's flags, e.g.
`--coordinator_address=HOST0:PORT --num_processes=N --process_id=i`, or `--distributed`):
run the same command on each, with an explicit `--root` they all reach (gs://) and
`config.mesh` spanning all their devices. Process 0 starts the local rollout hosts and
prints the summary; the others print one JSON line (their process index and updates).

The trainer and its hosts share only the storage root (`file://` here; `gs://` works the
same): the weight stream, the work queue and the run's control keys. Hosts are started
once version 0 is published, with the same config file and `--config.*` overrides, and
stop when the trainer writes `run/done`. Prints a summary table, writes
<workdir>/reward_curve.png; the last line printed is one JSON object (the sync loop's
fields plus mean_staleness, ttb_s and the queue's accounting).
"""

import rljax  # noqa: F401  (XLA flags first)

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags, logging
import jax
from ml_collections import config_flags
from tqdm import tqdm

from rljax import distributed
from rljax.pipeline.async_loop import run_async

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arith_tiny.py", "experiment config",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (a fresh temp dir if unset)")
_ROOT = flags.DEFINE_string("root", None, "storage root URL (default file://<workdir>/root)")
_HOSTS = flags.DEFINE_integer("hosts", None, "rollout-host processes to start here "
                              "(default config.async_rl.hosts; 0 = they run elsewhere)")
_PROGRESS = flags.DEFINE_bool("progress", True, "tqdm progress bars on stderr")

HOST_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout_host.py")


def config_args(argv: list[str]) -> list[str]:
  """This process's --config flags (file and overrides), for the hosts."""
  out, args = [], iter(argv[1:])
  for arg in args:
    if arg.startswith("--config"):
      if "=" not in arg:  # "--config.x y" form
        arg = f"{arg}={next(args)}"
      out.append(arg)
  return out


def start_hosts(root: str, n: int, workdir: str) -> list[subprocess.Popen]:
  procs = []
  for i in range(n):
    log = open(os.path.join(workdir, f"host{i}.log"), "w", encoding="utf-8")
    procs.append(subprocess.Popen(
        [sys.executable, HOST_SCRIPT, f"--root={root}", f"--host_id=host{i}",
         *config_args(sys.argv)], stdout=log, stderr=subprocess.STDOUT))
  return procs


def summary_table(summary: dict) -> str:
  rows = [("held-out pass@1", summary["heldout_pass1_before"], summary["heldout_pass1_after"])]
  k = next(key for key in summary if key.startswith("heldout_pass") and key.endswith("_before")
           and key != "heldout_pass1_before")
  rows.append((k[len("heldout_"):-len("_before")], summary[k], summary[k.replace("before",
                                                                               "after")]))
  lines = [f"{'':<18}{'before':>10}{'after':>10}"]
  lines += [f"{name:<18}{b:>10.3f}{a:>10.3f}" for name, b, a in rows]
  for key in ("updates", "mean_staleness", "ttb_s", "dropped_stale", "mismatch_max_abs",
              "rl_wall_s", "wall_s"):
    value = summary[key]
    lines.append(f"{key:<18}{value:>20.4g}" if isinstance(value, float) else
                 f"{key:<18}{value:>20}")
  return "\n".join(lines)


def main(argv):
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  distributed.initialize_from_flags()  # no-op unless --num_processes>1 / --distributed
  config = _CONFIG.value
  primary = distributed.is_primary()
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
  n_hosts = config.async_rl.hosts if _HOSTS.value is None else _HOSTS.value
  bar = (lambda it, desc: tqdm(it, desc=desc, file=sys.stderr, mininterval=2.0)) \
      if _PROGRESS.value and primary else None
  hosts: list[subprocess.Popen] = []
  try:
    summary = run_async(config, workdir, root, progress=bar,
                        on_started=lambda: hosts.extend(start_hosts(root, n_hosts, workdir)))
  except BaseException:
    for proc in hosts:
      proc.kill()
    raise
  for proc in hosts:
    try:
      proc.wait(timeout=60)  # they exit on run/done
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  summary["workdir"] = workdir
  if primary:
    summary["host_exit_codes"] = [proc.returncode for proc in hosts]
    print(summary_table(summary))
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
