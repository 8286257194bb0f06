"""Trajectory: what crosses every boundary (engine -> trainer, host -> storage). Token ids
only, never strings (token in, token out)."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


class Outcome(str, enum.Enum):
  SUCCESS = "success"
  MODEL_FAILURE = "model_failure"  # the policy's fault: wrong or malformed answer
  INFRA_FAILURE = "infra_failure"  # env raised or timed out: never in a gradient or baseline
  UNKNOWN = "unknown"


class FinishReason(str, enum.Enum):
  EOS = "eos"
  STOP = "stop"  # a stop token other than EOS
  LENGTH = "length"  # the turn's max new tokens
  ABORTED = "aborted"
  # the sequence reached the context (the engine's max_seq_len), or a multi-turn episode's
  # next observation did not fit in it: the episode was cut (`config.rl.overlong` says
  # what training does with it). Last, so the wire's codes of the others stay as they were.
  CONTEXT = "context"


@dataclasses.dataclass
class Trajectory:
  """One sample. Positions 0..P-1 are the prompt, P..P+C-1 the completion.

  For multi-turn episodes the completion holds every turn's actions and observations in
  order (the sequence only ever grows); observations have loss_mask 0.
  """

  prompt_ids: np.ndarray  # [P] int32
  completion_ids: np.ndarray  # [C] int32
  loss_mask: np.ndarray  # [C] bool: True on tokens the policy produced
  behaviour_logprobs: np.ndarray  # [C] f32: log-prob under the sampling distribution; 0 off-mask
  versions: np.ndarray  # [C] int32: policy version that produced each token; -1 off-mask
  expert_ids: np.ndarray | None  # [P + C, num_moe_layers, k] int32 routing of each input token
  finish_reason: FinishReason
  request_id: int = -1
  group_id: int = -1
  sample_index: int = 0
  reward: float = float("nan")
  outcome: Outcome = Outcome.UNKNOWN
  # multi-turn episodes: {"turns": n} + the env's step info summed over the episode
  # (e.g. tool_calls, tool_errors), set by the rollout; local to the process that ran the
  # episode (the wire carries arrays only: a rollout host's groups arrive without it)
  info: dict = dataclasses.field(default_factory=dict)
  # an infra failure's reason (rljax.envs.base.INFRA_REASONS; "" otherwise), set by the
  # rollout from its verdict; the wire carries it as a code
  infra_reason: str = ""

  def __post_init__(self):
    c = len(self.completion_ids)
    for name in ("loss_mask", "behaviour_logprobs", "versions"):
      if len(getattr(self, name)) != c:
        raise ValueError(f"{name} has length {len(getattr(self, name))}, completion has {c}")
    if self.expert_ids is not None and len(self.expert_ids) != len(self.prompt_ids) + c:
      raise ValueError("expert_ids must have one row per prompt and completion token")

  @classmethod
  def from_sequence(cls, tokens, prompt_len: int, loss_mask, logprobs, versions,
                    **fields) -> "Trajectory":
    """A trajectory of one sampled sequence as it was recorded (lists per completion
    token): tokens split at `prompt_len`, the rest as arrays of their dtypes."""
    return cls(prompt_ids=np.asarray(tokens[:prompt_len], np.int32),
               completion_ids=np.asarray(tokens[prompt_len:], np.int32),
               loss_mask=np.asarray(loss_mask, bool),
               behaviour_logprobs=np.asarray(logprobs, np.float32),
               versions=np.asarray(versions, np.int32), **fields)

  @property
  def tokens(self) -> np.ndarray:
    return np.concatenate([self.prompt_ids, self.completion_ids]).astype(np.int32)

  @property
  def oldest_version(self) -> int:
    v = self.versions[self.loss_mask]
    return int(v.min()) if len(v) else -1
