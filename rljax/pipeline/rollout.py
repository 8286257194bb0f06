"""Episodes on the DecodeEngine: a GRPO group per task, for single- and multi-turn envs.

Every task becomes one engine request with `n = group_size` samples (one prefill, shared
prompt pages). A single-turn sample is verified when it finishes. A multi-turn sample is
parked at the end of each turn (`keep_pages=True`); the env's `step` answers the turn's
action with observation ids, which `DecodeEngine.extend` appends (only the new tokens are
prefilled), until the env says done, the turn budget is spent or the sequence is full.
The episode is one growing sequence; its final Trajectory carries every turn's tokens,
with observations off the loss mask. This is `rljax.envs.rollout`'s protocol, batched.

Long episodes: the context (`engine.max_seq_len`) bounds an episode. One that reaches it
(a turn stopped by the context, or an observation that does not fit after the last
action) ends there, truncated: it keeps every token it has, is verified on what it did,
and finishes with `FinishReason.CONTEXT`. What training does with it is the trainer's
choice (`config.rl.overlong`, `rljax.pipeline.grpo_update.advantages_of`).

Verdicts set `reward` and `outcome` on each Trajectory. An env that raises or times out in
`step` or `verify` (or a verifier that returns no number, or NaN) makes the sample an
infra failure (no gradient, no baseline) with its reason (`Trajectory.infra_reason`, one
of `rljax.envs.base.INFRA_REASONS`); a `FailureLog` logs the first failure of each kind
(reason and error type) with its traceback and task, and counts them all. Verifier
calls run on worker threads while the engine decodes the other samples: a slow verifier
(see `rljax.envs.LatencyModel`) holds up its own sample, not the batch. The env steps of
the samples that ended a turn in the same engine step run concurrently on those threads,
and the engine steps again once all of them answered (a tool call that starts a process,
as the Python tool's sandbox does, costs tens of ms: a batch's calls overlap). A
multi-turn episode's `Trajectory.info` holds its turns and its steps' info summed
(`rljax.envs.base.add_step_info`: tool calls, tool errors).

An engine whose mesh spans several processes (the lockstep trainer's, one per host) is
driven by each of them in lockstep; each runs the env too, but process 0's answers are the
job's (`distributed.broadcast_bytes`): every env step's result before its observation
reaches the engine, and every verdict at the end of `generate_groups`. So a tool whose
outcome depends on timing (a sandbox near its time limit, a verifier past its timeout)
cannot feed the processes different tokens or rewards.

`EpisodeRunner` is the incremental form (the async rollout host adds groups while others
are decoding): `add` submits a group, each `step` is one `engine.step()` and returns the
groups that became complete by then. `generate_groups` is the batch form on top of it. The
sampling key of every token is (seed, request id, sample index, position), so a group's
tokens depend on its request id, never on what else the engine runs beside it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
from typing import Any, Sequence

from absl import logging
import numpy as np

from rljax import distributed
from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.envs.base import (Env, MultiTurnEnv, StepResult, Task, Verdict, add_step_info,
                             infra_reason, safe_step, safe_verify)
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory

_MAX_REQUEST_ID = 2**31 - 1  # request ids enter the sampling keys as int32
_TRACEBACK_CHARS = 4000  # of a first failure, as logged and as a host's status holds it


def describe_task(task: Task) -> str:
  """A task as a failure message names it: its env, its row (a dataset env's) and id."""
  row = task.data.get("row")
  where = f" row {row}" if isinstance(row, int) else ""
  task_id = task.task_id if len(task.task_id) <= 120 else task.task_id[:120] + "..."
  return f"{task.env}{where} task {task_id!r}"


class FailureLog:
  """The infra failures of episodes: the first of each kind (its reason and error type:
  a KeyError and a ZeroDivisionError are two kinds) logged at ERROR with its task and
  traceback, every one counted by reason. Thread-safe."""

  def __init__(self, who: str = ""):
    self.who = who  # "rollout host h0", say; "" for the trainer
    self.counts: collections.Counter[str] = collections.Counter()
    # kind -> {"reason", "task", "error", "traceback"}: the first failure of each kind
    self.first: dict[str, dict[str, Any]] = {}
    self._lock = threading.Lock()

  def report(self, verdict: Verdict, task: Task) -> None:
    reason = infra_reason(verdict)
    info = verdict.info
    error_type = info.get("error_type")
    kind = reason if error_type in (None, reason) else f"{reason}: {error_type}"
    with self._lock:
      self.counts[reason] += 1
      if kind in self.first:
        return
      first = {"reason": reason, "task": describe_task(task),
               "error": str(info.get("error", ""))[:_TRACEBACK_CHARS],
               "traceback": str(info.get("traceback", ""))[-_TRACEBACK_CHARS:]}
      self.first[kind] = first
    log_first_failure(kind, first, self.who)


def log_first_failure(kind: str, first: dict[str, Any], who: str = "") -> None:
  """Logs a failure kind's first occurrence (ERROR): what, where, and its traceback."""
  logging.error("%sinfra failure (%s) of %s: %s%s\n(the first of its kind; the metrics "
                "count every one as infra_failures_%s)", f"{who}: " if who else "", kind,
                first.get("task", "?"), first.get("error", ""),
                f"\n{first['traceback']}" if first.get("traceback") else "", first["reason"])


@dataclasses.dataclass
class Group:
  task: Task
  trajectories: list[Trajectory]
  request_id: int = -1

  @property
  def rewards(self) -> np.ndarray:
    return np.array([t.reward for t in self.trajectories], np.float32)


def is_multi_turn(env: Env) -> bool:
  return env.max_turns > 1 and isinstance(env, MultiTurnEnv)


@dataclasses.dataclass
class _Pending:
  task: Task
  group_size: int
  done: dict[int, Trajectory] = dataclasses.field(default_factory=dict)  # by sample index


class EpisodeRunner:
  """Runs groups of episodes on `engine`, which must carry only this runner's work.

  `add` one group per request id (each id at most once while it runs), `step` until
  `idle`. `verify` calls run on a pool of `env_workers` threads while the engine keeps
  decoding, so a slow verifier delays its own sample only; multi-turn `env.step` calls
  run on the same pool, all those of one engine step at once, and the engine steps again
  only when they have all answered (a parked sequence holds pages the engine cannot take
  back: admitting new prompts while steps wait could leave none for running sequences).
  The engine is driven from the caller's thread (not thread-safe: one loop drives engine
  and runner).
  """

  def __init__(self, engine: DecodeEngine, env: Env, *, sampling: SamplingParams, seed: int,
               timeout_s: float = 10.0, env_workers: int = 64,
               failures: FailureLog | None = None):
    if engine.eos_id != env.tokenizer.eos_id:
      raise ValueError(f"engine eos_id {engine.eos_id} != the env tokenizer's "
                       f"{env.tokenizer.eos_id}")
    if env_workers < 1:
      raise ValueError(f"env_workers must be >= 1, got {env_workers}")
    self.engine, self.env, self.seed, self.timeout_s = engine, env, seed, timeout_s
    self.failures = failures if failures is not None else FailureLog()
    self.multi = is_multi_turn(env)
    # process 0's env answers are every process's (an engine that does not say: one process)
    self.agrees = bool(getattr(engine, "spans_processes", False))
    stops = tuple(t for t in env.stop_ids if t != env.tokenizer.eos_id)
    self.sampling = dataclasses.replace(sampling,
                                        stop_tokens=tuple(sampling.stop_tokens) + stops)
    self._pending: dict[int, _Pending] = {}
    self._turn_start: dict[tuple[int, int], int] = {}  # completion length when a turn began
    self._info: dict[tuple[int, int], dict] = {}  # a running episode's turns and step info
    self._calls = concurrent.futures.ThreadPoolExecutor(env_workers,
                                                        thread_name_prefix="rljax-env")
    self._in_env: dict[concurrent.futures.Future, Trajectory] = {}  # verdicts in flight

  @property
  def busy(self) -> bool:
    """Some added group is not complete yet."""
    return bool(self._pending)

  @property
  def idle(self) -> bool:
    return not self._pending

  @property
  def running(self) -> list[int]:
    """Request ids of the groups not complete yet, in the order they were added."""
    return list(self._pending)

  def close(self) -> None:
    """Stops the env-call threads (waits for calls in flight)."""
    self._calls.shutdown(wait=True)

  def add(self, request_id: int, task: Task, group_size: int) -> None:
    """Submits one engine request: `group_size` samples of `task` (group id = request id)."""
    if (not isinstance(request_id, (int, np.integer)) or isinstance(request_id, bool)
        or not 0 <= request_id <= _MAX_REQUEST_ID):
      raise ValueError(f"request id {request_id!r} is not an int in [0, 2**31)")
    if request_id in self._pending:
      raise ValueError(f"request {request_id} is already running")
    if not isinstance(group_size, (int, np.integer)) or group_size < 1:
      raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    request_id = int(request_id)
    self.engine.submit(Request(request_id, task.prompt_ids, n=int(group_size),
                               sampling=self.sampling, seed=self.seed, group_id=request_id,
                               keep_pages=self.multi))
    self._pending[request_id] = _Pending(task, int(group_size))

  def step(self) -> list[Group]:
    """One `engine.step()` (when the engine has work), then the env calls that returned;
    returns the groups completed (trajectories in sample order), in the order their last
    samples finished. With only env calls outstanding it waits for one (<= 50 ms)."""
    if not self._pending:
      return []
    if not self.engine.idle:
      ended = self.engine.step()
      for traj in ended:
        if traj.request_id not in self._pending:
          raise RuntimeError(f"request {traj.request_id} is not this runner's: the engine "
                             "must carry only the runner's work")
      if self.multi:
        self._turns_ended(ended)
      else:
        for traj in ended:
          self._verify(traj)
    elif not self._in_env:
      raise RuntimeError(f"the engine is idle but requests {self.running} are incomplete")
    else:
      concurrent.futures.wait(self._in_env, timeout=0.05,
                              return_when=concurrent.futures.FIRST_COMPLETED)
    completed = []
    for future in [f for f in self._in_env if f.done()]:
      traj = self._in_env.pop(future)
      verdict = future.result()
      traj.reward, traj.outcome = float(verdict.reward), verdict.outcome
      pending = self._pending[traj.request_id]
      if verdict.outcome == Outcome.INFRA_FAILURE:
        traj.infra_reason = infra_reason(verdict)
        self.failures.report(verdict, pending.task)
      pending.done[traj.sample_index] = traj
      if len(pending.done) == pending.group_size:
        del self._pending[traj.request_id]
        completed.append(Group(pending.task, [pending.done[i] for i in range(pending.group_size)],
                               traj.request_id))
    return completed

  def _verify(self, traj: Trajectory) -> None:
    task = self._pending[traj.request_id].task
    future = self._calls.submit(lambda: safe_verify(self.env, task, traj.completion_ids,
                                                    timeout_s=self.timeout_s))
    self._in_env[future] = traj

  def _turns_ended(self, trajs: Sequence[Trajectory]) -> None:
    """Samples stopped at the end of a turn: each gets the env's next observation (their
    env steps run concurrently; the engine waits for all of them) or ends its episode."""
    steps = []
    for traj in trajs:
      key = (traj.request_id, traj.sample_index)
      start = self._turn_start.pop(key, 0)
      info = self._info.setdefault(key, {"turns": 0})
      info["turns"] += 1
      if traj.finish_reason == FinishReason.CONTEXT:
        self._end_episode(traj, None)  # the sequence is full: no further turn
        continue
      task = self._pending[traj.request_id].task
      history, action = traj.completion_ids[:start], traj.completion_ids[start:]
      steps.append((traj, self._calls.submit(safe_step, self.env, task, history, action,
                                             timeout_s=self.timeout_s)))
    results = [future.result() for _, future in steps]  # the engine's order
    if self.agrees and results:
      results = _agreed_steps(results)
    for (traj, _), result in zip(steps, results):
      add_step_info(self._info[(traj.request_id, traj.sample_index)], result)
      self._after_env_step(traj, result)

  def _after_env_step(self, traj: Trajectory, result) -> None:
    if result.error is None and not result.done:
      obs = np.asarray(result.observation_ids, np.int32)
      room = self.engine.max_seq_len - len(traj.tokens) - len(obs)
      if room >= 1:
        self.engine.extend(traj.request_id, traj.sample_index, obs,
                           min(self.sampling.max_new_tokens, room))
        self._turn_start[(traj.request_id, traj.sample_index)] = (len(traj.completion_ids)
                                                                  + len(obs))
        return
      traj.finish_reason = FinishReason.CONTEXT  # the observation does not fit: cut here
    self._end_episode(traj, result)

  def _end_episode(self, traj: Trajectory, result) -> None:
    self.engine.release(traj.request_id, traj.sample_index)
    traj.info = self._info.pop((traj.request_id, traj.sample_index), {})
    if result is not None and result.error is not None:
      verdict = Verdict.infra_failure("step_failed", error=result.error,
                                      error_type="step_failed")
      done = concurrent.futures.Future()
      done.set_result(verdict)
      self._in_env[done] = traj
      return
    self._verify(traj)


def generate_groups(engine: DecodeEngine, env: Env, tasks: Sequence[Task], *, group_size: int,
                    sampling: SamplingParams, seed: int, first_request_id: int = 0,
                    timeout_s: float = 10.0, failures: FailureLog | None = None
                    ) -> list[Group]:
  """Samples `group_size` episodes per task; returns the groups in task order, each with
  its trajectories in sample order. Request ids are first_request_id + task index.
  `failures`: where infra failures are logged and counted (a run's, across calls)."""
  runner = EpisodeRunner(engine, env, sampling=sampling, seed=seed, timeout_s=timeout_s,
                         failures=failures)
  if not engine.idle:
    raise ValueError("the engine has unfinished work; generate_groups needs it idle")
  for i, task in enumerate(tasks):
    runner.add(first_request_id + i, task, group_size)
  done: dict[int, Group] = {}
  try:
    while runner.busy:
      for group in runner.step():
        done[group.request_id] = group
  finally:
    runner.close()
  groups = [done[first_request_id + i] for i in range(len(tasks))]
  if runner.agrees:
    _agree_verdicts([t for g in groups for t in g.trajectories])
  return groups


def _agreed_steps(results: list[StepResult]) -> list[StepResult]:
  """Process 0's env step results, on every process (a collective: all call it)."""
  theirs = _process_0s([{"obs": None if r.observation_ids is None
                         else np.asarray(r.observation_ids).tolist(),
                         "done": bool(r.done), "error": r.error,
                         "info": {k: float(v) for k, v in r.info.items()}} for r in results],
                       "stepped")
  return [StepResult(None if r["obs"] is None else np.asarray(r["obs"], np.int32), r["done"],
                     r["error"], r["info"]) for r in theirs]


def _agree_verdicts(trajs: list[Trajectory]) -> None:
  """Every trajectory's reward, outcome and infra reason set to process 0's (a
  collective)."""
  theirs = _process_0s([[float(t.reward), t.outcome.value, t.infra_reason] for t in trajs],
                       "verified")
  for t, (reward, outcome, reason) in zip(trajs, theirs):
    t.reward, t.outcome, t.infra_reason = reward, Outcome(outcome), reason


def _process_0s(mine: list, did: str) -> list:
  """Process 0's list (JSON values, one per episode) in place of this process's."""
  theirs = json.loads(distributed.broadcast_bytes(
      json.dumps(mine).encode() if distributed.is_primary() else None))
  if len(theirs) != len(mine):
    raise RuntimeError(f"process 0 {did} {len(theirs)} episodes, this one {len(mine)}: the "
                       "processes drive the engine out of lockstep")
  return theirs


def outcome_counts(groups: Sequence[Group]) -> dict[str, int]:
  counts = {o.value: 0 for o in Outcome}
  for g in groups:
    for t in g.trajectories:
      counts[t.outcome.value] += 1
  return counts


def episode_info_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
  """Per-episode means of the multi-turn episodes' `info` ("turns_per_episode",
  "tool_calls_per_episode", ...; a key an episode lacks counts 0 there); {} when no
  trajectory has info (single-turn envs, or groups that crossed the wire)."""
  infos = [t.info for t in trajs if t.info]
  keys = sorted({k for info in infos for k in info})
  return {f"{k}_per_episode": float(np.mean([info.get(k, 0) for info in infos]))
          for k in keys}
