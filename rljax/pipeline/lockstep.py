"""The lockstep GRPO loop: rollouts and updates take turns in one process.

    init ─► SFT warm start (or an SFT checkpoint) ─► eval ─► [rollout v ─► update ─► v+1]* ─► eval

One process holds the train state and a DecodeEngine, or several (jax.distributed) hold
them together: the state on config.mesh over all their devices, one SPMD engine over the
same mesh that each drives in lockstep (every process samples the same groups), each
packing and feeding its part of every batch; process 0 writes the metrics, and the
workdir must be one directory all of them reach (the orbax checkpoints are written there
by all of them). Each GRPO step samples a group of
episodes per train task with the serving params of version v (the bf16 cast of the f32
masters), scores them with the env, and runs one update (`grpo_update.train_on_groups`);
the engine then gets version v+1. A run whose every episode of `rl.max_all_infra_updates`
consecutive updates was an infra failure stops (`watch.AllInfraFailures`; the first
failure of each kind was logged with its traceback). Held-out evaluation (greedy pass@1, sampled pass@k) runs at
init, after SFT ("before"), every `eval.every` steps and at the end ("after"). Metrics go
to `<workdir>/metrics.jsonl` and TensorBoard; the reward curve to
`<workdir>/reward_curve.png`.
Every `rl.checkpoint_every` steps the loop saves a checkpoint to `<workdir>/checkpoints`
(`save`); `run_experiment(..., resume=True)` (experiments/grpo.py --resume) goes on from
the latest, its next step bitwise the uninterrupted run's in deterministic numerics.

A loop of one's own: `loop = start(run)` (the learner, the task stream, the request
ids), then `record = step(run, loop)` per step (one rollout, one update; `grpo` is a
loop over it), `report.run_eval(run, run.version, name)` between steps where wanted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import time
from typing import Any, Callable, Iterator

import jax
import ml_collections

from rljax import distributed
from rljax.checkpoint import Checkpointer
from rljax.envs.base import Task
from rljax.pipeline import core, grpo_update, report, sft, watch
from rljax.pipeline.metrics import plot_reward_curve, read_jsonl
from rljax.pipeline.rollout import generate_groups
from rljax.pipeline.run import LOCKSTEP, build


@dataclasses.dataclass
class Loop:
  """What the lockstep loop carries from one step to the next, beside `run` (which holds
  the train state, the engine and the version): made by `start`, advanced by `step`."""

  learner: grpo_update.GrpoLearner
  tasks: Iterator[Task]  # the train tasks, drawn in order (`core.task_stream`)
  next_request: int = 0  # the first request id of the next rollout (seeds its sampling)
  steps: int = 0  # steps run
  # JSON the caller keeps in the loop's checkpoints (run_experiment: the evaluations before
  # the loop, the warm start's summary fields); a resumed loop's are the saved ones
  carried: dict = dataclasses.field(default_factory=dict)


# what a checkpoint keeps of `run` beside the train state and version: the alarms and
# counters whose next values depend on their past (a resumed step logs what the
# uninterrupted one did); their settings (_CONFIGURED) come from the config
_RUN_STATE = ("mismatch", "heldout_fall", "train_fall", "watch")
_CONFIGURED = ("threshold", "window", "max_all_infra")


def start(run: core.Run, checkpointer: Checkpointer | None = None,
          carried: dict | None = None) -> Loop:
  """The GRPO learner of `rl` on run.state and the task stream of `rl.num_tasks`. The
  optimizer's lr schedule spans `rl.steps` however many steps are then run. A
  `checkpointer` holding a checkpoint (`save`'s): the loop, run.state, run.version, the
  engine's weights and the alarms as they were after its step (the task stream skips
  the tasks drawn before it); run.state must then hold the params the run started GRPO
  from (`sft.reload`): the frozen KL reference (or LoRA base) is made from them."""
  c = run.config.rl
  loop = Loop(grpo_update.grpo_learner(run),
              core.task_stream(run.env, c.num_tasks, run.config.seed), carried=carried or {})
  if checkpointer is not None and checkpointer.latest_step() is not None:
    _restore(run, loop, checkpointer)
  return loop


def save(run: core.Run, loop: Loop, checkpointer: Checkpointer) -> None:
  """Checkpoint `loop.steps` (durable on return): what `start` needs to go on from it."""
  extra = {"next_request": loop.next_request, "carried": loop.carried,
           "timings": run.timings, **{k: _fields(getattr(run, k)) for k in _RUN_STATE}}
  checkpointer.save(loop.steps, {"state": loop.learner.state}, stream_version=run.version,
                    extra=extra)
  checkpointer.wait()


def _fields(obj: Any) -> dict:
  return {f.name: list(v) if isinstance(v := getattr(obj, f.name), collections.deque) else v
          for f in dataclasses.fields(obj) if f.name not in _CONFIGURED}


def _restore(run: core.Run, loop: Loop, checkpointer: Checkpointer) -> None:
  restored = checkpointer.restore({"state": loop.learner.state})
  # the fresh learner's frozen policies (kl_to_start's reference, LoRA's base) are those
  # the checkpoint trained against: the same warm start makes the same bits
  reference = loop.learner.ref_params if run.built.lora is None else None
  loop.learner = grpo_update.grpo_learner(run, restored.state["state"], base=run.base,
                                          reference=reference)
  run.state, run.version = loop.learner.state, restored.stream_version
  run.engine.update_weights(run.serve(run.state), run.version)
  extra = restored.extra
  loop.steps, loop.next_request = restored.step, extra["next_request"]
  loop.carried = extra["carried"]
  loop.tasks = itertools.islice(loop.tasks, loop.next_request, None)  # one id per task
  run.timings.update(extra["timings"])
  for name in _RUN_STATE:
    obj = getattr(run, name)
    for key, value in extra[name].items():
      was = getattr(obj, key)
      setattr(obj, key, collections.deque(value) if isinstance(was, collections.deque) else value)


def rollout(run: core.Run, loop: Loop) -> tuple[list, list]:
  """`rl.prompts_per_step` scored groups sampled with the engine's weights (version
  run.version): (the groups to train on, every trajectory sampled). DAPO dynamic sampling
  (`rl.dynamic_sampling_rounds` > 1): a group whose rewards all tie has no advantage;
  fresh prompts (twice as many as missing) replace it, and the last round fills what is
  still missing with whatever it drew."""
  c = run.config.rl
  rounds = c.dynamic_sampling_rounds
  groups, sampled = [], []
  for round_ in range(1, rounds + 1):
    need = c.prompts_per_step - len(groups)
    n = need if rounds == 1 else 2 * need
    drawn = generate_groups(run.engine, run.env, list(itertools.islice(loop.tasks, n)),
                            group_size=c.group_size, sampling=run.built.sampling,
                            seed=run.config.seed, first_request_id=loop.next_request,
                            failures=run.failures)
    loop.next_request += n
    sampled += [t for g in drawn for t in g.trajectories]
    # signal first
    drawn.sort(key=lambda g: not grpo_update.has_signal(g.trajectories, c.overlong))
    groups += [g for g in drawn
               if round_ == rounds or grpo_update.has_signal(g.trajectories, c.overlong)][:need]
    if len(groups) == c.prompts_per_step:
      break
  return groups, sampled


def step(run: core.Run, loop: Loop) -> dict:
  """One GRPO step: a rollout with version v (`rollout`), one update
  (`grpo_update.train_on_groups`), the engine gets v + 1. Writes the step's `grpo` record
  (the update's metrics, the rollout's stats, the collapse alarm, times) and returns it. Raises
  `watch.AllInfraFailures` (after writing a `stopped` record) when every episode of
  `rl.max_all_infra_updates` consecutive updates was an infra failure."""
  c = run.config.rl
  t0 = time.perf_counter()
  groups, sampled = rollout(run, loop)
  t1 = time.perf_counter()
  metrics = grpo_update.train_on_groups(run, loop.learner, [g.trajectories for g in groups])
  t2 = time.perf_counter()
  run.engine.update_weights(run.serve(run.state), run.version)
  loop.steps += 1
  run.timings["rollout_s"] += t1 - t0
  run.timings["train_s"] += t2 - t1
  stats = watch.rollout_stats(sampled)
  record = run.log.write("grpo", run.version, metrics | stats | {
      **report.train_collapse(run, run.version, stats["success_frac"]),
      "groups_sampled": len(sampled) // c.group_size,
      "rollout_s": t1 - t0, "train_s": t2 - t1,
      "rollout_tok_s": sum(int(t.loss_mask.sum()) for t in sampled) / max(t1 - t0, 1e-9)})
  report.watch_rollouts(run, run.version, stats)  # all infra failures too long: stop, loudly
  return record


def grpo(run: core.Run, progress: Callable[[Iterator], Iterator] = iter,
         on_step: Callable[[dict], bool | None] | None = None,
         max_steps: int | None = None, *, checkpointer: Checkpointer | None = None,
         carried: dict | None = None) -> dict:
  """GRPO steps (`step`) until `rl.steps`, `max_steps` (the last step's number: fewer
  steps on `rl.steps`' lr schedule) or an `on_step` that returns False (the loop ends
  after that step). A step that `eval.every` divides, the last one to run aside (the
  caller's final evaluation covers it), evaluates on the held-out tasks after its update. `on_step(record)`: the
  step's `grpo` record, with `"eval"` (that evaluation's record) on a step that
  evaluated. `checkpointer`: the loop resumes from its latest checkpoint, if any, and
  saves one (with `carried`, see `Loop`) after every step `rl.checkpoint_every` divides.
  Returns `steps` (steps run, those before a resume included), `evals` (the loop's
  evaluation records since it started or resumed), `carried`, rl_wall_s (the loop,
  evaluations included), ttb_s (mean time-to-trainable-batch: a step's rollout) and, when
  resumed, `resumed_from_step`."""
  t0 = time.perf_counter()
  last = run.config.rl.steps if max_steps is None else min(max_steps, run.config.rl.steps)
  every = run.config.eval.every
  save_every = run.config.rl.get("checkpoint_every", 0) if checkpointer is not None else 0
  loop, evals = start(run, checkpointer, carried), []
  resumed_from = loop.steps
  for i in progress(range(loop.steps + 1, last + 1)):
    record = step(run, loop)
    if every and i % every == 0 and i != last:
      evals.append(report.run_eval(run, run.version, f"step{i}"))
      record = record | {"eval": evals[-1]}
    if save_every and i % save_every == 0:
      save(run, loop, checkpointer)
    if on_step is not None and on_step(record) is False:
      break
  out = {"steps": loop.steps, "evals": evals, "carried": loop.carried,
         "rl_wall_s": round(time.perf_counter() - t0, 2),
         "ttb_s": round(run.timings["rollout_s"] / max(loop.steps, 1), 3)}
  return out | ({"resumed_from_step": resumed_from} if resumed_from else {})


def _check_workdir(config: ml_collections.ConfigDict, workdir: str, checkpointer: Checkpointer,
                   sft_dir: str, resume: bool) -> bool:
  """Whether the run resumes (`resume`, and a checkpoint in workdir); an earlier run's
  workdir is refused otherwise."""
  latest = checkpointer.latest_step()
  if latest is not None and not resume:
    raise FileExistsError(f"{workdir} holds the checkpoints of an earlier run (step {latest}): "
                          "pass --resume to continue it, or use a fresh workdir")
  if latest is not None:
    return True
  if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    raise FileExistsError(
        f"{workdir} holds an earlier run (metrics.jsonl) with no checkpoint (saved every "
        "config.rl.checkpoint_every steps): it cannot resume: use a fresh workdir "
        f"(--config.sft.load={sft_dir} reuses its warm start)")
  sft.check_sft_dir(config, sft_dir)
  return False


def run_experiment(config: ml_collections.ConfigDict, workdir: str, *,
                   progress: Callable[..., Iterator] | None = None,
                   on_step: Callable[[dict], bool | None] | None = None,
                   max_steps: int | None = None, resume: bool = False) -> dict:
  """The whole lockstep experiment; returns the summary (also the last JSONL record).
  `on_step`, `max_steps`: `grpo`'s; a loop stopped early still ends with the final
  evaluation, `final_params` and the summary (its `steps`: the steps run).

  Checkpoints go to `<workdir>/checkpoints` every `rl.checkpoint_every` steps. A workdir
  holding one is refused unless `resume`: then the run goes on from the latest (the
  train state, version, task stream, request ids, alarms; bitwise the uninterrupted run
  in deterministic numerics). A resumed run reloads the warm start's params (SFT and the
  init / before evaluations are not run again: the summary reports the saved ones),
  appends to metrics.jsonl (steps after the checkpoint that the dead run logged are
  logged again) and writes the "run" record again."""
  t0 = time.perf_counter()
  bar = progress or (lambda it, **_: iter(it))
  sft_dir = os.path.join(os.path.abspath(workdir), "sft_checkpoint")
  final_dir = os.path.join(os.path.abspath(workdir), "final_params")
  built = build(config, LOCKSTEP)
  if os.path.exists(final_dir):
    raise FileExistsError(f"{final_dir} exists (a finished run's): use a fresh workdir")
  checkpointer = Checkpointer(os.path.join(os.path.abspath(workdir), "checkpoints"),
                              keep_last=2)
  resumed = _check_workdir(config, workdir, checkpointer, sft_dir, resume)
  if jax.process_count() > 1:  # every process checked the workdir before any writes to it
    distributed.check_mesh(config.mesh.to_dict())
    distributed.broadcast_bytes(b"checked" if distributed.is_primary() else None)
  run = core.setup(built, workdir)
  evals: list[dict] = []
  extra: dict[str, Any] = {}
  if resumed:
    sft.reload(run, sft_dir)
  else:
    evals.append(report.run_eval(run, 0, "init"))
    extra = sft.warm_start(run, sft_dir, bar)
    evals.append(report.run_eval(run, 0, "before"))
  out = grpo(run, functools.partial(bar, desc="grpo"), on_step=on_step, max_steps=max_steps,
             checkpointer=checkpointer, carried={"evals": evals, "warm_start": extra})
  checkpointer.close()
  carried = out.pop("carried")
  evals = carried["evals"] + out.pop("evals")
  extra = carried["warm_start"] | out
  evals.append(report.run_eval(run, run.version, "after"))
  sft.save_params(run, final_dir)  # experiments/export_hf.py --params=final_dir
  extra["final_params"] = final_dir
  summary = report.summarize(run, evals, time.perf_counter() - t0, extra)
  run.log.write("summary", run.version, {k: v for k, v in summary.items()
                                         if isinstance(v, (int, float))})
  run.log.close()
  if distributed.is_primary():
    plot_reward_curve(read_jsonl(run.log.jsonl_path), os.path.join(workdir, "reward_curve.png"),
                      title=f"{config.name} seed {config.seed} ({run.numerics.mode})")
  return summary
