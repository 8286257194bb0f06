"""What crosses storage between the async trainer and its rollout hosts: tasks out (JSON
payloads of a work-queue group) and finished groups back (numeric arrays only, token in,
token out; rewards and outcomes as codes). Lossless both ways: a group decoded on the
trainer is bit for bit the Trajectories the host's engine produced.

Result arrays of a group of G samples (T_i = prompt + completion tokens of sample i):
  lengths     [G, 2] int32    prompt and completion length of each sample
  tokens      [sum T_i] int32 every sample's prompt then completion, concatenated
  loss_mask   [sum C_i] bool, behaviour_logprobs [sum C_i] f32, versions [sum C_i] int32
  expert_ids  [sum T_i, layers, k] int32 (absent for a dense model)
  finish      [G] int8 (FINISH_CODES), outcome [G] int8 (OUTCOME_CODES), reward [G] f32
  sample_index [G] int32
  infra_reason [G] int8 (REASON_CODES: "" or an entry of rljax.envs.base.INFRA_REASONS;
               absent in a group pushed before it existed: all "")
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rljax.envs.base import INFRA_REASONS, Task
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory

FINISH_CODES = {r: i for i, r in enumerate(FinishReason)}
OUTCOME_CODES = {o: i for i, o in enumerate(Outcome)}
REASONS = ("",) + INFRA_REASONS
REASON_CODES = {r: i for i, r in enumerate(REASONS)}


def task_to_payload(task: Task) -> dict[str, Any]:
  return {"env": task.env, "task_id": task.task_id, "split_key": task.split_key,
          "prompt_ids": [int(t) for t in task.prompt_ids], "answer": task.answer,
          "data": dict(task.data)}


def task_from_payload(payload: Mapping[str, Any]) -> Task:
  try:
    return Task(env=payload["env"], task_id=payload["task_id"], split_key=payload["split_key"],
                prompt_ids=np.asarray(payload["prompt_ids"], np.int32),
                answer=payload["answer"], data=payload.get("data", {}))
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"not a task payload: {e!r}") from e


def group_to_arrays(trajs: Sequence[Trajectory]) -> dict[str, np.ndarray]:
  if not trajs:
    raise ValueError("a group has at least one trajectory")
  out = {
      "lengths": np.array([[len(t.prompt_ids), len(t.completion_ids)] for t in trajs],
                          np.int32),
      "tokens": np.concatenate([t.tokens for t in trajs]).astype(np.int32),
      "loss_mask": np.concatenate([t.loss_mask for t in trajs]).astype(bool),
      "behaviour_logprobs": np.concatenate([t.behaviour_logprobs for t in trajs]
                                           ).astype(np.float32),
      "versions": np.concatenate([t.versions for t in trajs]).astype(np.int32),
      "finish": np.array([FINISH_CODES[FinishReason(t.finish_reason)] for t in trajs], np.int8),
      "outcome": np.array([OUTCOME_CODES[Outcome(t.outcome)] for t in trajs], np.int8),
      "reward": np.array([t.reward for t in trajs], np.float32),
      "sample_index": np.array([t.sample_index for t in trajs], np.int32),
      "infra_reason": np.array([REASON_CODES.get(t.infra_reason, REASON_CODES["other"])
                                for t in trajs], np.int8),
  }
  if trajs[0].expert_ids is not None:
    out["expert_ids"] = np.concatenate([t.expert_ids for t in trajs]).astype(np.int32)
  return out


def group_from_arrays(arrays: Mapping[str, np.ndarray], group_id: int) -> list[Trajectory]:
  """Inverse of group_to_arrays; raises ValueError on arrays that do not add up."""
  try:
    lengths = np.asarray(arrays["lengths"])
    finishes, outcomes = list(FinishReason), list(Outcome)
    total = lengths.sum(axis=0)
    if (len(arrays["tokens"]) != total.sum() or len(arrays["loss_mask"]) != total[1]
        or len(arrays["finish"]) != len(lengths)):
      raise ValueError("array lengths do not match the per-sample lengths")
    reasons = (arrays["infra_reason"] if "infra_reason" in arrays
                else np.zeros(len(lengths), np.int8))
    trajs, tok, comp = [], 0, 0
    for i, (p, c) in enumerate(lengths):
      tokens = arrays["tokens"][tok:tok + p + c]
      experts = arrays["expert_ids"][tok:tok + p + c] if "expert_ids" in arrays else None
      trajs.append(Trajectory(
          prompt_ids=tokens[:p], completion_ids=tokens[p:],
          loss_mask=arrays["loss_mask"][comp:comp + c],
          behaviour_logprobs=arrays["behaviour_logprobs"][comp:comp + c],
          versions=arrays["versions"][comp:comp + c], expert_ids=experts,
          finish_reason=finishes[int(arrays["finish"][i])], request_id=group_id,
          group_id=group_id, sample_index=int(arrays["sample_index"][i]),
          reward=float(arrays["reward"][i]), outcome=outcomes[int(arrays["outcome"][i])],
          infra_reason=REASONS[int(reasons[i])]))
      tok, comp = tok + p + c, comp + c
    return trajs
  except (KeyError, IndexError) as e:
    raise ValueError(f"not a group result: {e!r}") from e
