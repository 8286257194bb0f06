"""One GRPO update, shared by the lockstep and the async loop: `grpo_learner` makes the
optimizer, state and jitted step of the `rl` block, `advantages_of` the group advantages
of one update's groups, and `train_on_groups` runs the update on scored groups (several
processes: each feeds its part of the batch, `batch_part`).

The update recomputes the log-probs of the sampled tokens with the same bf16 weights the
engine sampled with; `mismatch_max_abs` is the largest |trainer - behaviour| log-prob over
the tokens sampled by the version being trained (exactly 0.0 in deterministic mode),
with the number of tokens it covers: null, never 0.0, when it covers none. A NaN anywhere
makes it NaN.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from rljax import sharding as sharding_lib
from rljax.model import lora as lora_lib
from rljax.pipeline.core import Run
from rljax.rl import learner
from rljax.rl.advantages import group_advantages
from rljax.rl.batch import build_batch, global_batch, split_microbatches
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory


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
    # a new array: the state's masters move on. Committed, as a restored one (`reference`)
    # is: the step compiles one program for a fresh run and its resume, not two
    reference = sharding_lib.committed(run.serve(run.state))
  if lora is not None:
    if state is not None and base is None:
      raise ValueError("config.lora: restored adapters need the frozen base they trained on "
                       "(base=...)")
    # the base: run.state's serving params unless given, frozen from here on. Fresh
    # adapters (B = 0) start the policy as the base, bit for bit; run.serve becomes the
    # merge, so the engine, evaluations and the saved final params see the adapted policy.
    if base is None:  # committed, as a restored base is (one program: see the reference)
      base = sharding_lib.committed(run.serve(run.state))
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
