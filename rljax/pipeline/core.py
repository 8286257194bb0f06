"""The core both GRPO loops stand on: a run's state, SFT warm start, evaluation, one update.

`setup(built, workdir)` makes a `Run` (params, engine, metrics logger) from `build(config)`;
`sft` warm-starts it on reference completions; `run_eval` scores held-out tasks with the
engine; `grpo_learner` makes the optimizer, state and jitted step of the `rl` block, and
`train_on_groups` runs one update on scored groups. The lockstep loop
(rljax.pipeline.lockstep) and the async trainer (rljax.pipeline.async_loop) are two ways of
feeding `train_on_groups`.

Infra failures (rljax.envs.base.INFRA_REASONS: a reward function that raised, returned no
number or NaN, or timed out; a failed env step) are counted in every update's record
(`infra_failures`, `reward_errors`, `infra_failures_<reason>`) and the summary;
`RolloutWatch` stops the run (`AllInfraFailures`) when every episode of
`rl.max_all_infra_updates` (3; 0: never) consecutive updates was one, and warns when
every sample of an update ran out of `rl.max_new_tokens` without a stop token.

The update recomputes the log-probs of the sampled tokens with the same bf16 weights the
engine sampled with; `mismatch_max_abs` is the largest |trainer - behaviour| log-prob over
the tokens sampled by the version being trained (exactly 0.0 in deterministic mode),
with the number of tokens it covers: null, never 0.0, when it covers none. A NaN anywhere
makes it NaN.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Any, Callable, Iterator, Sequence

from etils import epath
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rljax.checkpoint import Checkpointer
from rljax.engine.engine import DecodeEngine
from rljax.envs.base import INFRA_REASONS, REWARD_ERRORS, Env, Task
from rljax.model import count_params, init_sharded, param_shardings
from rljax.model import lora as lora_lib
from rljax.model.hf_import import load_hf_params
from rljax.model.packing import aligned_length
from rljax.pipeline.evaluate import evaluate, greedy_groups, sampled_key, success_rate
from rljax.pipeline.metrics import (FallAlarm, MetricsLogger, NullLogger, RunningMax,
                                    SuccessFallAlarm)
from rljax.pipeline.rollout import FailureLog, episode_info_means
from rljax.pipeline.run import Built, init_from_hf, rows_for
from rljax.rl import learner
from rljax.rl.advantages import group_advantages
from rljax.rl.batch import build_batch, global_batch, split_microbatches
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory


def task_stream(env: Env, n: int, seed: int) -> Iterator[Task]:
  """The run's train tasks: n distinct ones, reshuffled on every pass."""
  tasks = env.prompts("train", n, seed)
  rng = np.random.default_rng(seed)
  while True:
    for i in rng.permutation(len(tasks)):
      yield tasks[i]


def sft_trajectory(env: Env, task: Task) -> Trajectory:
  target = env.sft_target(task)
  c = len(target.completion_ids)
  return Trajectory(task.prompt_ids, target.completion_ids, target.loss_mask,
                    np.zeros(c, np.float32), np.zeros(c, np.int32), None, FinishReason.EOS)


def params_only(params: Any) -> learner.TrainState:
  """The state between phases: f32 params; each phase builds its own optimizer state."""
  return learner.TrainState(params, (), jnp.zeros((), jnp.int32))


# a held-out fall from the best that raises the collapse alarm, unless config.eval.collapse_fall
# says otherwise: healthy runs of the recipe study fell at most 0.08 (evaluation noise
# included); the collapse that started it fell 0.36
COLLAPSE_FALL = 0.15
# the training signal's alarm (metrics.SuccessFallAlarm), unless config.rl.collapse_fall /
# config.rl.collapse_window say otherwise: the moving average of the sampled success
# fraction over this many updates, this far below its first full window's
TRAIN_COLLAPSE_FALL = 0.15
TRAIN_COLLAPSE_WINDOW = 10
# consecutive updates whose every episode was an infra failure that stop a run, unless
# config.rl.max_all_infra_updates says otherwise (0: never)
MAX_ALL_INFRA_UPDATES = 3


