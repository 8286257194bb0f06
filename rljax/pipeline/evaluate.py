"""Held-out evaluation on the DecodeEngine: greedy pass@1 and sampled pass@k.

pass@1 is the fraction of tasks whose greedy episode succeeds. pass@k samples n >= k
episodes per task at the given temperature and uses the unbiased estimator of Chen et al.
2021 (HumanEval): 1 - C(n - c, k) / C(n, k) with c successes, averaged over tasks (its key
is `sampled_key(k)`: "pass1_sampled" for k = 1, apart from the greedy "pass1").
Infra failures count as failures here (an eval must not look better because the env broke);
their number is reported.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rljax.engine.engine import DecodeEngine, SamplingParams
from rljax.envs.base import Env, Task
from rljax.pipeline.rollout import (FailureLog, episode_info_means, generate_groups,
                                    outcome_counts)
from rljax.rl.trajectory import Outcome

# eval request ids live far from training ones, so their PRNG streams never coincide
EVAL_REQUEST_BASE = 1 << 30


def sampled_key(k: int) -> str:
  return f"pass{k}" if k > 1 else "pass1_sampled"


def pass_at_k(n: int, c: int, k: int) -> float:
  if not 0 < k <= n or not 0 <= c <= n:
    raise ValueError(f"need 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def greedy_groups(engine: DecodeEngine, env: Env, tasks: Sequence[Task], *,
                  max_new_tokens: int, seed: int, failures: FailureLog | None = None) -> list:
  return generate_groups(engine, env, tasks, group_size=1, seed=seed,
                         sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                         first_request_id=EVAL_REQUEST_BASE, failures=failures)


def success_rate(groups) -> float:
  return float(np.mean([t.outcome == Outcome.SUCCESS for g in groups for t in g.trajectories]))


def evaluate(engine: DecodeEngine, env: Env, tasks: Sequence[Task], *, k: int, n: int,
             temperature: float, max_new_tokens: int, seed: int,
             failures: FailureLog | None = None) -> dict[str, float]:
  """`failures`: where infra failures are logged (a run's: each kind once per run)."""
  greedy = greedy_groups(engine, env, tasks, max_new_tokens=max_new_tokens, seed=seed,
                         failures=failures)
  sampled = generate_groups(engine, env, tasks, group_size=n, seed=seed,
                            sampling=SamplingParams(temperature=temperature,
                                                    max_new_tokens=max_new_tokens),
                            first_request_id=EVAL_REQUEST_BASE + len(tasks),
                            failures=failures)
  success = lambda t: t.outcome == Outcome.SUCCESS  # noqa: E731
  counts = outcome_counts(greedy + sampled)
  return {
      "pass1": success_rate(greedy),
      sampled_key(k): float(np.mean(
          [pass_at_k(n, sum(map(success, g.trajectories)), k) for g in sampled])),
      "reward_greedy": float(np.mean([g.trajectories[0].reward for g in greedy])),
      "infra_failures": counts[Outcome.INFRA_FAILURE.value],
      "tasks": len(tasks),
      # multi-turn envs: the greedy episodes' turns, tool calls, ... per episode
      **{f"greedy_{k}": v for k, v in
         episode_info_means([t for g in greedy for t in g.trajectories]).items()},
  }
