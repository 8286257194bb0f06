"""LoRA against full fine-tuning on configs/arith_tiny.py: the same SFT start, the same
number of GRPO steps, per seed.

  python experiments/study_lora.py --out=/tmp/lora_study --seeds=0,1,2 --steps=100

Every run is the lockstep loop (`lockstep.run_experiment`) in its own process, one after
another. The first run (full fine-tuning, the first seed) makes the SFT warm start (arith_tiny's:
until greedy pass@1 on train probe tasks reaches 0.7); every other run loads it. Full
fine-tuning keeps arith_tiny's GRPO recipe (lr 2e-4); LoRA trains rank `--rank` adapters
(alpha 2 x rank, every attention projection, the dense MLP and every expert's gate/up/down)
on the frozen SFT weights at `--lora_lr` (adapters start at zero effect, B = 0, and move
the policy through a rank-r product: they take a larger step, 10x by default), otherwise
the same recipe. Held-out greedy pass@1 (256 tasks) before and after GRPO, the median
train step time (steps 3 onwards: after compiling) and the process's peak RSS. Runs already
finished under `--out` are not rerun. The last line is one JSON object.
"""

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import machine_info  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "study directory (runs resume from here)", required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds")
_STEPS = flags.DEFINE_integer("steps", 100, "GRPO steps per run")
_RANK = flags.DEFINE_integer("rank", 8, "LoRA rank (alpha = 2 x rank)")
_LORA_LR = flags.DEFINE_float("lora_lr", 2e-3, "LoRA's peak learning rate")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = r'''
import json, resource, sys, time
import ml_collections
from configs import arith_tiny
from rljax.numerics import set_up_process
set_up_process("fast")
from rljax.model.lora import DEFAULT_TARGETS
from rljax.pipeline import lockstep
from rljax.pipeline.metrics import read_jsonl
variant, seed, steps, workdir, sft_load, rank, lora_lr = sys.argv[1:8]
c = arith_tiny.get_config()
c.seed, c.rl.steps, c.eval.every, c.log.tensorboard = int(seed), int(steps), 0, False
if sft_load != "-":
  c.sft.load = sft_load
if variant == "lora":
  c.lora = ml_collections.ConfigDict(dict(rank=int(rank), alpha=2.0 * int(rank),
                                          targets=DEFAULT_TARGETS))
  c.rl.learning_rate = float(lora_lr)
t0 = time.time()
summary = lockstep.run_experiment(c, workdir)
grpo = [r for r in read_jsonl(workdir + "/metrics.jsonl") if r["phase"] == "grpo"]
train_s = sorted(r["train_s"] for r in grpo[2:])
print(json.dumps({"variant": variant, "seed": int(seed), "steps": int(steps),
                  "before": summary["heldout_pass1_before"],
                  "after": summary["heldout_pass1_after"],
                  "train_s_median": train_s[len(train_s) // 2],
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "wall_s": round(time.time() - t0, 1)}))
'''


def run(variant: str, seed: str, sft_load: str) -> dict:
  workdir = os.path.join(_OUT.value, f"{variant}_{seed}")
  done = os.path.join(workdir, "done.json")
  if not os.path.exists(done):
    proc = subprocess.run([sys.executable, "-c", DRIVER, variant, seed, str(_STEPS.value),
                           workdir, sft_load, str(_RANK.value), str(_LORA_LR.value)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode:
      raise RuntimeError(f"{variant} seed {seed}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    with open(done, "w", encoding="utf-8") as f:
      f.write(proc.stdout.strip().splitlines()[-1])
  with open(done, encoding="utf-8") as f:
    result = json.load(f)
  print(json.dumps(result), file=sys.stderr, flush=True)
  return result


def main(_):
  os.makedirs(_OUT.value, exist_ok=True)
  seeds = _SEEDS.value
  sft_dir = os.path.join(_OUT.value, f"full_{seeds[0]}", "sft_checkpoint")
  results = [run(variant, seed, "-" if (variant, seed) == ("full", seeds[0]) else sft_dir)
             for seed in seeds for variant in ("full", "lora")]
  after = {v: [r["after"] for r in results if r["variant"] == v] for v in ("full", "lora")}
  print(json.dumps({
      "workload": f"configs/arith_tiny.py lockstep, {_STEPS.value} GRPO steps from one SFT "
                  f"start; LoRA rank {_RANK.value} lr {_LORA_LR.value} vs full lr 2e-4",
      "runs": results,
      "heldout_pass1_after_mean": {v: round(statistics.mean(a), 4) for v, a in after.items()},
      "lora_minus_full": round(statistics.mean(after["lora"]) - statistics.mean(after["full"]),
                               4),
      "machine": machine_info.machine()}))


if __name__ == "__main__":
  app.run(main)