class AllInfraFailures(RuntimeError):
  """Every episode of `rl.max_all_infra_updates` consecutive updates was an infra failure:
  nothing trains (a reward function that always raises, say)."""


@dataclasses.dataclass
class RolloutWatch:
  """What the episodes of each update say about the env, not the policy: infra failures
  by reason (totals for the summary), a stop after `max_all_infra` consecutive updates of
  nothing but infra failures, and a warning the first time every sample of an update ran
  out of max_new_tokens without a stop token."""

  max_all_infra: int = MAX_ALL_INFRA_UPDATES
  streak: int = 0  # consecutive updates of nothing but infra failures
  totals: dict = dataclasses.field(default_factory=dict)  # summary counts
  all_length_updates: int = 0

  def update(self, step: int, stats: dict, *, max_new_tokens: int, stop_ids=()) -> None:
    """One update's `rollout_stats`: totals, the streak, the max_new_tokens warning."""
    for key, value in stats.items():
      if key in ("infra_failures", "reward_errors") or key.startswith("infra_failures_"):
        self.totals[key] = self.totals.get(key, 0) + int(value)
    episodes = stats.get("episodes", 0)
    all_infra = episodes > 0 and stats["infra_failures"] == episodes
    self.streak = self.streak + 1 if all_infra else 0
    if episodes and stats.get("length_frac", 0.0) == 1.0:
      self.all_length_updates += 1
      if self.all_length_updates == 1:
        logging.warning(
            "step %d: every one of the %d samples ran out of rl.max_new_tokens (%d) without a "
            "stop token (stop ids %s): the policy never ends its answer, so every one is "
            "scored unfinished (check config.tokenizer.stop_tokens against the checkpoint's "
            "EOS / generation_config.json, or raise max_new_tokens)", step, episodes,
            max_new_tokens, list(stop_ids))

  def stop_message(self, first_errors: dict | None = None) -> str:
    """Why the run must stop ("" while it may go on)."""
    if not self.max_all_infra or self.streak < self.max_all_infra:
      return ""
    reasons = {k[len("infra_failures_"):]: v for k, v in self.totals.items()
               if k.startswith("infra_failures_") and v}
    lines = [f"every episode of the last {self.streak} updates was an infra failure (no "
             f"gradient, no baseline: nothing trains); infra failures by reason so far: "
             f"{reasons}. The first of each kind:"]
    for kind, first in (first_errors or {}).items():
      lines.append(f"  {kind} ({first.get('task', '?')}): {first.get('error', '')}")
    lines.append("Fix the env or reward function (rljax/envs/dataset.py: reward_fn must "
                 "return a finite number or a Verdict, and be importable by the trainer, the "
                 "rollout hosts and the verifier processes), or set "
                 "config.rl.max_all_infra_updates (0: never stop)")
    return "\n".join(lines)

  def summary(self) -> dict:
    out = {"infra_failures": 0, "reward_errors": 0} | dict(self.totals)
    return out | {"all_length_updates": self.all_length_updates}


