"""The synchronous GRPO loop: SFT warm start, then rollouts and updates in lockstep.

    init ─► SFT warm start (or an SFT checkpoint) ─► eval ─► [rollout v ─► update ─► v+1]* ─► eval

One process holds the train state and a DecodeEngine. Each GRPO step samples a group of
episodes per train task with the serving params of version v (the bf16 cast of the f32
masters), scores them with the env, computes group advantages (infra failures left out),
packs them into fixed-shape rows and runs the jitted update, which recomputes the
log-probs with the same bf16 weights (`mismatch_max_abs`: exactly 0.0 in deterministic
mode) and applies importance correction against the engine's behaviour log-probs when the
config switches it on. The engine then gets version v+1 between steps.

Held-out evaluation (greedy pass@1, sampled pass@k) runs at init, after SFT ("before"),
every `eval.every` steps and at the end ("after"). Metrics go to `<workdir>/metrics.jsonl`
and TensorBoard; the reward curve to `<workdir>/reward_curve.png`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rljax import envs
from rljax import sharding as sharding_lib
from rljax.checkpoint import Checkpointer
from rljax.engine.engine import DecodeEngine, SamplingParams
from rljax.envs.base import Env, Task
from rljax.model import ModelConfig, count_params, init_sharded
from rljax.model.packing import aligned_length
from rljax.numerics import Numerics
from rljax.pipeline.evaluate import evaluate, greedy_groups, success_rate
from rljax.pipeline.metrics import MetricsLogger, NullLogger, plot_reward_curve, read_jsonl
from rljax.pipeline.rollout import generate_groups
from rljax.rl import learner
from rljax.rl.advantages import group_advantages
from rljax.rl.batch import build_batch, split_microbatches
from rljax.rl.losses import LossConfig
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory


def make_sharding(mesh_shape: dict[str, int]) -> sharding_lib.Sharding | None:
  """None for a 1-device run (plain jit); otherwise a mesh of the first devices."""
  size = math.prod(int(v) for v in mesh_shape.values())
  if size == 1:
    return None
  return sharding_lib.Sharding(sharding_lib.make_mesh(dict(mesh_shape), jax.devices()[:size]))


def rows_for(num_seqs: int, max_seq_len: int, row_len: int, page_size: int) -> int:
  """Rows that always hold num_seqs sequences of <= max_seq_len tokens under first-fit
  packing: a row that refuses a sequence already holds >= row_len // aligned_max of them."""
  per_row = row_len // aligned_length(max_seq_len, page_size)
  if per_row < 1:
    raise ValueError(f"row_len {row_len} cannot hold a sequence of {max_seq_len} tokens")
  return -(-num_seqs // per_row)


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


@dataclasses.dataclass
class Run:
  """Everything one run holds; built by `setup`, driven by `sft`, `grpo` and `evaluate`."""

  config: ml_collections.ConfigDict
  cfg: ModelConfig
  numerics: Numerics
  sharding: sharding_lib.Sharding | None
  env: Env
  heldout: list[Task]
  engine: DecodeEngine
  state: learner.TrainState
  serve: Callable[[learner.TrainState], Any]
  log: MetricsLogger
  version: int = 0
  mismatch_max_abs: float = 0.0
  timings: dict = dataclasses.field(default_factory=lambda: {"rollout_s": 0.0, "train_s": 0.0})

  @property
  def max_seq_len(self) -> int:
    return self.config.engine.max_seq_len

  def batch_shape(self, num_seqs: int) -> dict[str, int]:
    row_len = self.config.train.row_len
    return dict(row_len=row_len, num_seqs=num_seqs, page_size=self.cfg.page_size,
                num_rows=rows_for(num_seqs, self.max_seq_len, row_len, self.cfg.page_size))


def setup(config: ml_collections.ConfigDict, workdir: str, *, engine: bool = True,
          write_metrics: bool = True) -> Run:
  """The run's model, env, initial params, engine and metrics logger. `engine=False`: no
  DecodeEngine (a trainer of several processes builds one on process 0 only);
  `write_metrics=False`: records are made but not written (processes other than 0)."""
  cfg = ModelConfig.from_dict(config.model.to_dict())
  numerics = Numerics(config.numerics)
  sharding = make_sharding(config.mesh.to_dict())
  env = envs.make(config.env.name, **config.env.kwargs.to_dict())
  if env.tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"the env's tokenizer has {env.tokenizer.vocab_size} ids, the model "
                     f"only {cfg.vocab_size}")
  heldout = env.prompts("held_out", config.eval.num_tasks, config.eval.seed)
  params = init_sharded(cfg, config.seed, sharding, dtype=jnp.float32)
  serve = jax.jit(functools.partial(learner.serving_params, cfg=cfg))
  state = params_only(params)
  decode = None
  if engine:
    decode = DecodeEngine(cfg, serve(state), numerics=numerics,
                          num_slots=config.engine.num_slots,
                          max_seq_len=config.engine.max_seq_len, eos_id=env.tokenizer.eos_id,
                          sharding=sharding)
  log = (MetricsLogger(workdir, tensorboard=config.log.tensorboard) if write_metrics
         else NullLogger(workdir))
  log.write("run", 0, {"params": count_params(params), "devices": jax.device_count(),
                       "processes": jax.process_count()})
  return Run(config, cfg, numerics, sharding, env, heldout, decode, state, serve, log)


