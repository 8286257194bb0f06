"""Episodes on the DecodeEngine: a GRPO group per task, for single- and multi-turn envs.

Every task becomes one engine request with `n = group_size` samples (one prefill, shared
prompt pages). A single-turn sample is verified when it finishes. A multi-turn sample is
parked at the end of each turn (`keep_pages=True`); the env's `step` answers the turn's
action with observation ids, which `DecodeEngine.extend` appends (only the new tokens are
prefilled), until the env says done, the turn budget is spent or the sequence is full.
The episode is one growing sequence; its final Trajectory carries every turn's tokens,
with observations off the loss mask. This is `rljax.envs.rollout`'s protocol, batched.

Verdicts set `reward` and `outcome` on each Trajectory. An env that raises or times out in
`step` or `verify` makes the sample an infra failure (no gradient, no baseline).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.envs.base import Env, MultiTurnEnv, Task, Verdict, safe_step, safe_verify
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory


@dataclasses.dataclass
class Group:
  task: Task
  trajectories: list[Trajectory]

  @property
  def rewards(self) -> np.ndarray:
    return np.array([t.reward for t in self.trajectories], np.float32)


def is_multi_turn(env: Env) -> bool:
  return env.max_turns > 1 and isinstance(env, MultiTurnEnv)


def generate_groups(engine: DecodeEngine, env: Env, tasks: Sequence[Task], *, group_size: int,
                    sampling: SamplingParams, seed: int, first_request_id: int = 0,
                    timeout_s: float = 10.0) -> list[Group]:
  """Samples `group_size` episodes per task; returns the groups in task order, each with
  its trajectories in sample order. Request ids are first_request_id + task index."""
  if engine.eos_id != env.tokenizer.eos_id:
    raise ValueError(f"engine eos_id {engine.eos_id} != the env tokenizer's "
                     f"{env.tokenizer.eos_id}")
  if not engine.idle:
    raise ValueError("the engine has unfinished work; generate_groups needs it idle")
  multi = is_multi_turn(env)
  stops = tuple(t for t in env.stop_ids if t != env.tokenizer.eos_id)
  sampling = dataclasses.replace(sampling, stop_tokens=tuple(sampling.stop_tokens) + stops)
  by_request = {first_request_id + i: task for i, task in enumerate(tasks)}
  for rid, task in by_request.items():
    engine.submit(Request(rid, task.prompt_ids, n=group_size, sampling=sampling, seed=seed,
                          group_id=rid, keep_pages=multi))
  done: dict[tuple[int, int], Trajectory] = {}
  turn_start: dict[tuple[int, int], int] = {}  # completion length when the turn began
  while not engine.idle:
    for traj in engine.step():
      key = (traj.request_id, traj.sample_index)
      task = by_request[traj.request_id]
      if multi:
        verdict = _end_of_turn(engine, env, task, traj, turn_start, sampling, timeout_s)
        if verdict is None:
          continue  # the episode goes on
      else:
        verdict = safe_verify(env, task, traj.completion_ids, timeout_s=timeout_s)
      traj.reward, traj.outcome = float(verdict.reward), verdict.outcome
      done[key] = traj
  return [Group(task, [done[(rid, i)] for i in range(group_size)])
          for rid, task in by_request.items()]


def _end_of_turn(engine: DecodeEngine, env: MultiTurnEnv, task: Task, traj: Trajectory,
                 turn_start: dict, sampling: SamplingParams, timeout_s: float) -> Verdict | None:
  """Steps the env on the turn that just ended; None while the episode continues."""
  key = (traj.request_id, traj.sample_index)
  start = turn_start.get(key, 0)
  history, action = traj.completion_ids[:start], traj.completion_ids[start:]
  result = None
  if traj.finish_reason != FinishReason.LENGTH or len(traj.tokens) < engine.max_seq_len:
    result = safe_step(env, task, history, action, timeout_s=timeout_s)
  if result is not None and result.error is None and not result.done:
    obs = np.asarray(result.observation_ids, np.int32)
    room = engine.max_seq_len - len(traj.tokens) - len(obs)
    if room >= 1:
      engine.extend(traj.request_id, traj.sample_index, obs, min(sampling.max_new_tokens, room))
      turn_start[key] = len(traj.completion_ids) + len(obs)
      return None
  engine.release(traj.request_id, traj.sample_index)
  if result is not None and result.error is not None:
    return Verdict.infra_failure("step failed", error=result.error)
  return safe_verify(env, task, traj.completion_ids, timeout_s=timeout_s)


def outcome_counts(groups: Sequence[Group]) -> dict[str, int]:
  counts = {o.value: 0 for o in Outcome}
  for g in groups:
    for t in g.trajectories:
      counts[t.outcome.value] += 1
  return counts