@dataclasses.dataclass
class Run:
  """Everything one run holds; made by `setup`, driven by `sft`, the loops and `run_eval`."""

  built: Built
  heldout: list[Task]
  engine: DecodeEngine | None
  state: learner.TrainState
  serve: Callable[[learner.TrainState], Any]
  log: MetricsLogger | NullLogger
  version: int = 0
  # config.lora, once GRPO trains adapters: the frozen base (state = the adapters')
  base: Any = None
  # over the tokens sampled by the version each update trained (see the module docstring)
  mismatch: RunningMax = dataclasses.field(default_factory=RunningMax)
  # held-out pass@1 from the warm start on
  heldout_fall: FallAlarm = dataclasses.field(default_factory=lambda: FallAlarm(COLLAPSE_FALL))
  # the sampled success fraction of every update (process 0 logs it; a resumed async
  # trainer starts it afresh: its start is the first full window after the resume)
  train_fall: SuccessFallAlarm = dataclasses.field(
      default_factory=lambda: SuccessFallAlarm(TRAIN_COLLAPSE_FALL, TRAIN_COLLAPSE_WINDOW))
  timings: dict = dataclasses.field(default_factory=lambda: {"rollout_s": 0.0, "train_s": 0.0})
  # infra failures of this process's episodes (each kind logged once) and of every update
  failures: FailureLog = dataclasses.field(default_factory=FailureLog)
  watch: RolloutWatch = dataclasses.field(default_factory=RolloutWatch)

  config = property(lambda self: self.built.config)
  cfg = property(lambda self: self.built.cfg)
  numerics = property(lambda self: self.built.numerics)
  sharding = property(lambda self: self.built.sharding)
  env = property(lambda self: self.built.env)

  @property
  def max_seq_len(self) -> int:
    return self.config.engine.max_seq_len

  def batch_shape(self, num_seqs: int) -> dict[str, int]:
    """Packed rows for num_seqs sequences. `train.row_len` 0: one longest sequence per row
    (page-aligned). Rows are sized for the longest sequences, so longer rows hold no fewer
    tokens in all; they only widen every row's attention (cost ~ row_len^2)."""
    row_len = (self.config.train.row_len
               or aligned_length(self.max_seq_len, self.cfg.page_size))
    return dict(row_len=row_len, num_seqs=num_seqs, page_size=self.cfg.page_size,
                num_rows=rows_for(num_seqs, self.max_seq_len, row_len, self.cfg.page_size))


def initial_params(built: Built, dtype: Any = jnp.float32) -> Any:
  """The run's params before any training, as `dtype`: `config.init_from`'s checkpoint
  (read as `dtype`, each device's shard from the files, no random init first), else a
  random init from `config.seed` (drawn in f32, then cast); on `built.sharding` (None: one
  device)."""
  cfg, sharding = built.cfg, built.sharding
  hf_dir = init_from_hf(built.config)
  if hf_dir is None:
    params = init_sharded(cfg, built.config.seed, sharding, dtype=jnp.float32)
    return (params if jnp.dtype(dtype) == jnp.float32
            else jax.tree.map(lambda x: x.astype(dtype), params))
  return load_hf_params(hf_dir, cfg, dtype,
                        None if sharding is None else param_shardings(cfg, sharding))


def setup(built: Built, workdir: str, *, engine: bool = True) -> Run:
  """The run's held-out tasks, initial params, engine and metrics logger. `engine=False`:
  no DecodeEngine. The engine runs on the trainer's mesh with the decode rules
  (`Built.trainer_engine_sharding`). Several processes (jax.distributed): each holds its
  part of the params and the same engine, one SPMD program over the whole mesh that every
  process drives in lockstep; records are written by process 0 only."""
  config, cfg = built.config, built.cfg
  heldout = built.env.prompts("held_out", config.eval.num_tasks, config.eval.seed)
  params = initial_params(built)
  serve = jax.jit(lambda state: learner.serving_params(state, cfg))
  state = params_only(params)
  decode = (built.make_engine(serve(state), sharding=built.trainer_engine_sharding())
            if engine else None)
  log = (MetricsLogger(workdir, tensorboard=config.log.tensorboard)
         if jax.process_index() == 0 else NullLogger(workdir))
  log.write("run", 0, {"params": count_params(params), "devices": jax.device_count(),
                       "processes": jax.process_count()})
  rl = config.rl if "rl" in config else ml_collections.ConfigDict()
  return Run(built, heldout, decode, state, serve, log,
             heldout_fall=FallAlarm(config.eval.get("collapse_fall", COLLAPSE_FALL)),
             train_fall=SuccessFallAlarm(rl.get("collapse_fall", TRAIN_COLLAPSE_FALL),
                                         rl.get("collapse_window", TRAIN_COLLAPSE_WINDOW)),
             watch=RolloutWatch(rl.get("max_all_infra_updates", MAX_ALL_INFRA_UPDATES)))


