"""Injected env latency: a seeded delay distribution that models slow sandboxes and tools.

Agentic workloads have long-tailed env latency (a sandbox that usually answers in 50 ms
and sometimes takes seconds). Envs call `LatencyModel.sleep()` at the start of `verify`
and `step`, so the async pipeline can be exercised against a tail it does not control.
Off by default. A delay longer than the caller's timeout becomes an infra failure, as a
real sandbox timeout would.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Literal

import numpy as np


@dataclasses.dataclass
class LatencyModel:
  """Delay in seconds, drawn per call.

  - "none": always 0.
  - "lognormal": scale_s * exp(shape * N(0, 1)); median scale_s, tail grows with shape.
  - "pareto": scale_s * U^(-1/shape), U ~ Uniform(0, 1]; minimum scale_s, median
    scale_s * 2^(1/shape), p99 scale_s * 100^(1/shape). shape near 1 is a very heavy tail
    (shape <= 1 has no mean).
  Every draw is capped at cap_s. Thread-safe; reproducible for a seed in a single thread.
  """

  distribution: Literal["none", "lognormal", "pareto"] = "none"
  scale_s: float = 0.0
  shape: float = 1.0
  cap_s: float = math.inf
  seed: int = 0

  def __post_init__(self):
    if self.distribution not in ("none", "lognormal", "pareto"):
      raise ValueError(f"unknown latency distribution {self.distribution!r}")
    if self.scale_s < 0 or self.shape <= 0 or self.cap_s < 0:
      raise ValueError("need scale_s >= 0, shape > 0, cap_s >= 0")
    self._rng = np.random.default_rng(self.seed)
    self._lock = threading.Lock()

  @property
  def enabled(self) -> bool:
    return self.distribution != "none" and self.scale_s > 0

  def sample(self, n: int | None = None) -> float | np.ndarray:
    """One delay (float), or an array of n delays."""
    size = 1 if n is None else n
    if not self.enabled:
      out = np.zeros(size)
    else:
      with self._lock:
        if self.distribution == "lognormal":
          out = self.scale_s * np.exp(self.shape * self._rng.standard_normal(size))
        else:
          u = 1.0 - self._rng.random(size)  # (0, 1]
          out = self.scale_s * u ** (-1.0 / self.shape)
      out = np.minimum(out, self.cap_s)
    return float(out[0]) if n is None else out

  def sleep(self) -> float:
    """Sleeps for one drawn delay; returns it."""
    delay = self.sample() if self.enabled else 0.0
    if delay > 0:
      time.sleep(delay)
    return delay
