"""A GRPO update with LoRA adapters vs with full fine-tuning: time and train-state bytes.

Workload: configs/arith_tiny.py (its model: 1.5M parameters, 4 layers, the first dense;
16 prompts x 16 samples per update, its numerics), no SFT. Two runs of the lockstep loop's
objects from the same random init: full fine-tuning (f32 masters + Adam moments of every
weight) and `config.lora` rank `--rank`, alpha 2 x rank, DEFAULT_TARGETS (the adapters'
masters and moments; the frozen base in bf16). Each round samples one batch of groups on
the full run's engine (not timed) and trains both runs on that same batch, in alternating
order (A B, B A, ...): `train_s` is `grpo_update.train_on_groups` (advantages, packing, the
jitted GRPO step), `update_s` adds the new serving weights into the run's engine (LoRA:
the merge). The first round (compiles) is left out; the ratios are medians over rounds of
LoRA / full. Bytes are the live train state's (and LoRA's frozen base) on this process.
Last line: one JSON object.
"""

import itertools
import json
import os
import statistics
import tempfile
import time

from absl import app, flags
import jax
import ml_collections

from configs import arith_tiny
from experiments import machine_info
from rljax import numerics
from rljax.model.lora import DEFAULT_TARGETS
from rljax.pipeline import core, grpo_update
from rljax.pipeline.rollout import generate_groups
from rljax.pipeline.run import LOCKSTEP, build

_ROUNDS = flags.DEFINE_integer("rounds", 12, "rounds (one batch, both updates); the first "
                               "compiles and is left out")
_RANK = flags.DEFINE_integer("rank", 8, "LoRA rank (alpha = 2 x rank)")


def config(lora_rank: int | None) -> ml_collections.ConfigDict:
  c = arith_tiny.get_config()
  c.sft.steps = 0
  c.log.tensorboard = False
  c.rl.kl_to_start = False  # the update alone, as measured before rl.kl_to_start existed
  if lora_rank:
    c.lora = ml_collections.ConfigDict(dict(rank=lora_rank, alpha=2.0 * lora_rank,
                                            targets=DEFAULT_TARGETS))
  return c


def tree_bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def timed_update(run, learner, groups) -> tuple[float, float]:
  """(train_s, update_s) of one GRPO update on `groups`, serving weights included."""
  t0 = time.perf_counter()
  grpo_update.train_on_groups(run, learner, groups)
  jax.block_until_ready(run.state)
  t1 = time.perf_counter()
  run.engine.update_weights(run.serve(run.state), run.version)
  jax.block_until_ready(run.engine.params)
  return t1 - t0, time.perf_counter() - t0


def main(_):
  workdir = tempfile.mkdtemp(prefix="bench_lora_")
  full_config, lora_config = config(None), config(_RANK.value)
  numerics.set_up_process(full_config.numerics)  # before JAX starts
  runs, learners = {}, {}
  for name, c in (("full", full_config), ("lora", lora_config)):
    runs[name] = core.setup(build(c, LOCKSTEP), os.path.join(workdir, name))  # same init
  for name in runs:
    learners[name] = grpo_update.grpo_learner(runs[name])
  full = runs["full"]
  rl = full.config.rl
  tasks = core.task_stream(full.env, rl.num_tasks, full.config.seed)

  times = {name: {"train_s": [], "update_s": []} for name in runs}
  for r in range(_ROUNDS.value):
    prompts = list(itertools.islice(tasks, rl.prompts_per_step))
    groups = generate_groups(full.engine, full.env, prompts, group_size=rl.group_size,
                             sampling=full.built.sampling, seed=full.config.seed,
                             first_request_id=r * rl.prompts_per_step)
    batch = [g.trajectories for g in groups]
    for name in (("full", "lora") if r % 2 == 0 else ("lora", "full")):
      train_s, update_s = timed_update(runs[name], learners[name], batch)
      if r:
        times[name]["train_s"].append(train_s)
        times[name]["update_s"].append(update_s)

  def ratio(key):
    return statistics.median(l / f for l, f in zip(times["lora"][key], times["full"][key]))

  lora_run = runs["lora"]
  print(json.dumps({
      "bench": "lora",
      "workload": f"configs/arith_tiny.py, no SFT, {rl.prompts_per_step} x {rl.group_size} "
                  f"samples per update; LoRA rank {_RANK.value} alpha {2 * _RANK.value}, "
                  f"{len(DEFAULT_TARGETS)} target kinds; {_ROUNDS.value - 1} timed rounds",
      "numerics": full.config.numerics,
      "params": sum(x.size for x in jax.tree.leaves(runs["full"].serve(runs["full"].state))),
      "adapter_params": sum(x.size for x in jax.tree.leaves(learners["lora"].state.params)),
      "train_state_bytes": {"full": tree_bytes(learners["full"].state),
                            "lora_adapters": tree_bytes(learners["lora"].state),
                            "lora_frozen_base": tree_bytes(lora_run.base)},
      "median_s": {name: {k: statistics.median(v) for k, v in t.items()}
                   for name, t in times.items()},
      "lora_over_full_train": ratio("train_s"),
      "lora_over_full_update": ratio("update_s"),
      "machine": machine_info.machine()}))


if __name__ == "__main__":
  app.run(main)