def run_eval(run: Run, step: int, name: str, params: Any = None) -> dict:
  """Held-out evaluation with the serving params of run.state (or `params`, e.g. gathered
  onto the evaluating process's device)."""
  e = run.config.eval
  run.engine.update_weights(run.serve(run.state) if params is None else params, run.version)
  t0 = time.perf_counter()
  out = evaluate(run.engine, run.env, run.heldout, k=e.k, n=e.n, temperature=e.temperature,
                 max_new_tokens=run.config.rl.max_new_tokens, seed=e.seed,
                 failures=run.failures)
  out["eval_s"] = time.perf_counter() - t0
  if name != "init":  # the random model's score is no baseline
    out |= run.heldout_fall.update(out["pass1"])
    if out["collapse_alarm"]:
      logging.warning("step %d: held-out pass@1 %.3f is %.3f below its best %.3f (%.3f "
                      "below its start %.3f): is the policy collapsing? (see entropy, kl, "
                      "sampled_nll_mean, mismatch_max_abs, ratio_max in metrics.jsonl)",
                      step, out["pass1"], out["pass1_fall_from_best"], run.heldout_fall.best,
                      out["pass1_fall_from_start"], run.heldout_fall.start)
  run.log.write("eval", step, out)
  return out | {"name": name}


def watch_rollouts(run: Run, step: int, stats: dict,
                   first_errors: dict | None = None) -> None:
  """One update's rollout stats into `run.watch`; raises AllInfraFailures (after writing a
  `stopped` record) when every episode of rl.max_all_infra_updates consecutive updates was
  an infra failure. `first_errors`: the first failure of each kind (default: this
  process's, `run.failures.first`)."""
  run.watch.update(step, stats, max_new_tokens=run.config.rl.max_new_tokens,
                   stop_ids=run.env.stop_ids)
  message = run.watch.stop_message(run.failures.first if first_errors is None
                                   else first_errors)
  if message:
    run.log.write("stopped", step, {"all_infra_updates": run.watch.streak,
                                    **run.watch.summary()})
    raise AllInfraFailures(message)


def train_collapse(run: Run, step: int, success_frac: float) -> dict:
  """One update's sampled success fraction into the training signal's collapse alarm
  (`run.train_fall`); its record fields. Warns the first time it fires."""
  out = run.train_fall.update(success_frac)
  if out["train_collapse_alarm"] and run.train_fall.alarms == 1:
    logging.warning("step %d: the sampled success fraction's %d-update mean %.3f is %.3f "
                    "below its start %.3f: is the policy collapsing? (see entropy, kl, "
                    "sampled_nll_mean, ratio_max in metrics.jsonl)", step,
                    run.train_fall.window, out["success_frac_avg"],
                    out["success_fall_from_start"], run.train_fall.start)
  return out


