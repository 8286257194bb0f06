"""Learning regression from checkpoints trained outside rljax: the default recipe must not
destroy them, and must improve one that has room to improve.

The start (tests/data/external_start, bf16) is experiments/study_vs_trl.py's: a Qwen3-MoE of
1.0M params trained in plain PyTorch + transformers on every pair of numbers below 100
written least-significant digit first, never on a held-out pair; `save_pretrained` with its
char-level tokenizer. On the RL task (numbers of 1 to 3 digits, same format) its greedy
pass@1 is about 0.37 and it is sharp: sampled at T=1 nearly every group of 8 ties, so a
batch has a signal in about one step of thirty, from one sample.

configs/arith_tiny.py's recipe before signal-scaled updates (`rl.signal_scaled_updates`
off) took held-out pass@1 from 0.374 to 0.198 in 30 steps (and to 0.03 by step 100; TRL's
GRPOTrainer with the same lr and schedule fell alike): Adam turned each lone sample's
gradient into a full-size step of every weight. With the default recipe it holds. TRL's own
recipe (lr 1e-4 constant) lost 0.05 in 30 steps from this start; no recipe tried rose
from it (it solves the pairs it was trained near and none of 3 digits), so the rise is
asked from the second start.

The run is `lockstep.run_experiment` on the study's config (`study_vs_trl.rljax_config`),
30 GRPO steps, held-out greedy pass@1 on 200 tasks before and after (no sampled pass@k).

The second start (tests/data/external_start_2digit, bf16) is the same script's with 250 SFT
steps on numbers below 100 (`make_start(steps=250, digits=2)`): held-out greedy pass@1 0.97
on 1-2 digit pairs it never saw, sampled 0.755; its gradient norms under the GRPO loss are
5-25 where rljax's own starts' are 1-3. There the recipe before `rl.step_clip_norm`
(Adam's step bounded by the raw gradient norm) fell 0.23-0.24 in held-out pass@1 within
30 steps of a 60-step run (2 seeds; TRL's GRPOTrainer from it fell 0.27-0.41), and with it
the run rose (0.99-1.00 at step 30, no seed below the start). The test runs the first 30
steps of a 300-step default run (`lockstep.start` / `lockstep.step`) on the 1-2 digit task.

Each run is a process of its own, compiled as the product compiles (`production_env()`:
XLA's default optimization level; the suite's -O0 programs run about 3x slower and these
runs are run-bound). This file is also the worker: `python tests/test_learning_external.py
weak|strong WORKDIR` prints the run's figures as its last line, one JSON object.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

from tests.xla_flags import production_env

REPO = pathlib.Path(__file__).resolve().parents[1]
START = os.path.join(os.path.dirname(__file__), "data", "external_start")
STRONG_START = os.path.join(os.path.dirname(__file__), "data", "external_start_2digit")
STEPS = 30
HELDOUT = 200
# The old recipe fell 0.18 in these 30 steps from this start (0.374 -> 0.198 on 500 tasks);
# the default recipe's held-out pass@1 did not move (0.374 at every evaluation, 3 seeds).
# Greedy answers change only when the policy moves, so the allowed fall is not sampling
# noise: 0.05 is the bound, 0.18 inside the old recipe's fall.
MAX_FALL = 0.05


def _run(which: str, tmp_path) -> dict:
  """The worker's figures for the `which` start's run in tmp_path."""
  proc = subprocess.run([sys.executable, __file__, which, str(tmp_path)], cwd=REPO,
                        env=production_env(), capture_output=True, text=True,
                        timeout=600)  # a hang guard
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _config(out: pathlib.Path, start: str, job_args: tuple, **job_kw):
  # pylint: disable=import-outside-toplevel
  from experiments import study_vs_trl
  from rljax import numerics
  shutil.copytree(start, out / "start")
  config = study_vs_trl.rljax_config(study_vs_trl.Job(*job_args, str(out), **job_kw))
  numerics.set_up_process(config.numerics)  # before JAX starts, as the study's runs do
  config.rl.kl_to_start = False  # one program less to compile; the loop is the same
  config.log.tensorboard = False
  config.eval.update(dict(k=1, n=1))  # greedy pass@1 is the measure; one sample for pass@k
  return config


def test_default_recipe_does_not_destroy_an_external_start(tmp_path):
  summary = _run("weak", tmp_path)
  before, after = summary["heldout_pass1_before"], summary["heldout_pass1_after"]
  assert before > 0.2, f"the shipped start should solve a third of the tasks, got {before}"
  assert after >= before - MAX_FALL, (before, after)
  assert summary["collapse_alarms"] == 0


def weak(workdir: pathlib.Path) -> dict:
  from rljax.pipeline import lockstep  # pylint: disable=import-outside-toplevel
  config = _config(workdir / "study", START, ("default", 0, STEPS, 0, HELDOUT))
  summary = lockstep.run_experiment(config, str(workdir / "run"))
  return {k: summary[k] for k in ("heldout_pass1_before", "heldout_pass1_after",
                                  "collapse_alarms")}


# The default recipe's first 30 steps of a 300-step run from the strong start, held-out
# greedy pass@1 on 200 tasks: 0.97 -> 1.00 / 1.00 / 0.98 (config seeds 0 / 1 / 2; from the
# f32 start 0.97 -> 1.00 / 1.00 / 0.99; AMD EPYC AVX-512). Greedy answers are a function of
# the params, so the spread is the RL run's own: the smallest rise seen is 2 tasks of 200,
# and the test asks for at least one more task solved than at the start (+0.005). The
# recipe before step_clip_norm (`rl.step_clip_norm=0`) fails it: 0.97 -> 0.825 (seed 0;
# from the f32 start 0.65 / 0.675, seeds 0 / 1).
STRONG_STEPS = 30
STRONG_RISE = 0.005


def test_default_recipe_improves_a_strong_external_start(tmp_path):
  r = _run("strong", tmp_path)
  before, after = r["before"], r["after"]
  assert before > 0.9, f"the shipped strong start should solve nearly every task, got {before}"
  assert after["pass1"] >= before + STRONG_RISE, (before, after["pass1"])
  assert after["collapse_alarm"] == 0, after


def strong(workdir: pathlib.Path) -> dict:
  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, lockstep, report
  from rljax.pipeline.run import LOCKSTEP, build
  # the horizon (and so the lr schedule) of a 300-step run; its first STRONG_STEPS run here
  config = _config(workdir / "study", STRONG_START, ("default", 0, 300, 0, HELDOUT),
                   min_digits=1, max_digits=2, num_tasks=8000)
  run = core.setup(build(config, LOCKSTEP), str(workdir / "run"))
  before = report.run_eval(run, 0, "before")["pass1"]
  loop = lockstep.start(run)  # the lr schedule spans rl.steps
  for _ in range(STRONG_STEPS):
    lockstep.step(run, loop)
  after = report.run_eval(run, run.version, "after")
  return {"before": before, "after": {k: after[k] for k in ("pass1", "collapse_alarm")}}


if __name__ == "__main__":  # the repo root is importable (the editable install's .pth)
  print(json.dumps({"weak": weak, "strong": strong}[sys.argv[1]](pathlib.Path(sys.argv[2]))))
