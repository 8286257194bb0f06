"""The optimizer recipe of a config's `sft` and `rl` blocks: the learning-rate schedule
(`lr_schedule`), AdamW's settings (`block_optimizer`) and their checks (`check_recipe`).
Keys a block may leave out take RECIPE_DEFAULTS."""

from __future__ import annotations

import math
import numbers
from typing import Any

import ml_collections
import optax

from rljax.pipeline.config_error import ConfigError
from rljax.rl import learner


def lr_schedule(c: ml_collections.ConfigDict, steps: int) -> optax.Schedule:
  """Linear warmup from 0 over c.warmup_steps updates (none: the first update already has
  c.learning_rate); then constant (final_lr_frac 1) or cosine decay to learning_rate *
  final_lr_frac at c.schedule_steps (absent, 0 or None: `steps`), constant after it."""
  horizon = c.get("schedule_steps") or steps
  if c.warmup_steps <= 0:
    if c.final_lr_frac == 1.0:
      return optax.constant_schedule(c.learning_rate)
    return optax.cosine_decay_schedule(c.learning_rate, max(horizon, 1), alpha=c.final_lr_frac)
  if c.final_lr_frac == 1.0:
    return optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps)
  return optax.warmup_cosine_decay_schedule(
      0.0, c.learning_rate, c.warmup_steps, max(horizon, c.warmup_steps + 1),
      end_value=c.learning_rate * c.final_lr_frac)


# an sft or rl block's optimizer keys that a config may leave out, with their defaults
RECIPE_DEFAULTS = {"schedule_steps": 0, "adam_b1": 0.9, "adam_b2": 0.999, "adam_eps": 1e-8,
                   "clip_norm": 1.0}


def _number(value: Any) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def _int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# key -> (whether a value is valid, what it must be)
RECIPE_RULES = {
    "warmup_steps": (lambda v: _int(v) and v >= 0,
                     "an int >= 0 (0: the full rate from the first update)"),
    "schedule_steps": (lambda v: v is None or (_int(v) and v >= 0),
                       "an int >= 1 (the cosine horizon), or 0 / None (the block's steps)"),
    "final_lr_frac": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "adam_b1": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "adam_b2": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "adam_eps": (lambda v: _number(v) and v > 0, "a number > 0"),
    "clip_norm": (lambda v: _number(v) and v > 0, "a number > 0"),
}


def check_recipe(c: ml_collections.ConfigDict, field: str) -> None:
  """The schedule and optimizer keys of an sft or rl block (`field`: its name)."""
  for key, (valid, rule) in RECIPE_RULES.items():
    value = c.get(key, RECIPE_DEFAULTS.get(key))
    if not valid(value):
      raise ConfigError(f"{field}.{key} must be {rule}, not {value!r}")


def recipe(c: ml_collections.ConfigDict, key: str) -> Any:
  """An sft or rl block's `key`, or its default (RECIPE_DEFAULTS)."""
  return c.get(key, RECIPE_DEFAULTS[key])


def block_optimizer(c: ml_collections.ConfigDict, *, lr_factor: float = 1.0,
                    skip_empty: bool = False) -> optax.GradientTransformation:
  """The AdamW of an sft or rl block: `lr_schedule` over the block's steps (times
  `lr_factor`), its clip_norm, adam_b1/b2/eps and weight_decay."""
  schedule = base = lr_schedule(c, c.steps)
  if lr_factor != 1.0:
    schedule = lambda count: base(count) * lr_factor  # noqa: E731
  return learner.make_optimizer(
      schedule, weight_decay=c.weight_decay,
      clip_norm=recipe(c, "clip_norm"), b1=recipe(c, "adam_b1"), b2=recipe(c, "adam_b2"),
      eps=recipe(c, "adam_eps"), skip_empty=skip_empty)