def sft(run: Run, progress: Callable[[Iterator], Iterator] = iter) -> dict:
  """SFT warm start on reference completions of train tasks (fresh optimizer).

  With `sft.target_pass1 > 0` it stops early, at the first `sft.probe_every` boundary where
  greedy pass@1 on a probe set of *train* tasks reaches the target: when a warm start
  "works" varies a lot between seeds (a sharp transition), and GRPO should start from a
  comparable policy whatever the seed. Once the probe passes `sft.slow_down_at`, the
  learning rate is multiplied by `sft.slow_down_factor` and the probe runs every
  `sft.probe_every_slow` steps: at a high constant rate, probed coarsely, the policy jumps
  across the transition (probe 0.5 -> 0.85 in 25 steps), so where it stops would be luck.
  The held-out split is never looked at here.
  """
  c = run.config.sft
  schedule = optax.warmup_cosine_decay_schedule(0.0, c.learning_rate, c.warmup_steps,
                                                max(c.steps, c.warmup_steps + 1),
                                                end_value=c.learning_rate * c.final_lr_frac)

  def make_step(lr_factor: float):
    # the optimizer state does not depend on the schedule: a slower step continues it
    optimizer = learner.make_optimizer(lambda count: schedule(count) * lr_factor,
                                       weight_decay=c.weight_decay)
    return optimizer, learner.make_sft_step(run.cfg, optimizer, numerics=run.numerics,
                                            sharding=run.sharding)

  optimizer, step_fn = make_step(1.0)
  state = learner.init_state(run.state.params, optimizer)
  slowed = False
  tasks = task_stream(run.env, c.num_tasks, run.config.seed + 1)
  shape = run.batch_shape(c.batch_size)
  probe = run.env.prompts("train", c.probe_tasks, run.config.seed + 2) if c.target_pass1 else []
  metrics, probe_pass1, step = {}, 0.0, 0
  t0 = time.perf_counter()
  for step in progress(range(1, c.steps + 1)):
    trajs = [sft_trajectory(run.env, t) for t in itertools.islice(tasks, c.batch_size)]
    batch = build_batch(trajs, np.zeros(len(trajs)), np.ones(len(trajs), bool), **shape)
    state, metrics = step_fn(state, split_microbatches(batch, c.microbatches))
    if step % c.log_every == 0 or step == c.steps:
      run.log.write("sft", step, jax.device_get(metrics))
    if probe and step % (c.probe_every_slow if slowed else c.probe_every) == 0:
      run.engine.update_weights(run.serve(state), 0)
      probe_pass1 = success_rate(greedy_groups(run.engine, run.env, probe, seed=0,
                                               max_new_tokens=run.config.rl.max_new_tokens,
                                               failures=run.failures))
      run.log.write("sft_probe", step, {"train_probe_pass1": probe_pass1})
      if probe_pass1 >= c.target_pass1:
        break
      if not slowed and probe_pass1 >= c.slow_down_at:
        if c.slow_down_factor != 1.0:  # 1.0: only the probe gets finer (no recompile)
          _, step_fn = make_step(c.slow_down_factor)
        slowed = True
        run.log.write("sft_slow_down", step, {"lr_factor": c.slow_down_factor})
  run.state = params_only(state.params)
  out = {"sft_steps": step, "sft_s": time.perf_counter() - t0,
         "sft_nll": float(metrics["nll"]) if "nll" in metrics else None}
  if probe:  # the last line must stay strict JSON: no NaN for "not probed"
    out["sft_train_probe_pass1"] = probe_pass1
  return out


def save_params(run: Run, directory: str) -> None:
  """run.state's params (a LoRA run's GRPO state: the base with its adapters merged, as
  f32), the tree `load_params` and `experiments/export_hf.py --params` read."""
  params = run.state.params
  if run.base is not None:
    params = jax.tree.map(lambda x: x.astype(jnp.float32), run.serve(run.state))
  with Checkpointer(directory, keep_last=1, async_save=False) as ckpt:
    ckpt.save(0, {"params": params}, stream_version=None)


def load_params(run: Run, directory: str) -> None:
  with Checkpointer(directory, keep_last=1) as ckpt:
    restored = ckpt.restore({"params": run.state.params})
  run.state = params_only(restored.state["params"])


def check_sft_dir(config: ml_collections.ConfigDict, sft_dir: str) -> None:
  """A warm start must not overwrite an earlier run's SFT checkpoint."""
  if not config.sft.load and config.sft.steps and epath.Path(sft_dir).exists():
    raise FileExistsError(f"{sft_dir} exists (an earlier run's): use a fresh workdir (several "
                          f"trainer processes: a fresh root), or --config.sft.load={sft_dir} "
                          "to start from it")


def warm_start(run: Run, sft_dir: str, progress: Callable[..., Iterator]) -> dict:
  """The SFT checkpoint `sft.load`, or an SFT warm start saved to `sft_dir` (nothing with
  sft.steps 0). Returns the summary's sft fields."""
  c = run.config.sft
  if c.load:
    load_params(run, c.load)
    return {"sft_loaded_from": c.load}
  if not c.steps:
    return {}
  check_sft_dir(run.config, sft_dir)
  out = sft(run, functools.partial(progress, desc="sft"))
  save_params(run, sft_dir)
  return out


@dataclasses.dataclass
class GrpoLearner:
  """The update half of GRPO, shared by the lockstep and the async loop."""

  optimizer: optax.GradientTransformation
  state: learner.TrainState
  step_fn: Callable
  advantages: Callable
  state_sharding: learner.TrainState | None
  # rl.kl_to_start: the frozen start policy (serving dtype) the step scores against
  ref_params: Any = None


