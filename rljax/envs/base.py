"""The env contract: tasks, verdicts, multi-turn steps, and the guards around them.

A task gives prompt token ids. A single-turn episode is one completion; a multi-turn
episode is one growing sequence of policy actions and env observations (the env's `step`
answers each action with observation ids, or ends the episode). A verifier turns the
completion into a `Verdict`: a reward and an `Outcome`:

  success        the answer is right
  model_failure  the answer is wrong, malformed, undecodable, or missing (no EOS)
  infra_failure  the env raised or timed out (`safe_verify` / `safe_step`)

Verifiers never raise on model output, whatever the ids; anything they do raise is an
env bug and is reported as infra_failure, which never enters a gradient or a baseline.
Its `info["reason"]` is one of INFRA_REASONS: the verifier's own errors (REWARD_ERRORS:
it raised, returned something that is not a number or Verdict, returned a NaN or
infinite reward, or overran its deadline), a failed env step, or "other" (an env's own
infra verdict); `info` also holds the error text, its type and (an exception) its
traceback, which the rollout logs once per kind (rljax.pipeline.rollout.FailureLog).

Splits: every task has a `split_key`, the canonical problem (operands sorted for a
commutative op, say). A keyed hash of it decides the split, so one problem is in the same
split whatever the seed, the difficulty settings, or the order of its operands.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import traceback
import types
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from rljax.envs.latency import LatencyModel
from rljax.envs.tokenizer import CharTokenizer, Tokenizer
from rljax.rl.trajectory import Outcome

Split = Literal["train", "held_out"]
SPLITS: tuple[Split, ...] = ("train", "held_out")

# Why an episode is an infra failure (`Verdict.info["reason"]`), in the wire's code order:
# the verifier raised, returned neither a number nor a Verdict, returned a non-finite
# reward, or overran its deadline (REWARD_ERRORS); an env step failed; anything else an
# env reported itself
INFRA_REASONS = ("exception", "bad_return", "nan", "timeout", "step_failed", "other")
REWARD_ERRORS = ("exception", "bad_return", "nan", "timeout")


def infra_reason(verdict: "Verdict") -> str:
  """The INFRA_REASONS entry of an infra-failure verdict ("other" for an env's own)."""
  reason = verdict.info.get("reason") if isinstance(verdict.info, Mapping) else None
  return reason if reason in INFRA_REASONS else "other"


class BadReward(TypeError):
  """A reward function returned something that is not a number or a Verdict."""


def split_of(split_key: str, held_out_fraction: float) -> Split:
  """Deterministic across processes and machines (blake2b, not Python's salted hash)."""
  digest = hashlib.blake2b(split_key.encode(), digest_size=8, person=b"rljax-split").digest()
  return "held_out" if int.from_bytes(digest, "big") < held_out_fraction * 2.0**64 else "train"


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
  env: str
  task_id: str  # the problem as shown (the prompt text); unique within an env
  split_key: str  # the canonical problem; decides the split
  prompt_ids: np.ndarray  # [P] int32, read-only; starts with BOS when the tokenizer has one
  answer: str  # reference answer text, as the policy should write it (without EOS)
  data: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what the verifier needs

  def __post_init__(self):
    ids = np.array(self.prompt_ids, dtype=np.int32)
    ids.flags.writeable = False
    object.__setattr__(self, "prompt_ids", ids)
    object.__setattr__(self, "data", types.MappingProxyType(dict(self.data)))


@dataclasses.dataclass(frozen=True)
class Verdict:
  reward: float
  outcome: Outcome
  info: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def success(cls, **info) -> "Verdict":
    return cls(1.0, Outcome.SUCCESS, info)

  @classmethod
  def model_failure(cls, reason: str, reward: float = 0.0, **info) -> "Verdict":
    return cls(reward, Outcome.MODEL_FAILURE, {"reason": reason, **info})

  @classmethod
  def infra_failure(cls, reason: str, **info) -> "Verdict":
    return cls(0.0, Outcome.INFRA_FAILURE, {"reason": reason, **info})


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation_ids: np.ndarray | None  # appended to the sequence, loss_mask 0
  done: bool
  # set by safe_step when the env raised or timed out, or by the env when its own
  # machinery failed (a sandbox that could not start): the episode is an infra failure
  error: str | None = None
  # numeric facts about the step (e.g. {"tool_calls": 1, "tool_errors": 0}): summed over
  # an episode's steps into its `info` (Episode; the rollout's Trajectory.info)
  info: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SFTTarget:
  """A reference completion for the SFT warm start: train only where loss_mask is True."""
  completion_ids: np.ndarray  # [C] int32, ends with EOS
  loss_mask: np.ndarray  # [C] bool: True on policy tokens, False on observations


@runtime_checkable
class Env(Protocol):
  """`tokenizer` is the one a run uses: the config's, passed to the env's factory as
  `tokenizer=`, or the env's own when it brings one (a factory with `own_tokenizer = True`,
  or `config.tokenizer.kind = "env"`: called without `tokenizer=`; see
  rljax.pipeline.run.make_env). Either way its ids must fit the model's vocabulary."""

  name: str
  tokenizer: Tokenizer
  max_turns: int  # 1 for single-turn envs
  stop_ids: tuple[int, ...]  # tokens that end a policy turn (EOS; also the tool-call close)

  def prompts(self, split: Split, n: int, seed: int) -> list[Task]:
    """n distinct tasks of the split; the same list for the same arguments."""

  def verify(self, task: Task, completion_ids: np.ndarray) -> Verdict:
    ...

  def sft_target(self, task: Task) -> SFTTarget:
    ...


@runtime_checkable
class MultiTurnEnv(Env, Protocol):

  def step(self, task: Task, history_ids: np.ndarray, action_ids: np.ndarray) -> StepResult:
    """history_ids: the completion before this action (actions and observations so far)."""


class BaseEnv:
  """Shared machinery: tokenizer, latency injection, split-aware task generation."""

  name = "base"
  max_turns = 1

  def __init__(self, *, tokenizer: Tokenizer | None = None,
               latency: LatencyModel | None = None, held_out_fraction: float = 0.1):
    if not 0.0 <= held_out_fraction <= 1.0:
      raise ValueError("held_out_fraction must be in [0, 1]")
    self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
    self.latency = latency if latency is not None else LatencyModel()
    self.held_out_fraction = held_out_fraction

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return tuple(self.tokenizer.stop_ids)

  def _sample(self, rng: np.random.Generator) -> Task:
    """One random task of either split."""
    raise NotImplementedError

  def prompts(self, split: Split, n: int, seed: int) -> list[Task]:
    """Draws tasks from `np.random.default_rng(seed)` and keeps the first n distinct ones
    of `split`; a prefix of the list for a larger n. Raises if the problem space is too
    small to hold n of them."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    rng = np.random.default_rng(seed)
    tasks: dict[str, Task] = {}
    for _ in range(100 * n + 1000):
      if len(tasks) == n:
        break
      task = self._sample(rng)
      if task.task_id not in tasks and split_of(task.split_key, self.held_out_fraction) == split:
        tasks[task.task_id] = task
    if len(tasks) < n:
      raise ValueError(f"{self.name}: found only {len(tasks)} distinct {split} tasks of "
                       f"{n}; widen the difficulty settings")
    return list(tasks.values())

  def _prompt_ids(self, text: str) -> np.ndarray:
    """The prompt as the policy sees it: one user message through the chat template when
    the tokenizer renders prompts that way (`chat_template`), else BOS (if any) + text."""
    if getattr(self.tokenizer, "chat_template", None) is True:
      return self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids = self.tokenizer.encode(text)
    if self.tokenizer.bos_id is not None:
      ids = np.concatenate([[self.tokenizer.bos_id], ids])
    return ids.astype(np.int32)

  def _decode(self, ids: np.ndarray) -> str | None:
    """Model ids as text, or None when they are not valid tokens (a model failure)."""
    try:
      return self.tokenizer.decode(ids)
    except ValueError:
      return None

  def _until_eos(self, completion_ids: np.ndarray) -> np.ndarray | None:
    """The ids before the first of the tokenizer's stop ids (EOS, say <|endoftext|>)."""
    ids = np.asarray(completion_ids).reshape(-1)
    eos = np.flatnonzero(np.isin(ids, self.tokenizer.stop_ids))
    return ids[:eos[0]] if len(eos) else None

  def _answer_text(self, completion_ids: np.ndarray) -> str | Verdict:
    """The completion's text before its first stop id after the injected latency, or the
    verdict of a completion that has no stop id ("no eos") or undecodable ids."""
    self.latency.sleep()
    ids = self._until_eos(completion_ids)
    if ids is None:
      return Verdict.model_failure("no eos")
    text = self._decode(ids)
    return Verdict.model_failure("undecodable") if text is None else text

  def _target(self, text: str) -> SFTTarget:
    ids = np.concatenate([self.tokenizer.encode(text), [self.tokenizer.eos_id]]).astype(np.int32)
    return SFTTarget(ids, np.ones(len(ids), dtype=bool))


# ---------------------------------------------------------------------------- the guards


class _Timeout(Exception):
  pass


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
  """Runs fn in a daemon thread; raises _Timeout if it has not returned by the deadline.

  A thread cannot be killed: a verifier that never returns leaks one daemon thread (it
  does not block the caller or interpreter exit). Code that may hang belongs in a worker
  process that is killed at its deadline (`rljax.envs.processes.ProcessPool`, as the
  dataset env's `verifier_processes` runs its reward_fn); the built-in verifiers only
  parse text.
  """
  box: dict[str, Any] = {}

  def target():
    try:
      box["value"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      box["error"] = e

  thread = threading.Thread(target=target, daemon=True, name="rljax-env-call")
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise _Timeout(f"no answer within {timeout_s}s")
  if "error" in box:
    raise box["error"]
  return box["value"]


def _traceback(e: BaseException) -> str:
  """The traceback of `e`: a worker process's own when it carries one (`remote_traceback`,
  rljax.envs.processes.CallFailed), else this process's (a verifier thread's frames
  included: call_with_timeout re-raises the thread's exception object)."""
  remote = getattr(e, "remote_traceback", "")
  return remote or "".join(traceback.format_exception(type(e), e, e.__traceback__))


def safe_verify(env: Env, task: Task, completion_ids: np.ndarray, *,
                timeout_s: float = 10.0) -> Verdict:
  """env.verify, but an env that raises, hangs past timeout_s, or returns something that
  is not a Verdict with a finite reward yields infra_failure instead; its reason is one
  of REWARD_ERRORS, its info the error text, the error's type and (an exception) its
  traceback."""
  try:
    verdict = call_with_timeout(lambda: env.verify(task, completion_ids), timeout_s)
  # TimeoutError: the env's own deadline (a verifier process it killed, say)
  except (_Timeout, TimeoutError) as e:
    return Verdict.infra_failure("timeout", error=str(e), error_type="timeout")
  except BadReward as e:
    return Verdict.infra_failure("bad_return", error=str(e), error_type="bad_return")
  except Exception as e:  # pylint: disable=broad-except
    kind = getattr(e, "error_type", None) or type(e).__name__
    return Verdict.infra_failure("exception", error=f"{type(e).__name__}: {e}",
                                 error_type=kind, traceback=_traceback(e))
  if not isinstance(verdict, Verdict):
    return Verdict.infra_failure(
        "bad_return", error_type="bad_return",
        error=f"verify returned {type(verdict).__name__} {_short(verdict)}, not a Verdict")
  reward = verdict.reward
  if not isinstance(reward, (int, float, np.number, np.bool_)):
    return Verdict.infra_failure(
        "bad_return", error_type="bad_return",
        error=f"a Verdict whose reward is {type(reward).__name__} {_short(reward)}, not a number")
  if not np.isfinite(reward):
    return Verdict.infra_failure("nan", error=f"a reward of {float(reward)}", error_type="nan")
  return verdict


def _short(value: Any, limit: int = 200) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def safe_step(env: MultiTurnEnv, task: Task, history_ids: np.ndarray, action_ids: np.ndarray,
              *, timeout_s: float = 10.0) -> StepResult:
  """env.step, but an env that raises or hangs ends the episode with `error` set (the
  caller labels the episode infra_failure)."""
  try:
    result = call_with_timeout(lambda: env.step(task, history_ids, action_ids), timeout_s)
  except _Timeout as e:
    return StepResult(None, True, error=f"timeout: {e}")
  except Exception as e:  # pylint: disable=broad-except
    return StepResult(None, True, error=f"exception: {type(e).__name__}: {e}")
  if not isinstance(result, StepResult):
    return StepResult(None, True, error=f"bad step result: {result!r}")
  return result


def add_step_info(totals: dict, result: StepResult) -> None:
  """Adds a step's numeric info to an episode's totals (non-numbers are left out)."""
  for key, value in result.info.items():
    if isinstance(value, (int, float, np.number)):
      totals[key] = totals.get(key, 0) + value


@dataclasses.dataclass(frozen=True)
class Episode:
  completion_ids: np.ndarray  # [C] int32: actions and observations, in order
  loss_mask: np.ndarray  # [C] bool: True on action tokens
  verdict: Verdict
  turns: int
  info: dict = dataclasses.field(default_factory=dict)  # {"turns": ...} + summed step info


def rollout(env: Env, task: Task, policy: Callable[[np.ndarray], Sequence[int]], *,
            timeout_s: float = 10.0) -> Episode:
  """Reference episode loop (one sequence that only grows). policy(ids so far, prompt
  included) returns the next action's ids, ending in one of env.stop_ids or truncated.
  The batched engine runs the same protocol; this is its executable specification."""
  parts: list[np.ndarray] = []
  mask: list[np.ndarray] = []
  history = np.zeros(0, np.int32)
  turns = 0
  error = None
  info: dict = {}
  for turns in range(1, env.max_turns + 1):
    action = np.asarray(policy(np.concatenate([task.prompt_ids, history])), np.int32)
    parts.append(action)
    mask.append(np.ones(len(action), bool))
    if env.max_turns == 1 or not isinstance(env, MultiTurnEnv):
      history = np.concatenate(parts)
      break
    result = safe_step(env, task, history, action, timeout_s=timeout_s)
    add_step_info(info, result)
    if result.observation_ids is not None:
      parts.append(np.asarray(result.observation_ids, np.int32))
      mask.append(np.zeros(len(result.observation_ids), bool))
    history = np.concatenate(parts)
    if result.error is not None:
      error = result.error
      break
    if result.done:
      break
  if error is not None:
    verdict = Verdict.infra_failure("step_failed", error=error, error_type="step_failed")
  else:
    verdict = safe_verify(env, task, history, timeout_s=timeout_s)
  return Episode(history.astype(np.int32), np.concatenate(mask), verdict, turns,
                 {"turns": turns, **info} if isinstance(env, MultiTurnEnv)
                 and env.max_turns > 1 else {})
