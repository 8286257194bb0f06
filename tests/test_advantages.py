"""Group advantages against numpy written from the published formulas, infra-failure
exclusion and tied groups.

GRPO (Shao et al. 2024, DeepSeekMath, outcome supervision): A_i = (r_i - mean(r)) / std(r)
  over the G outputs of one prompt; std is the sample (N-1) std as in TRL, plus eps.
Dr.GRPO (Liu et al. 2025): A_i = r_i - mean(r).
RLOO (Ahmadian et al. 2024): A_i = r_i - 1/(G-1) sum_{j != i} r_j.
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rljax.rl.advantages import group_advantages

KINDS = ("grpo", "drgrpo", "rloo")
EPS = 1e-6


def np_group_advantages(rewards, gids, valid, kind, num_groups, eps=EPS):
  """The published per-group formulas, one group at a time in float64."""
  n = len(rewards)
  adv = np.zeros(n)
  live = tied = 0
  for g in range(num_groups):
    idx = [i for i in range(n) if valid[i] and gids[i] == g]
    if not idx:
      continue
    live += 1
    r = np.asarray(rewards, np.float64)[idx]
    if len(idx) == 1 or np.all(r == r[0]):
      tied += 1
      continue  # no signal: 0
    if kind == "grpo":
      a = (r - r.mean()) / (r.std(ddof=1) + eps)
    elif kind == "drgrpo":
      a = r - r.mean()
    else:
      a = np.array([r[k] - np.delete(r, k).mean() for k in range(len(r))])
    adv[idx] = a
  v = np.array([valid[i] and 0 <= gids[i] < num_groups for i in range(n)], bool)
  av, rv = adv[v], np.asarray(rewards, np.float64)[v]
  stats = dict(
      adv_mean=av.mean() if v.any() else 0.0, adv_std=av.std() if v.any() else 0.0,
      adv_min=av.min() if v.any() else 0.0, adv_max=av.max() if v.any() else 0.0,
      reward_mean=rv.mean() if v.any() else 0.0, reward_std=rv.std() if v.any() else 0.0,
      num_valid=float(v.sum()), num_groups_live=float(live),
      zero_signal_group_frac=tied / max(live, 1))
  return adv, stats


N_MAX, G_MAX = 20, 5  # fixed shapes, so each kind compiles once (padding is invalid)
_jitted = jax.jit(group_advantages, static_argnames=("kind", "num_groups", "eps"))


@st.composite
def group_batches(draw):
  num_groups = draw(st.integers(1, G_MAX))  # ids used; the rest of G_MAX stay empty
  n = draw(st.integers(1, N_MAX))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  reward_kind = draw(st.sampled_from(["binary", "small_int", "normal", "tenths"]))
  if reward_kind == "binary":
    rewards = rng.integers(0, 2, N_MAX).astype(np.float32)
  elif reward_kind == "small_int":
    rewards = rng.integers(-2, 3, N_MAX).astype(np.float32)
  elif reward_kind == "tenths":  # ties whose float mean is not the value (3 * 0.1 / 3)
    rewards = (rng.integers(0, 3, N_MAX) * 0.1).astype(np.float32)
  else:
    rewards = rng.normal(0, 2, N_MAX).astype(np.float32)
  lo = -1 if draw(st.booleans()) else 0  # -1: padding ids
  gids = rng.integers(lo, num_groups, N_MAX).astype(np.int32)
  valid = rng.random(N_MAX) < draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]))
  valid[n:] = False  # padding rows
  rewards[n:] = np.float32(draw(st.sampled_from([0.0, np.nan, np.inf])))
  return rewards, gids, valid


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(batch=group_batches())
def test_matches_numpy_oracle(kind, batch):
  rewards, gids, valid = batch
  adv, stats = _jitted(rewards, gids, valid, kind=kind, num_groups=G_MAX)
  ref, ref_stats = np_group_advantages(rewards, gids, valid, kind, G_MAX)
  adv = np.asarray(adv)
  assert adv.dtype == np.float32
  np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
  assert set(stats) == set(ref_stats)
  for k, v in ref_stats.items():
    np.testing.assert_allclose(np.asarray(stats[k]), v, rtol=1e-5, atol=1e-5, err_msg=k)
  invalid = ~(valid & (gids >= 0))
  assert np.all(adv[invalid] == 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_infra_failures_enter_no_baseline(kind):
  rng = np.random.default_rng(0)
  n, g = 24, 4
  rewards = rng.normal(size=n).astype(np.float32)
  gids = np.repeat(np.arange(g), n // g).astype(np.int32)
  valid = rng.random(n) < 0.7
  base, base_stats = group_advantages(rewards, gids, valid, kind=kind, num_groups=g)
  for junk in (np.nan, np.inf, -np.inf, 1e30, 0.0):
    r2 = np.where(valid, rewards, np.float32(junk)).astype(np.float32)
    adv, stats = group_advantages(r2, gids, valid, kind=kind, num_groups=g)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(base))
    for k in base_stats:
      np.testing.assert_array_equal(np.asarray(stats[k]), np.asarray(base_stats[k]), k)
  assert np.all(np.asarray(base)[~valid] == 0.0)
  # Dropping the invalid samples altogether gives the same advantages for the rest.
  alone, _ = group_advantages(rewards[valid], gids[valid], np.ones(valid.sum(), bool),
                              kind=kind, num_groups=g)
  np.testing.assert_array_equal(np.asarray(alone), np.asarray(base)[valid])


@pytest.mark.parametrize("kind", KINDS)
def test_tied_groups_give_exact_zeros(kind):
  # 0.1 three times: the f32 mean is not 0.1, so r - mean alone is not 0; std is ~0.
  ties = [0.1, 0.1, 0.1, 1e15, 1e15, -3.7, -3.7, -3.7, -3.7, 5.0, 1.0, 0.0]
  gids = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4]
  valid = [True] * 11 + [False]  # group 4: one valid member (plus an infra failure)
  adv, stats = group_advantages(np.float32(ties), np.int32(gids), np.array(valid),
                                kind=kind, num_groups=6)  # group 5 empty
  adv = np.asarray(adv)
  assert np.all(np.isfinite(adv)) and np.all(adv == 0.0)
  assert all(np.isfinite(np.asarray(v)) for v in stats.values())
  assert float(stats["zero_signal_group_frac"]) == 1.0
  assert float(stats["num_groups_live"]) == 5.0


def test_jittable():
  fn = jax.jit(group_advantages, static_argnames=("kind", "num_groups", "eps"))
  rng = np.random.default_rng(1)
  r = rng.normal(size=16).astype(np.float32)
  gid = rng.integers(0, 4, 16).astype(np.int32)
  valid = rng.random(16) < 0.8
  for kind in KINDS:
    a, s = fn(r, gid, valid, kind=kind, num_groups=4)
    b, t = group_advantages(r, gid, valid, kind=kind, num_groups=4)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_rejects_unknown_kind():
  with pytest.raises(ValueError):
    group_advantages(np.zeros(2, np.float32), np.zeros(2, np.int32), np.ones(2, bool),
                     kind="ppo", num_groups=1)