def grpo_learner(run: Run, state: learner.TrainState | None = None, *,
                 base: Any = None, reference: Any = None) -> GrpoLearner:
  """The optimizer, train state (fresh from run.state's params, or `state`: a restored
  one) and jitted step of `rl`. `config.lora`: the state is the adapters' (fresh ones, or
  the restored `state`) on a frozen base: `base` (the one a restored state trained on),
  or run.state's serving params; run.state becomes the adapters' state.

  `rl.kl_to_start`: the step also gets the start policy, frozen: run.state's serving
  params now (full fine-tuning; `reference`: the one a restored state started from), or
  with config.lora the base itself (the policy of fresh adapters, bit for bit; no copy).
  One more bf16 copy of the model (full fine-tuning) and one more forward per update."""
  c = run.config.rl
  optimizer = run.built.rl_optimizer()
  lora = run.built.lora
  kl_to_start = run.built.kl_to_start
  if lora is None and base is not None:
    raise ValueError("a frozen base is for config.lora runs only")
  if reference is not None and (lora is not None or not kl_to_start):
    raise ValueError("a reference policy is for config.rl.kl_to_start runs without "
                     "config.lora only (config.lora: the reference is the base)")
  if kl_to_start and lora is None and reference is None:
    if state is not None:
      raise ValueError("config.rl.kl_to_start: a restored state needs the start policy it "
                       "trained against (reference=...)")
    reference = run.serve(run.state)  # a new array: the state's masters move on
  if lora is not None:
    if state is not None and base is None:
      raise ValueError("config.lora: restored adapters need the frozen base they trained on "
                       "(base=...)")
    # the base: run.state's serving params unless given, frozen from here on. Fresh
    # adapters (B = 0) start the policy as the base, bit for bit; run.serve becomes the
    # merge, so the engine, evaluations and the saved final params see the adapted policy.
    if base is None:
      base = run.serve(run.state)
    run.base = base
    if state is None:
      state = learner.init_state(
          lora_lib.init_adapters(run.cfg, lora, jax.random.key(run.config.seed)), optimizer)
    run.serve = functools.partial(learner.serving_params, cfg=run.cfg, base=base, lora=lora)
  elif state is None:
    state = learner.init_state(run.state.params, optimizer)
  state_sharding = None
  if run.sharding is not None:
    state_sharding = learner.state_shardings(run.cfg, optimizer, run.sharding, lora)
    state = jax.device_put(state, state_sharding)
  if lora is not None:  # run.serve takes the adapters' state from here on
    run.state = state
  step_fn = run.built.grpo_step(optimizer, state_sharding)
  if lora is not None:
    step_fn = functools.partial(step_fn, base=base)
    if kl_to_start:
      reference = base
  if reference is not None:
    step_fn = functools.partial(step_fn, ref_params=reference)
  advantages = jax.jit(lambda rewards, group_ids, valid: group_advantages(
      rewards, group_ids, valid, kind=c.advantage, num_groups=c.prompts_per_step))
  return GrpoLearner(optimizer, state, step_fn, advantages, state_sharding, reference)


def rollout_stats(sampled: Sequence[Trajectory]) -> dict:
  """What the policy scored on every episode it sampled for an update (dynamic sampling
  trains on a subset: the batch's own reward_mean is biased towards 0.5)."""
  outcomes = [t.outcome for t in sampled]
  valid = [t.reward for t in sampled if t.outcome != Outcome.INFRA_FAILURE]
  lps = [t.behaviour_logprobs[t.loss_mask] for t in sampled]
  lps = np.concatenate(lps) if lps else np.zeros(0, np.float32)
  reasons = collections.Counter(t.infra_reason if t.infra_reason in INFRA_REASONS else "other"
                                for t in sampled if t.outcome == Outcome.INFRA_FAILURE)
  return {"success_frac": outcomes.count(Outcome.SUCCESS) / max(len(sampled), 1),
          "rollout_reward_mean": float(np.mean(valid)) if valid else 0.0,
          "episodes": len(sampled),
          "infra_failures": outcomes.count(Outcome.INFRA_FAILURE),
          # the verifier's own errors (raised, no number, NaN, timed out), then every
          # reason that occurred (rljax.envs.base.INFRA_REASONS)
          "reward_errors": sum(reasons[r] for r in REWARD_ERRORS),
          **{f"infra_failures_{r}": n for r, n in sorted(reasons.items())},
          # samples that ran out of max_new_tokens (a turn's budget) without a stop token
          "length_frac": sum(t.finish_reason == FinishReason.LENGTH
                             for t in sampled) / max(len(sampled), 1),
          # episodes cut by the context (`rl.overlong` says what training does with them)
          "overlong_frac": sum(t.finish_reason == FinishReason.CONTEXT
                               for t in sampled) / max(len(sampled), 1),
          "completion_tokens_mean": float(np.mean([t.loss_mask.sum() for t in sampled])),
          # -log pi of the sampled tokens: the sampling policy's per-token entropy in
          # expectation (at the sampling temperature); it falls as the policy collapses
          "sampled_nll_mean": float(-np.mean(lps)) if lps.size else 0.0,
          # multi-turn envs: turns, tool calls, tool errors per episode
          **episode_info_means(sampled)}