def run_eval(run: Run, step: int, name: str) -> dict:
  e = run.config.eval
  run.engine.update_weights(run.serve(run.state), run.version)
  t0 = time.perf_counter()
  out = evaluate(run.engine, run.env, run.heldout, k=e.k, n=e.n, temperature=e.temperature,
                 max_new_tokens=run.config.rl.max_new_tokens, seed=e.seed)
  out["eval_s"] = time.perf_counter() - t0
  run.log.write("eval", step, out)
  return out | {"name": name}


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
                                               max_new_tokens=run.config.rl.max_new_tokens))
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
  with Checkpointer(directory, keep_last=1, async_save=False) as ckpt:
    ckpt.save(0, {"params": run.state.params}, stream_version=None)


def load_params(run: Run, directory: str) -> None:
  with Checkpointer(directory, keep_last=1) as ckpt:
    restored = ckpt.restore({"params": run.state.params})
  run.state = params_only(restored.state["params"])


def loss_config(config: ml_collections.ConfigDict) -> LossConfig:
  return LossConfig(**config.rl.loss.to_dict())


@dataclasses.dataclass
class GrpoLearner:
  """The update half of GRPO, shared by the synchronous and the async loop."""

  optimizer: optax.GradientTransformation
  state: learner.TrainState
  step_fn: Callable
  advantages: Callable
  state_sharding: learner.TrainState | None


def grpo_learner(run: Run, state: learner.TrainState | None = None) -> GrpoLearner:
  """The optimizer, train state (fresh from run.state's params, or `state`: a restored
  one) and jitted step of `rl`."""
  c = run.config.rl
  if c.get("final_lr_frac", 1.0) == 1.0:
    schedule = optax.linear_schedule(0.0, c.learning_rate, max(c.warmup_steps, 1))
  else:  # cosine decay after the warmup: the policy at the last step is not a noisy one
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, c.learning_rate, max(c.warmup_steps, 1), max(c.steps, c.warmup_steps + 1),
        end_value=c.learning_rate * c.final_lr_frac)
  optimizer = learner.make_optimizer(schedule, weight_decay=c.weight_decay,
                                     clip_norm=c.clip_norm, b2=c.adam_b2)
  if state is None:
    state = learner.init_state(run.state.params, optimizer)
  state_sharding = None
  if run.sharding is not None:
    state_sharding = learner.state_shardings(run.cfg, optimizer, run.sharding)
    state = jax.device_put(state, state_sharding)
  step_fn = learner.make_grpo_step(run.cfg, optimizer, numerics=run.numerics,
                                   loss_cfg=loss_config(run.config), replay=c.router_replay,
                                   temperature=c.temperature, sharding=run.sharding,
                                   state_sharding=state_sharding)
  advantages = jax.jit(functools.partial(group_advantages, kind=c.advantage,
                                         num_groups=c.prompts_per_step))
  return GrpoLearner(optimizer, state, step_fn, advantages, state_sharding)


