"""Envs: tasks (prompt token ids), verifiers (reward + outcome), tokenizers.

  env = make("arithmetic", max_digits=3, ops=("+", "*"))
  tasks = env.prompts("train", n=256, seed=0)
  verdict = safe_verify(env, tasks[0], completion_ids, timeout_s=5.0)

Single-turn: arithmetic, countdown. Multi-turn (tool use, one growing sequence):
calculator. `rollout` is the reference episode loop; `LatencyModel` injects slow-sandbox
delays.
"""

from rljax.envs.arithmetic import ArithmeticEnv
from rljax.envs.base import (SPLITS, BaseEnv, Env, Episode, MultiTurnEnv, SFTTarget, Split,
                             StepResult, Task, Verdict, rollout, safe_step, safe_verify,
                             split_of)
from rljax.envs.calculator import CalculatorEnv
from rljax.envs.countdown import CountdownEnv
from rljax.envs.latency import LatencyModel
from rljax.envs.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

ENVS = {cls.name: cls for cls in (ArithmeticEnv, CountdownEnv, CalculatorEnv)}


def make(name: str, **kwargs) -> BaseEnv:
  """ENVS[name](**kwargs); a `latency` given as a dict (a config's) becomes a LatencyModel."""
  if name not in ENVS:
    raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
  if isinstance(kwargs.get("latency"), dict):
    kwargs["latency"] = LatencyModel(**kwargs["latency"])
  return ENVS[name](**kwargs)


__all__ = ["ArithmeticEnv", "BaseEnv", "CalculatorEnv", "CharTokenizer", "CountdownEnv", "ENVS",
           "Env", "Episode", "HFTokenizer", "LatencyModel", "MultiTurnEnv", "SFTTarget",
           "SPLITS", "Split", "StepResult", "Task", "Tokenizer", "Verdict", "make", "rollout",
           "safe_step", "safe_verify", "split_of"]
