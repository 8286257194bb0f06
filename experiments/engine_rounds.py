"""Engines of one workload timed side by side: what the engine benches share.

`fast_model` is a config's model as these benches run it; `greedy_prompts` makes the workload (`slots` prompts of 16 random token ids, 64 new
tokens each, greedy, no stop token); `generate_rounds` warms every engine up on it
(`warmups` calls each, the first one compiling), then times one `DecodeEngine.generate`
of it per engine per round, the engines alternating (A B C, A B C, ...); `alternate` does
the same for any requests; `median_ratio` is the median of per-round time ratios.
"""

import importlib
import statistics
import time

import jax
import numpy as np

from rljax.engine.engine import Request, SamplingParams
from rljax.model import ModelConfig
from rljax.numerics import Numerics

PROMPT, NEW = 16, 64


def fast_model(name: str, backend: str | None = None, **fields) -> ModelConfig:
  """configs/<name>.py's model with `fields` set, max_position_embeddings raised to
  PROMPT + NEW where smaller, resolved for `backend` (None: JAX's default) in fast
  numerics."""
  shape = importlib.import_module(f"configs.{name}").get_config().model.to_dict()
  shape["max_position_embeddings"] = max(shape["max_position_embeddings"], PROMPT + NEW)
  return ModelConfig.from_dict({**shape, **fields}).resolved(
      backend or jax.default_backend(), Numerics("fast"))


def greedy_prompts(vocab_size: int, slots: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(3, vocab_size, (slots, PROMPT)).astype(np.int32)


def generate_rounds(engines: dict, prompts: np.ndarray, rounds: int, warmups: int = 1):
  """(each engine's tokens [slots, NEW] from its first call, its seconds per round)."""
  greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
  requests = [Request(i, p, sampling=greedy) for i, p in enumerate(prompts)]
  tokens, seconds = alternate(engines, requests, rounds, warmups)
  return {name: np.stack(t) for name, t in tokens.items()}, seconds


def alternate(engines: dict, requests: list[Request], rounds: int, warmups: int = 1):
  """`generate_rounds` for any requests: (each engine's completions in request id order
  from its first call, its seconds per round)."""

  def run(engine):
    out = engine.generate(requests)
    return [t.completion_ids for t in sorted(out, key=lambda t: t.request_id)]

  tokens = {name: run(e) for name, e in engines.items()}  # compile
  for _ in range(warmups - 1):
    for e in engines.values():
      run(e)
  seconds = {name: [] for name in engines}
  for _ in range(rounds):
    for name, e in engines.items():
      t0 = time.perf_counter()
      run(e)
      seconds[name].append(time.perf_counter() - t0)
  return tokens, seconds


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
  return statistics.median(a / b for a, b in zip(numerator, denominator))


def tok_s(seconds: list[float], slots: int) -> float:
  return round(slots * NEW / statistics.median(seconds), 1)
