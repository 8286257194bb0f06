"""Group-relative advantages: GRPO, Dr.GRPO and RLOO, with infra failures left out.

Every sample i has a scalar reward r_i, a group id g(i) (the samples drawn for one
prompt) and a `valid` flag. Only valid samples count: an `infra_failure` sample (the
environment raised or timed out; see `trajectory.Outcome`) is passed with valid=False,
enters neither its group's count, mean nor std, and gets advantage exactly 0. Its reward
may be anything, NaN included; it is never read. A sample whose group id lies outside
[0, num_groups) is treated as invalid too, so padding rows can carry group id -1.

Over the valid members V_g of group g, with n_g = |V_g| and mean m_g = sum(r) / n_g:

* ``grpo`` (DeepSeekMath, Shao et al. 2024, "outcome supervision"):
      A_i = (r_i - m_g) / (s_g + eps),
  s_g the *sample* standard deviation sqrt(sum (r - m_g)^2 / (n_g - 1)) (Bessel), which is
  what TRL's GRPOTrainer computes (torch.std, unbiased). A group with n_g = 1 gives 0.
* ``drgrpo`` (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"): the std
  normalisation removed, A_i = r_i - m_g.
* ``rloo`` (REINFORCE leave-one-out, Ahmadian et al. 2024): the baseline is the mean of the
  *other* valid members, A_i = r_i - (sum_{V_g} r - r_i) / (n_g - 1); n_g = 1 gives 0.

Ties: when every valid member of a group has the same reward (including a group of one)
the group carries no signal and its advantages are exactly 0 — detected by comparing the
group's max and min, not by trusting r - mean to round to zero (3 * 0.1 / 3 != 0.1 in
floating point) or std + eps to be harmless. No NaN or inf can come out of a tied group.

Everything is jittable with static shapes: `num_groups` (and `kind`, `eps`) are static,
groups are reduced with `jax.ops.segment_*` over `num_groups` segments.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
KINDS = ("grpo", "drgrpo", "rloo")
# What training does with an episode cut by the context (`FinishReason.CONTEXT`,
# `config.rl.overlong`; applied by `rljax.pipeline.grpo_update.advantages_of`):
#   score: it trains like any other, with the reward its verdict gave what it did;
#   mask:  its reward counts in its group's baseline, none of its tokens trains (DAPO's
#          overlong filtering: the policy is not pushed away from work that was only cut
#          short, and its group's other samples are still measured against it);
#   drop:  out of the baseline and the gradient, like an infra failure (valid=False here).
OVERLONG = ("score", "mask", "drop")


def group_advantages(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array, *,
                     kind: AdvantageKind, num_groups: int, eps: float = 1e-6,
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-sample advantages [N] f32 (0 on invalid samples and tied groups) and stats.

  Args:
    rewards: [N] float; read only where valid.
    group_ids: [N] int in [0, num_groups); anything else marks the sample invalid.
    valid: [N] bool; False for infra failures (and padding).
    kind: "grpo" | "drgrpo" | "rloo" (see the module docstring).
    num_groups: static number of group segments.
    eps: added to the GRPO sample std.

  Returns:
    (advantages [N] f32, stats): stats over valid samples — ``adv_mean``, ``adv_std``
    (population), ``adv_min``, ``adv_max``, ``reward_mean``, ``reward_std`` (population),
    ``num_valid``, ``num_groups_live`` (groups with >= 1 valid member) and
    ``zero_signal_group_frac`` (fraction of live groups whose valid rewards all tie, so
    every member has advantage 0). Empty reductions give 0.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  rewards = jnp.asarray(rewards, jnp.float32)
  group_ids = jnp.asarray(group_ids, jnp.int32)
  valid = jnp.asarray(valid, bool) & (group_ids >= 0) & (group_ids < num_groups)
  gid = jnp.where(valid, group_ids, 0)  # any in-range index; masked out below
  r = jnp.where(valid, rewards, 0.0)
  seg = lambda x: jax.ops.segment_sum(x, gid, num_segments=num_groups)

  count = seg(valid.astype(jnp.float32))  # [G]
  total = seg(r)
  mean = total / jnp.maximum(count, 1.0)
  big = jnp.float32(jnp.inf)
  gmax = jax.ops.segment_max(jnp.where(valid, r, -big), gid, num_segments=num_groups)
  gmin = jax.ops.segment_min(jnp.where(valid, r, big), gid, num_segments=num_groups)
  tied = ~(gmax > gmin)  # also true for empty groups (-inf > inf is False)

  n_i = count[gid]
  if kind == "drgrpo":
    adv = r - mean[gid]
  elif kind == "grpo":
    centred = jnp.where(valid, r - mean[gid], 0.0)
    var = seg(centred * centred) / jnp.maximum(count - 1.0, 1.0)
    std = jnp.sqrt(var)
    adv = centred / (std[gid] + eps)
  else:  # rloo
    adv = r - (total[gid] - r) / jnp.maximum(n_i - 1.0, 1.0)
  zero = ~valid | tied[gid] | (n_i < 2)
  adv = jnp.where(zero, 0.0, adv).astype(jnp.float32)

  nv = jnp.sum(valid.astype(jnp.float32))
  denom = jnp.maximum(nv, 1.0)
  adv_mean = jnp.sum(jnp.where(valid, adv, 0.0)) / denom
  r_mean = jnp.sum(r) / denom
  live = count > 0
  n_live = jnp.sum(live.astype(jnp.float32))
  stats = {
      "adv_mean": adv_mean,
      "adv_std": jnp.sqrt(jnp.sum(jnp.where(valid, (adv - adv_mean) ** 2, 0.0)) / denom),
      "adv_min": jnp.where(nv > 0, jnp.min(jnp.where(valid, adv, big)), 0.0),
      "adv_max": jnp.where(nv > 0, jnp.max(jnp.where(valid, adv, -big)), 0.0),
      "reward_mean": r_mean,
      "reward_std": jnp.sqrt(jnp.sum(jnp.where(valid, (r - r_mean) ** 2, 0.0)) / denom),
      "num_valid": nv,
      "num_groups_live": n_live,
      "zero_signal_group_frac":
          jnp.sum((live & tied).astype(jnp.float32)) / jnp.maximum(n_live, 1.0),
  }
  return adv, stats