def rollout_stats(sampled: Sequence[Trajectory]) -> dict:
  """What the policy scored on every episode it sampled for an update (dynamic sampling
  trains on a subset: the batch's own reward_mean is biased towards 0.5)."""
  outcomes = [t.outcome for t in sampled]
  valid = [t.reward for t in sampled if t.outcome != Outcome.INFRA_FAILURE]
  return {"success_frac": outcomes.count(Outcome.SUCCESS) / max(len(sampled), 1),
          "rollout_reward_mean": float(np.mean(valid)) if valid else 0.0,
          "infra_failures": outcomes.count(Outcome.INFRA_FAILURE),
          "completion_tokens_mean": float(np.mean([t.loss_mask.sum() for t in sampled]))}


def has_signal(trajs: Sequence[Trajectory]) -> bool:
  """Some two valid (non-infra) samples of the group differ in reward: it has an advantage."""
  rewards = {t.reward for t in trajs if t.outcome != Outcome.INFRA_FAILURE}
  return len(rewards) > 1


def train_on_groups(run: Run, grpo_state: GrpoLearner,
                    groups: Sequence[Sequence[Trajectory]]) -> dict:
  """One GRPO update on `rl.prompts_per_step` groups of `rl.group_size` scored episodes;
  run.version advances. Returns the step's metrics (with advantage statistics)."""
  c = run.config.rl
  if len(groups) != c.prompts_per_step or any(len(g) != c.group_size for g in groups):
    raise ValueError(f"an update takes {c.prompts_per_step} groups of {c.group_size}")
  trajs = [t for g in groups for t in g]
  rewards = np.array([t.reward for t in trajs], np.float32)
  valid = np.array([t.outcome != Outcome.INFRA_FAILURE for t in trajs])
  group_ids = np.repeat(np.arange(len(groups)), c.group_size)
  adv, adv_stats = grpo_state.advantages(rewards, group_ids, valid)
  batch = build_batch(trajs, np.asarray(adv), valid, with_routing=c.router_replay,
                      **run.batch_shape(len(trajs)))
  grpo_state.state, metrics = grpo_state.step_fn(
      grpo_state.state, split_microbatches(batch, c.microbatches), run.version)
  metrics = jax.device_get(metrics | adv_stats)
  run.version += 1
  run.state = grpo_state.state
  run.mismatch_max_abs = max(run.mismatch_max_abs, float(metrics["mismatch_max_abs"]))
  return metrics


