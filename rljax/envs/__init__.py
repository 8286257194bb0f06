"""Envs: tasks (prompt token ids), verifiers (reward + outcome), tokenizers.

  env = make("arithmetic", max_digits=3, ops=("+", "*"))
  tasks = env.prompts("train", n=256, seed=0)
  verdict = safe_verify(env, tasks[0], completion_ids, timeout_s=5.0)

Single-turn: arithmetic, countdown, dataset (rows of a JSONL/parquet file scored by a
reward function). Multi-turn (tool use, one growing sequence): calculator, python_tool
(model-written code run in `sandbox.run_python`), function_call (a `multiply` tool called
through the chat template's `<tool_call>`, the token sequence the OpenAI endpoint
records). An env of your own:
`make("package.module:factory", **kwargs)` calls factory(**kwargs) (with the `tokenizer=`
it is given) and checks that it returns an Env. A factory that brings its own tokenizer
says so with `factory.own_tokenizer = True` (`brings_tokenizer`): a run then calls it
without `tokenizer=` and uses `env.tokenizer` (rljax.pipeline.run.make_env). `rollout` is
the reference episode loop; `LatencyModel` injects slow-sandbox delays.
"""

from typing import Callable

from rljax.envs.arithmetic import ArithmeticEnv
from rljax.envs.base import (SPLITS, BaseEnv, Env, Episode, MultiTurnEnv, SFTTarget, Split,
                             StepResult, Task, Verdict, rollout, safe_step, safe_verify,
                             split_of)
from rljax.envs.calculator import CalculatorEnv
from rljax.envs.countdown import CountdownEnv
from rljax.envs.dataset import DatasetEnv
from rljax.envs.function_call import FunctionCallEnv
from rljax.envs.importing import import_object, is_import_path
from rljax.envs.latency import LatencyModel
from rljax.envs.python_tool import PythonToolEnv
from rljax.envs.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TransformersTokenizer

ENVS = {cls.name: cls for cls in (ArithmeticEnv, CountdownEnv, CalculatorEnv, DatasetEnv,
                                  PythonToolEnv, FunctionCallEnv)}


def factory(name: str) -> Callable[..., Env]:
  """ENVS[name], or the object at import path `name` ("package.module:factory")."""
  if is_import_path(name):
    return import_object(name)
  if name not in ENVS:
    raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}, or an import path "
                     "'package.module:factory'")
  return ENVS[name]


def brings_tokenizer(name: str) -> bool:
  """Whether env `name`'s factory declares `own_tokenizer = True`: it makes its own
  tokenizer (takes no `tokenizer=`), and its env's `tokenizer` is the one a run uses."""
  return getattr(factory(name), "own_tokenizer", False) is True


def make(name: str, **kwargs) -> Env:
  """ENVS[name](**kwargs), or the factory at import path `name` ("package.module:factory")
  called with kwargs; a `latency` given as a dict (a config's) becomes a LatencyModel."""
  if isinstance(kwargs.get("latency"), dict):
    kwargs["latency"] = LatencyModel(**kwargs["latency"])
  env = factory(name)(**kwargs)
  if is_import_path(name) and not isinstance(env, Env):
    raise ValueError(f"{name} returned {type(env).__name__}, which is not an Env (name, "
                     "tokenizer, max_turns, stop_ids, prompts, verify, sft_target)")
  return env


__all__ = ["ArithmeticEnv", "BaseEnv", "CalculatorEnv", "CharTokenizer", "CountdownEnv",
           "DatasetEnv", "ENVS", "Env", "Episode", "FunctionCallEnv", "HFTokenizer",
           "LatencyModel", "MultiTurnEnv", "PythonToolEnv", "SFTTarget", "SPLITS", "Split",
           "StepResult", "Task", "Tokenizer", "TransformersTokenizer", "Verdict",
           "brings_tokenizer", "factory", "import_object", "make", "rollout", "safe_step",
           "safe_verify", "split_of"]