def in_baseline(t: Trajectory, overlong: str = "score") -> bool:
  """The sample's reward counts in its group's baseline: not an infra failure, and not an
  episode cut by the context where `overlong` drops those."""
  return t.outcome != Outcome.INFRA_FAILURE and not (
      overlong == "drop" and t.finish_reason == FinishReason.CONTEXT)


def has_signal(trajs: Sequence[Trajectory], overlong: str = "score") -> bool:
  """Some two samples of the group's baseline differ in reward: it has an advantage."""
  rewards = {t.reward for t in trajs if in_baseline(t, overlong)}
  return len(rewards) > 1


@dataclasses.dataclass(frozen=True)
class Advantages:
  """Every sample's advantage and whether it trains (False: an infra failure, or an
  episode cut by the context that `rl.overlong` masks or drops), in batch order, and
  their statistics (the update's metrics)."""

  values: np.ndarray  # [S] f32
  valid: np.ndarray  # [S] bool
  stats: dict


def advantages_of(run: Run, grpo_state: GrpoLearner,
                  groups: Sequence[Sequence[Trajectory]]) -> Advantages:
  """The group advantages of one update's `rl.prompts_per_step` groups of `rl.group_size`."""
  c = run.config.rl
  if len(groups) != c.prompts_per_step or any(len(g) != c.group_size for g in groups):
    raise ValueError(f"an update takes {c.prompts_per_step} groups of {c.group_size}")
  trajs = [t for g in groups for t in g]
  rewards = np.array([t.reward for t in trajs], np.float32)
  baseline = np.array([in_baseline(t, c.overlong) for t in trajs])
  cut = np.array([t.finish_reason == FinishReason.CONTEXT for t in trajs])
  group_ids = np.repeat(np.arange(len(groups)), c.group_size)
  adv, stats = grpo_state.advantages(rewards, group_ids, baseline)
  trains = baseline & ~cut if c.overlong == "mask" else baseline
  stats = jax.device_get(stats) | {"overlong_episodes": int(cut.sum())}
  return Advantages(np.asarray(adv, np.float32), trains, stats)


def batch_part(run: Run) -> tuple[int, int]:
  """(this process's part, how many parts) of every update's groups: with several
  processes each packs and feeds only the groups of its part of the batch rows."""
  if jax.process_count() == 1 or run.sharding is None:
    return 0, 1
  return run.sharding.process_part("batch")


