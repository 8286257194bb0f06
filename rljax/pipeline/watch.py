"""What the episodes of each update say about the env, not the policy.

`rollout_stats` is what the policy scored on every episode it sampled for an update.
Infra failures (rljax.envs.base.INFRA_REASONS: a reward function that raised, returned no
number or NaN, or timed out; a failed env step) are counted in every update's record
(`infra_failures`, `reward_errors`, `infra_failures_<reason>`) and the summary;
`RolloutWatch` stops the run (`AllInfraFailures`) when every episode of
`rl.max_all_infra_updates` (3; 0: never) consecutive updates was one, and warns when
every sample of an update ran out of `rl.max_new_tokens` without a stop token.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from absl import logging
import numpy as np

from rljax.envs.base import INFRA_REASONS, REWARD_ERRORS
from rljax.pipeline.rollout import episode_info_means
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory

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
