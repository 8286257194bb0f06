"""The lockstep GRPO loop: rollouts and updates take turns in one process.

    init ─► SFT warm start (or an SFT checkpoint) ─► eval ─► [rollout v ─► update ─► v+1]* ─► eval

One process holds the train state and a DecodeEngine, or several (jax.distributed) hold
them together: the state on config.mesh over all their devices, one SPMD engine over the
same mesh that each drives in lockstep (every process samples the same groups), each
packing and feeding its part of every batch; process 0 writes the metrics, and the
workdir must be one directory all of them reach (the orbax checkpoints are written there
by all of them). Each GRPO step samples a group of
episodes per train task with the serving params of version v (the bf16 cast of the f32
masters), scores them with the env, and runs one update (`core.train_on_groups`); the
engine then gets version v+1. A run whose every episode of `rl.max_all_infra_updates`
consecutive updates was an infra failure stops (`core.AllInfraFailures`; the first
failure of each kind was logged with its traceback). Held-out evaluation (greedy pass@1, sampled pass@k) runs at
init, after SFT ("before"), every `eval.every` steps and at the end ("after"). Metrics go
to `<workdir>/metrics.jsonl` and TensorBoard; the reward curve to
`<workdir>/reward_curve.png`.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from typing import Any, Callable, Iterator

import jax
import ml_collections

from rljax import distributed
from rljax.pipeline import core
from rljax.pipeline.metrics import plot_reward_curve, read_jsonl
from rljax.pipeline.rollout import generate_groups
from rljax.pipeline.run import LOCKSTEP, build


def grpo(run: core.Run, progress: Callable[[Iterator], Iterator] = iter,
         on_step: Callable[[dict], None] | None = None) -> dict:
  """`rl.steps` synchronous GRPO steps; returns run totals: rl_wall_s (the loop, evals
  between steps included) and ttb_s (mean time-to-trainable-batch: a step's rollout)."""
  start = time.perf_counter()
  c = run.config.rl
  grpo_state = core.grpo_learner(run)
  tasks = core.task_stream(run.env, c.num_tasks, run.config.seed)
  e = run.config.eval
  rounds = c.dynamic_sampling_rounds
  next_request = 0
  for step in progress(range(1, c.steps + 1)):
    t0 = time.perf_counter()
    groups, sampled = [], []
    for round_ in range(1, rounds + 1):
      # DAPO dynamic sampling (rounds > 1): a group whose rewards all tie has no
      # advantage; fresh prompts (twice as many as missing) replace it, and the last round
      # fills what is still missing with whatever it drew
      need = c.prompts_per_step - len(groups)
      n = need if rounds == 1 else 2 * need
      drawn = generate_groups(run.engine, run.env, list(itertools.islice(tasks, n)),
                              group_size=c.group_size, sampling=run.built.sampling,
                              seed=run.config.seed, first_request_id=next_request,
                              failures=run.failures)
      next_request += n
      sampled += [t for g in drawn for t in g.trajectories]
      drawn.sort(key=lambda g: not core.has_signal(g.trajectories, c.overlong))  # signal first
      groups += [g for g in drawn
                 if round_ == rounds or core.has_signal(g.trajectories, c.overlong)][:need]
      if len(groups) == c.prompts_per_step:
        break
    t1 = time.perf_counter()
    metrics = core.train_on_groups(run, grpo_state, [g.trajectories for g in groups])
    t2 = time.perf_counter()
    run.engine.update_weights(run.serve(run.state), run.version)
    run.timings["rollout_s"] += t1 - t0
    run.timings["train_s"] += t2 - t1
    stats = core.rollout_stats(sampled)
    record = run.log.write("grpo", run.version, metrics | stats | {
        **core.train_collapse(run, run.version, stats["success_frac"]),
        "groups_sampled": len(sampled) // c.group_size,
        "rollout_s": t1 - t0, "train_s": t2 - t1,
        "rollout_tok_s": sum(int(t.loss_mask.sum()) for t in sampled) / max(t1 - t0, 1e-9)})
    if on_step is not None:
      on_step(record)
    # every episode an infra failure for rl.max_all_infra_updates updates: stop, loudly
    core.watch_rollouts(run, run.version, stats)
    if e.every and step % e.every == 0 and step != c.steps:
      core.run_eval(run, run.version, f"step{step}")
  return {"steps": c.steps, "rl_wall_s": round(time.perf_counter() - start, 2),
          "ttb_s": round(run.timings["rollout_s"] / max(c.steps, 1), 3)}


def run_experiment(config: ml_collections.ConfigDict, workdir: str, *,
                   progress: Callable[..., Iterator] | None = None) -> dict:
  """The whole lockstep experiment; returns the summary (also the last JSONL record)."""
  t0 = time.perf_counter()
  bar = progress or (lambda it, **_: iter(it))
  sft_dir = os.path.join(os.path.abspath(workdir), "sft_checkpoint")
  final_dir = os.path.join(os.path.abspath(workdir), "final_params")
  built = build(config, LOCKSTEP)
  core.check_sft_dir(config, sft_dir)
  if os.path.exists(final_dir):
    raise FileExistsError(f"{final_dir} exists (a finished run's): use a fresh workdir")
  if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    raise FileExistsError(
        f"{workdir} holds an earlier run (metrics.jsonl). The lockstep loop keeps no mid-run "
        "checkpoints and cannot resume: use a fresh workdir (--config.sft.load="
        f"{sft_dir} reuses its warm start), or experiments/pipeline.py --resume for a "
        "resumable run")
  if jax.process_count() > 1:  # every process checked the workdir before any writes to it
    distributed.check_mesh(config.mesh.to_dict())
    distributed.broadcast_bytes(b"checked" if distributed.is_primary() else None)
  run = core.setup(built, workdir)
  evals = [core.run_eval(run, 0, "init")]
  extra: dict[str, Any] = core.warm_start(run, sft_dir, bar)
  evals.append(core.run_eval(run, 0, "before"))
  extra |= grpo(run, functools.partial(bar, desc="grpo"))
  evals.append(core.run_eval(run, run.version, "after"))
  core.save_params(run, final_dir)  # experiments/export_hf.py --params=final_dir
  extra["final_params"] = final_dir
  summary = core.summarize(run, evals, time.perf_counter() - t0, extra)
  run.log.write("summary", run.version, {k: v for k, v in summary.items()
                                         if isinstance(v, (int, float))})
  run.log.close()
  if distributed.is_primary():
    plot_reward_curve(read_jsonl(run.log.jsonl_path), os.path.join(workdir, "reward_curve.png"),
                      title=f"{config.name} seed {config.seed} ({run.numerics.mode})")
  return summary