def grpo(run: Run, progress: Callable[[Iterator], Iterator] = iter,
         on_step: Callable[[dict], None] | None = None) -> dict:
  """`rl.steps` synchronous GRPO steps; returns run totals: rl_wall_s (the loop, evals
  between steps included) and ttb_s (mean time-to-trainable-batch: a step's rollout)."""
  start = time.perf_counter()
  c = run.config.rl
  grpo_state = grpo_learner(run)
  tasks = task_stream(run.env, c.num_tasks, run.config.seed)
  sampling = SamplingParams(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                            max_new_tokens=c.max_new_tokens)
  e = run.config.eval
  rounds = c.get("dynamic_sampling_rounds", 1)
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
                              group_size=c.group_size, sampling=sampling,
                              seed=run.config.seed, first_request_id=next_request)
      next_request += n
      sampled += [t for g in drawn for t in g.trajectories]
      drawn.sort(key=lambda g: not has_signal(g.trajectories))  # stable: signal first
      groups += [g for g in drawn if round_ == rounds or has_signal(g.trajectories)][:need]
      if len(groups) == c.prompts_per_step:
        break
    t1 = time.perf_counter()
    metrics = train_on_groups(run, grpo_state, [g.trajectories for g in groups])
    t2 = time.perf_counter()
    run.engine.update_weights(run.serve(run.state), run.version)
    run.timings["rollout_s"] += t1 - t0
    run.timings["train_s"] += t2 - t1
    record = run.log.write("grpo", run.version, metrics | rollout_stats(sampled) | {
        "groups_sampled": len(sampled) // c.group_size,
        "rollout_s": t1 - t0, "train_s": t2 - t1,
        "rollout_tok_s": sum(int(t.loss_mask.sum()) for t in sampled) / max(t1 - t0, 1e-9)})
    if on_step is not None:
      on_step(record)
    if e.every and step % e.every == 0 and step != c.steps:
      run_eval(run, run.version, f"step{step}")
  return {"steps": c.steps, "rl_wall_s": round(time.perf_counter() - start, 2),
          "ttb_s": round(run.timings["rollout_s"] / max(c.steps, 1), 3)}


def summarize(run: Run, evals: Sequence[dict], wall_s: float, extra: dict) -> dict:
  by_name = {e["name"]: e for e in evals}
  k = run.config.eval.k
  out = {
      "config": run.config.name, "env": run.env.name, "seed": run.config.seed,
      "numerics": run.numerics.mode,
      "heldout_pass1_init": by_name["init"]["pass1"],
      "heldout_pass1_before": by_name["before"]["pass1"],
      "heldout_pass1_after": by_name["after"]["pass1"],
      f"heldout_pass{k}_before": by_name["before"][f"pass{k}"],
      f"heldout_pass{k}_after": by_name["after"][f"pass{k}"],
      "heldout_reward_before": by_name["before"]["reward_greedy"],
      "heldout_reward_after": by_name["after"]["reward_greedy"],
      "heldout_tasks": len(run.heldout),
      "steps": run.version,
      "mismatch_max_abs": run.mismatch_max_abs,
      "rollout_s": round(run.timings["rollout_s"], 1),
      "train_s": round(run.timings["train_s"], 1),
      "wall_s": round(wall_s, 1),
  }
  return out | extra


def run_experiment(config: ml_collections.ConfigDict, workdir: str, *,
                   progress: Callable[..., Iterator] | None = None) -> dict:
  """The whole synchronous experiment; returns the summary (also the last JSONL record)."""
  t0 = time.perf_counter()
  bar = progress or (lambda it, **_: iter(it))
  sft_dir = os.path.join(os.path.abspath(workdir), "sft_checkpoint")
  if not config.sft.load and config.sft.steps and os.path.exists(sft_dir):
    raise FileExistsError(f"{sft_dir} exists (an earlier run's): use a fresh workdir, or "
                          f"--config.sft.load={sft_dir} to start from it")
  run = setup(config, workdir)
  evals = [run_eval(run, 0, "init")]
  extra: dict[str, Any] = {}
  if config.sft.load:
    load_params(run, config.sft.load)
    extra["sft_loaded_from"] = config.sft.load
  elif config.sft.steps:
    extra |= sft(run, functools.partial(bar, desc="sft"))
    save_params(run, sft_dir)
  evals.append(run_eval(run, 0, "before"))
  extra |= grpo(run, functools.partial(bar, desc="grpo"))
  evals.append(run_eval(run, run.version, "after"))
  summary = summarize(run, evals, time.perf_counter() - t0, extra)
  run.log.write("summary", run.version, {k: v for k, v in summary.items()
                                         if isinstance(v, (int, float))})
  run.log.close()
  plot_reward_curve(read_jsonl(run.log.jsonl_path), os.path.join(workdir, "reward_curve.png"),
                    title=f"{config.name} seed {config.seed} ({run.numerics.mode})")
  return summary
