"""Run metrics: one JSONL record per event, TensorBoard scalars, a reward-curve PNG.

Records are flat dicts of numbers tagged with a `phase` ("sft", "grpo", "eval", ...) and a
`step`. The JSONL file is the source of truth (plots and tables are made from it); the
TensorBoard events carry the same scalars as `<phase>/<name>`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np


def _number(v: Any) -> float | int | None:
  v = np.asarray(v)
  if v.shape != () or v.dtype.kind not in "biuf":
    return None
  return bool(v) if v.dtype.kind == "b" else v.item()


@dataclasses.dataclass
class RunningMax:
  """A running max over batches that counts what it covers and never hides a NaN (Python's
  `max(0.0, nan)` is 0.0): `value` is None until a batch with tokens was added, NaN once
  any added value was NaN."""

  value: float | None = None
  tokens: int = 0

  def add(self, value: float, tokens: int) -> None:
    if tokens <= 0:
      return
    value = float(value)
    self.value = value if self.value is None else float(np.max([self.value, value]))
    self.tokens += int(tokens)


@dataclasses.dataclass
class FallAlarm:
  """Held-out pass@1's fall from its best so far and from its start (the first value it
  saw: the warm start's). A collapsing policy shows here first as a large fall (the study
  of experiments/study_recipe.py saw falls of at most 0.08 in healthy runs, noise of a
  256-task evaluation included); a fall of `threshold` or more from either is an alarm.
  (The best is never below the start, so the fall from the best is the larger: the fall
  from the start says how much of the run's own gain is gone, or more.)"""

  threshold: float
  best: float | None = None
  start: float | None = None
  max_fall: float = 0.0
  alarms: int = 0

  def update(self, pass1: float) -> dict[str, float]:
    self.start = pass1 if self.start is None else self.start
    self.best = pass1 if self.best is None else max(self.best, pass1)
    fall, from_start = self.best - pass1, self.start - pass1
    self.max_fall = max(self.max_fall, fall)
    alarm = fall >= self.threshold or from_start >= self.threshold
    self.alarms += int(alarm)
    return {"pass1_fall_from_best": fall, "pass1_fall_from_start": from_start,
            "collapse_alarm": int(alarm)}


@dataclasses.dataclass
class SuccessFallAlarm:
  """The training signal's collapse alarm, one update per GRPO update: the moving average
  of the sampled success fraction over the last `window` updates against the start (the
  first full window's average). A fall of `threshold` or more is an alarm
  (`train_collapse_alarm`); held-out evaluations come every `eval.every` updates, this
  every update. Each update reports `success_frac_avg` (the moving average, over the
  updates so far until the window is full), `success_fall_from_start` (0 until the start
  is known; negative while the policy improves) and `train_collapse_alarm`.

  On a sampled success fraction over P x G episodes (arith_tiny: 256 per update) the
  moving average of 10 moves by a few hundredths in a steady run; a collapse from 0.41 to
  0.04 in 40 updates falls 0.15 below its first window's average 27 updates in
  (a linear fall; tests/test_pipeline.py)."""

  threshold: float
  window: int = 10
  start: float | None = None
  max_fall: float = 0.0
  alarms: int = 0
  recent: collections.deque = dataclasses.field(default_factory=collections.deque)

  def __post_init__(self):
    if self.window < 1:
      raise ValueError(f"window must be >= 1, not {self.window}")

  def update(self, success_frac: float) -> dict[str, float]:
    self.recent.append(float(success_frac))
    while len(self.recent) > self.window:
      self.recent.popleft()
    avg = float(np.mean(self.recent))
    if self.start is None and len(self.recent) == self.window:
      self.start = avg
    fall = 0.0 if self.start is None else self.start - avg
    self.max_fall = max(self.max_fall, fall)
    alarm = fall >= self.threshold
    self.alarms += int(alarm)
    return {"success_frac_avg": avg, "success_fall_from_start": fall,
            "train_collapse_alarm": int(alarm)}


class NullLogger:
  """MetricsLogger's interface, writing nothing: the logger of trainer processes other than
  0 (process 0 owns metrics.jsonl and tb/)."""

  def __init__(self, workdir: str):
    self.workdir, self.jsonl_path = workdir, None

  def write(self, phase: str, step: int, values: Mapping[str, Any]) -> dict:
    return {"phase": phase, "step": int(step), **values}

  def close(self) -> None:
    pass


class MetricsLogger:
  """Writes `<workdir>/metrics.jsonl` and TensorBoard events under `<workdir>/tb`."""

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
    self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, phase: str, step: int, values: Mapping[str, Any]) -> dict:
    record: dict[str, Any] = {"phase": phase, "step": int(step)}
    for k, v in values.items():
      x = _number(v)
      if x is None:
        raise TypeError(f"metric {k!r} is not a scalar number: {v!r}")
      record[k] = x
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k not in ("phase", "step") and math.isfinite(float(v)):
          self._tb.add_scalar(f"{phase}/{k}", float(v), int(step))
    return record

  def close(self) -> None:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> "MetricsLogger":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_reward_curve(records: list[dict], path: str, *, title: str = "") -> None:
  """Reward of the episodes sampled for each GRPO update (and a moving average) with
held-out pass@1 points."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  train = [r for r in records if r["phase"] in ("grpo", "async")]
  evals = [r for r in records if r["phase"] == "eval"]
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    x = np.array([r["step"] for r in train])
    y = np.array([r.get("rollout_reward_mean", r["reward_mean"]) for r in train])
    ax.plot(x, y, lw=0.8, alpha=0.4, label="train reward (per step)")
    w = max(1, len(y) // 20)
    ax.plot(x[w - 1:], np.convolve(y, np.ones(w) / w, mode="valid"), lw=2,
            label=f"train reward ({w}-step mean)")
  if evals:
    ax.plot([r["step"] for r in evals], [r["pass1"] for r in evals], "o-", color="k",
            label="held-out pass@1 (greedy)")
  ax.set_xlabel("GRPO step (policy version)")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def host_metrics(statuses: Mapping[str, Mapping[str, Any]],
                 publish_times: Mapping[int, float]) -> dict[str, float]:
  """Per-host scalars from rollout hosts' status records (rljax.pipeline.host): the
  publish -> apply latency and apply pause of the newest version each applied, its
  version, its rollout tokens/s and idle fraction."""
  record: dict[str, float] = {}
  for host, status in statuses.items():
    applied = status.get("applied") or []
    if applied:
      version, _, applied_at, pause = applied[-1][:4]
      if version in publish_times:
        record[f"host_{host}_publish_to_apply_s"] = applied_at - publish_times[version]
      record[f"host_{host}_apply_pause_s"] = pause
      record[f"host_{host}_version"] = version
    busy, idle = status.get("generate_s", 0.0), status.get("idle_s", 0.0)
    if busy:
      record[f"host_{host}_tok_s"] = status.get("tokens_generated", 0) / busy
    if busy + idle > 0:
      record[f"host_{host}_idle_frac"] = idle / (busy + idle)
  return record


def json_line(record: Mapping[str, Any]) -> str:
  """One strict-JSON line: a NaN or infinite float (a failed check) is written as the
  string "NaN" / "Infinity" / "-Infinity", never as JSON's missing constants."""
  def clean(v):
    if isinstance(v, float) and not math.isfinite(v):
      return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, Mapping):
      return {k: clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
      return [clean(x) for x in v]
    return v
  return json.dumps(clean(dict(record)), allow_nan=False)
