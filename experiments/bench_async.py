"""Async pipeline vs the synchronous loop at equal trained samples, on a long-tail workload.

Workload: configs/arith_tiny.py's policy and task (3-digit addition), both modes starting
from one SFT checkpoint made here first (SFT to train-probe pass@1 0.5); GRPO for
--steps updates of 8 prompts x group 8 (the same trained samples in both modes); the
verifier sleeps a Pareto delay per sample (scale 50 ms, shape 1.2, cap 4 s: median 89 ms,
p99 2.3 s), the tail of a sandbox or tool. Env calls run on worker threads in both modes,
so the sync loop only waits for its slowest sample, not the sum.
  sync:  experiments/grpo.py (rollout, then update, in one process);
  async: experiments/pipeline.py (trainer process + 2 rollout-host processes on a file://
         root, max_staleness 2).
Each mode runs once per seed (default 3 seeds), alternating (sync, async, sync, async,
...), one run at a time. Timed: the RL phase (`rl_wall_s`: from the first rollout to the
last update). Neither mode's start-up is in it: the sync loop builds its engine before,
and the async trainer launches its host processes once version 0 is published, before
its "before" evaluation, so their start-up (process, imports, weight fetch) overlaps that
evaluation and counts only where it outlasts it. Compilation is not even: the sync
loop's engine compiled in its evaluations before the timed phase, the hosts' engines
compile on their first rollouts, inside it (a cost counted against async). ttb_s: mean time-to-trainable-batch per update
(sync: the step's rollout; async: the trainer's wait for its batch). speedup and
ttb_reduction are medians over seeds of the per-seed ratios. final reward: mean training
success fraction over the last 5 updates, averaged over seeds; reward_noise: the largest
difference between seeds within a mode. Last line: one JSON object (with the machine's
CPU model and load averages: the async advantage is overlap, which needs idle cores).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments import machine_info

_STEPS = flags.DEFINE_integer("steps", 30, "GRPO updates per run")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "one sync and one async run per seed")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (temp dir if unset)")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = ["--config.rl.prompts_per_step=8", "--config.rl.group_size=8",
            "--config.rl.warmup_steps=5", "--config.eval.every=0",
            "--config.eval.num_tasks=64", "--config.eval.n=4", "--config.eval.k=4",
            "--config.env.kwargs.latency.distribution=pareto",
            "--config.env.kwargs.latency.scale_s=0.05",
            "--config.env.kwargs.latency.shape=1.2", "--config.env.kwargs.latency.cap_s=4.0",
            "--config.log.tensorboard=False", "--progress=false"]
LAST = 5


def _run(script: str, args: list[str], log_path: str) -> dict:
  with open(log_path, "w", encoding="utf-8") as log:
    out = subprocess.run([sys.executable, os.path.join(HERE, script), *args],
                         stdout=subprocess.PIPE, stderr=log, text=True, check=False)
  if out.returncode != 0:
    with open(log_path, encoding="utf-8") as f:
      raise RuntimeError(f"{script} failed ({out.returncode}):\n{f.read()[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _final_reward(workdir: str, phase: str) -> float:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  rewards = [r["success_frac"] for r in records if r.get("phase") == phase]
  return statistics.fmean(rewards[-LAST:])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if len(_SEEDS.value) < 3:
    raise app.UsageError("--seeds: at least 3 (a median and a noise figure need them)")
  base = os.path.abspath(_WORKDIR.value or tempfile.mkdtemp(prefix="rljax_bench_async_"))
  os.makedirs(base, exist_ok=True)
  sft_dir = os.path.join(base, "sft")
  sft = _run("grpo.py", [f"--workdir={sft_dir}", "--config.rl.steps=0",
                         "--config.sft.target_pass1=0.5", *WORKLOAD],
             os.path.join(base, "sft.log"))
  print(json.dumps({"sft": {k: sft[k] for k in ("sft_steps", "heldout_pass1_before")
                            if k in sft}}), flush=True)
  common = [f"--config.sft.load={sft_dir}/sft_checkpoint", f"--config.rl.steps={_STEPS.value}",
            *WORKLOAD]
  runs = {"sync": [], "async": []}
  for seed in _SEEDS.value:
    for mode, script in (("sync", "grpo.py"), ("async", "pipeline.py")):
      workdir = os.path.join(base, f"{mode}{seed}")
      summary = _run(script, [f"--workdir={workdir}", f"--config.seed={seed}", *common],
                     os.path.join(base, f"{mode}{seed}.log"))
      summary["final_reward"] = _final_reward(workdir, "grpo" if mode == "sync" else "async")
      runs[mode].append(summary)
      print(json.dumps({"mode": mode, "seed": int(seed), **{
          k: summary.get(k) for k in ("rl_wall_s", "ttb_s", "final_reward",
                                      "heldout_pass1_after", "mean_staleness",
                                      "dropped_stale", "wall_s")}}), flush=True)
  sync, asyn = runs["sync"], runs["async"]
  med = lambda key, mode: statistics.median(r[key] for r in runs[mode])
  spread = lambda mode: (max(r["final_reward"] for r in runs[mode])
                         - min(r["final_reward"] for r in runs[mode]))
  result = {
      "workload": (f"arith_tiny policy from one SFT checkpoint, {_STEPS.value} updates x 8 "
                   "prompts x group 8 per mode, pareto(50 ms, 1.2, cap 4 s) verifier latency, "
                   f"async = 2 host processes, seeds {_SEEDS.value}"),
      "sync_wall_s": med("rl_wall_s", "sync"), "async_wall_s": med("rl_wall_s", "async"),
      "speedup": statistics.median(s["rl_wall_s"] / a["rl_wall_s"] for s, a in zip(sync, asyn)),
      "sync_ttb_s": med("ttb_s", "sync"), "async_ttb_s": med("ttb_s", "async"),
      "ttb_reduction": statistics.median(1.0 - a["ttb_s"] / s["ttb_s"]
                                         for s, a in zip(sync, asyn)),
      "sync_final_reward": statistics.fmean(r["final_reward"] for r in sync),
      "async_final_reward": statistics.fmean(r["final_reward"] for r in asyn),
      "reward_noise": max(spread("sync"), spread("async")),
      "sync_heldout_pass1_after": statistics.fmean(r["heldout_pass1_after"] for r in sync),
      "async_heldout_pass1_after": statistics.fmean(r["heldout_pass1_after"] for r in asyn),
      "async_mean_staleness": statistics.fmean(r["mean_staleness"] for r in asyn),
      "async_dropped_stale": sum(r["dropped_stale"] for r in asyn),
      "samples_per_run": _STEPS.value * 64,
      "seeds": len(_SEEDS.value),
      "machine": machine_info.machine(),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
