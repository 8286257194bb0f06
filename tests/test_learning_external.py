"""Learning regression from a checkpoint trained outside rljax: the default recipe must not
destroy it.

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
recipe (lr 1e-4 constant) lost 0.05 in 30 steps from this start, so there is no rise to
ask for here; tests/test_learning.py asserts the rise from a start with a dense signal.

The run is `lockstep.run_experiment` on the study's config (`study_vs_trl.rljax_config`),
30 GRPO steps, held-out greedy pass@1 on 200 tasks before and after (no sampled pass@k).
"""

import os
import shutil

from experiments import study_vs_trl
from rljax.pipeline import lockstep

START = os.path.join(os.path.dirname(__file__), "data", "external_start")
STEPS = 30
HELDOUT = 200
# The old recipe fell 0.18 in these 30 steps from this start (0.374 -> 0.198 on 500 tasks);
# the default recipe's held-out pass@1 did not move (0.374 at every evaluation, 3 seeds).
# Greedy answers change only when the policy moves, so the allowed fall is not sampling
# noise: 0.05 is the bound, 0.18 inside the old recipe's fall.
MAX_FALL = 0.05


def _config(tmp_path, **rl):
  out = tmp_path / "study"
  shutil.copytree(START, out / "start")
  job = study_vs_trl.Job("default", 0, STEPS, 0, HELDOUT, str(out))
  config = study_vs_trl.rljax_config(job)
  config.rl.kl_to_start = False  # one program less to compile; the loop is the same
  config.log.tensorboard = False
  config.eval.update(dict(k=1, n=1))  # greedy pass@1 is the measure; one sample for pass@k
  config.rl.update(rl)
  return config


def test_default_recipe_does_not_destroy_an_external_start(tmp_path):
  summary = lockstep.run_experiment(_config(tmp_path), str(tmp_path / "run"))
  before, after = summary["heldout_pass1_before"], summary["heldout_pass1_after"]
  assert before > 0.2, f"the shipped start should solve a third of the tasks, got {before}"
  assert after >= before - MAX_FALL, (before, after)
  assert summary["collapse_alarms"] == 0

