"""What `experiments/pipeline.py` does around the async trainer: start local rollout-host
processes with the same config (and compile cache) flags (`run_with_hosts`), and print the
run's summary table."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Iterator

import ml_collections

from rljax import distributed
from rljax.pipeline.async_loop import run_async

HOST_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "experiments", "rollout_host.py")


SHARED_FLAGS = ("--config", "--compile_cache_dir")


def host_args(argv: list[str]) -> list[str]:
  """The flags of a command line the hosts share with it: --config (file and overrides)
  and --compile_cache_dir."""
  out, args = [], iter(argv[1:])
  for arg in args:
    if arg.startswith(SHARED_FLAGS):
      if "=" not in arg:  # "--config.x y" form
        arg = f"{arg}={next(args)}"
      out.append(arg)
  return out


def start_hosts(root: str, n: int, workdir: str) -> list[subprocess.Popen]:
  """n `experiments/rollout_host.py` processes on `root` (logs: <workdir>/host<i>.log)."""
  procs = []
  for i in range(n):
    log = open(os.path.join(workdir, f"host{i}.log"), "w", encoding="utf-8")
    procs.append(subprocess.Popen(
        [sys.executable, HOST_SCRIPT, f"--root={root}", f"--host_id=host{i}",
         *host_args(sys.argv)], stdout=log, stderr=subprocess.STDOUT))
  return procs


def stop_hosts(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> list[int]:
  """Waits for the hosts (they exit on run/done), killing stragglers; their exit codes."""
  for proc in procs:
    try:
      proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  return [proc.returncode for proc in procs]


def run_with_hosts(config: ml_collections.ConfigDict, workdir: str, root: str, n_hosts: int, *,
                   progress: Callable[..., Iterator] | None = None,
                   resume: bool = False) -> dict:
  """The async trainer (`run_async`) with `n_hosts` rollout-host processes started here
  once version 0 is published: killed if the trainer fails, else waited for (they exit
  on run/done). Returns the summary with `workdir` and (process 0) `host_exit_codes`."""
  hosts = []
  try:
    summary = run_async(config, workdir, root, progress=progress, resume=resume,
                        on_started=lambda: hosts.extend(start_hosts(root, n_hosts, workdir)))
  except BaseException:
    for proc in hosts:
      proc.kill()
    raise
  summary["workdir"] = workdir
  exit_codes = stop_hosts(hosts)
  if distributed.is_primary():
    summary["host_exit_codes"] = exit_codes
  return summary


def summary_table(summary: dict) -> str:
  rows = [("held-out pass@1", summary["heldout_pass1_before"], summary["heldout_pass1_after"])]
  k = next(key for key in summary if key.startswith("heldout_pass") and key.endswith("_before")
           and key != "heldout_pass1_before")
  rows.append((k[len("heldout_"):-len("_before")], summary[k], summary[k.replace("before",
                                                                               "after")]))
  lines = [f"{'':<18}{'before':>10}{'after':>10}"]
  lines += [f"{name:<18}{b:>10.3f}{a:>10.3f}" for name, b, a in rows]
  for key in ("updates", "mean_staleness", "ttb_s", "dropped_stale", "mismatch_max_abs",
              "own_version_mismatch_max_abs", "rl_wall_s", "wall_s"):
    value = summary.get(key)
    lines.append(f"{key:<30}{value:>12.4g}" if isinstance(value, float) else
                 f"{key:<30}{str(value):>12}")
  return "\n".join(lines)