def check_batch_parts(run: Run) -> None:
  """Several processes: an update's groups split evenly over the batch parts, and each
  part's packed rows per microbatch split evenly over its devices."""
  part, parts = batch_part(run)
  c = run.config.rl
  if c.prompts_per_step % parts:
    raise ValueError(f"config.rl.prompts_per_step={c.prompts_per_step} groups do not split "
                     f"over the {parts} processes that feed the batch (config.mesh "
                     f"{dict(run.sharding.mesh.shape)})")
  rows = run.batch_shape(c.prompts_per_step * c.group_size // parts)["num_rows"]
  devices = run.sharding.shards("batch") // parts
  if rows % c.microbatches or (rows // c.microbatches) % devices:
    raise ValueError(f"each process packs its {c.prompts_per_step // parts} groups into "
                     f"{rows} rows: config.rl.microbatches={c.microbatches} microbatches of "
                     f"them must split over its {devices} batch devices")


def train_on_groups(run: Run, grpo_state: GrpoLearner,
                    groups: Sequence[Sequence[Trajectory]],
                    advantages: Advantages | None = None) -> dict:
  """One GRPO update; run.version advances. `groups`: the whole batch (`rl.prompts_per_step`
  groups of `rl.group_size` scored episodes; several processes pack and feed only their
  part of it), or this process's part (`batch_part`) with the whole batch's `advantages`
  (the async trainer: only process 0 holds every group). Returns the step's metrics
  (with the advantage statistics where `advantages` is computed here); its
  `mismatch_max_abs` is left out when no token of the batch was sampled by the version
  trained (`mismatch_tokens` 0)."""
  c = run.config.rl
  part, parts = batch_part(run)
  if advantages is None:  # the whole batch, on every process: each trains on its part
    advantages = advantages_of(run, grpo_state, groups)
    groups = groups[part * len(groups) // parts:(part + 1) * len(groups) // parts]
  per_part = len(advantages.values) // parts
  trajs = [t for g in groups for t in g]
  if len(trajs) != per_part:
    raise ValueError(f"part {part} of {parts} of an update holds {per_part} samples, "
                     f"not {len(trajs)}")
  mine = slice(part * per_part, (part + 1) * per_part)
  batch = split_microbatches(
      build_batch(trajs, advantages.values[mine], advantages.valid[mine],
                  with_routing=c.router_replay, **run.batch_shape(per_part)), c.microbatches)
  if jax.process_count() > 1:
    batch = global_batch(batch, run.sharding, first_seq=mine.start,
                         advantages=advantages.values, valid=advantages.valid)
  grpo_state.state, metrics = grpo_state.step_fn(grpo_state.state, batch, run.version)
  metrics = jax.device_get(metrics) | advantages.stats
  run.version += 1
  run.state = grpo_state.state
  run.mismatch.add(float(metrics["mismatch_max_abs"]), int(metrics["mismatch_tokens"]))
  if int(metrics["mismatch_tokens"]) == 0:
    del metrics["mismatch_max_abs"]
  return metrics


def summarize(run: Run, evals: Sequence[dict], wall_s: float, extra: dict) -> dict:
  """The run's summary: held-out results before/after, mismatch, timings, and `extra`."""
  by_name = {e["name"]: e for e in evals}
  k = run.config.eval.k
  out = {
      "config": run.config.name, "env": run.env.name, "seed": run.config.seed,
      "numerics": run.numerics.mode,
      "heldout_pass1_init": by_name["init"]["pass1"],
      "heldout_pass1_before": by_name["before"]["pass1"],
      "heldout_pass1_after": by_name["after"]["pass1"],
      f"heldout_{sampled_key(k)}_before": by_name["before"][sampled_key(k)],
      f"heldout_{sampled_key(k)}_after": by_name["after"][sampled_key(k)],
      "heldout_reward_before": by_name["before"]["reward_greedy"],
      "heldout_reward_after": by_name["after"]["reward_greedy"],
      "heldout_tasks": len(run.heldout),
      "steps": run.version,
      "mismatch_max_abs": run.mismatch.value,  # None: no token was checked
      "mismatch_tokens": run.mismatch.tokens,
      "heldout_max_fall": run.heldout_fall.max_fall,
      "collapse_alarms": run.heldout_fall.alarms,
      # updates whose sampled success moving average was down by rl.collapse_fall
      "train_collapse_alarms": run.train_fall.alarms,
      "train_max_success_fall": run.train_fall.max_fall,
      "rollout_s": round(run.timings["rollout_s"], 1),
      "train_s": round(run.timings["train_s"], 1),
      "wall_s": round(wall_s, 1),
      # every update's episodes: infra failures (by reason), reward-function errors, and
      # updates whose every sample ran out of max_new_tokens
      **run.watch.summary(),
  }
  return out | extra
