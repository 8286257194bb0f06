"""The policy loss against numpy written from the published formulas, in float64.

GRPO (Shao et al. 2024, DeepSeekMath, eq. 3), loss = -J with
  J = 1/G sum_i 1/|o_i| sum_t [ min(rho A, clip(rho, 1-eps, 1+eps) A) - beta D_KL ],
  D_KL = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1                (seq_mean_token_mean)
DAPO (Yu et al. 2025, eq. 8): clip(rho, 1-eps_low, 1+eps_high) and
  J = 1/sum_i |o_i| sum_i sum_t min(...)                              (token_mean)
Dr.GRPO (Liu et al. 2025): J = 1/G sum_i 1/MAX_TOKENS sum_t min(...)  (seq_mean_token_sum_norm)
Truncated IS (Yao et al. 2025): each token's term times min(pi_old / pi_beh, C).
Geometric MIS: drop sequence i if (prod_t pi_old/pi_beh)^(1/|o_i|) is outside [low, high].

The oracle walks sequences and tokens one at a time; the library is vectorised with
segment sums. Tolerances: f32 vs f64, rtol 1e-5, atol 1e-5 times the largest term.
"""

import dataclasses
import math


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from rljax.rl.advantages import group_advantages
from rljax.rl.losses import LossConfig, entropy_from_logits, global_norm, policy_loss

B, T = 4, 8  # fixed shapes: the structure (masks, packing, validity) varies, not the shape
S_PACKED = 7  # static num_seqs for packed layouts (some ids stay unused)


# ----------------------------------------------------------------------------- oracle


def np_policy_loss(lp, old, beh, adv_tok, mask, seq_of, num_s, valid, ref, ent, cfg):
  """Returns (loss, metrics, dloss/dlp [B,T], dloss/dentropy [B,T]) in float64."""
  f = lambda x: None if x is None else np.asarray(x, np.float64)
  lp, old, beh, adv_tok, ref, ent = map(f, (lp, old, beh, adv_tok, ref, ent))
  nb, nt = lp.shape
  toks = [[] for _ in range(num_s)]
  for b in range(nb):
    for t in range(nt):
      s = seq_of[b, t]
      if 0 <= s < num_s and mask[b, t] and valid[s]:
        toks[s].append((b, t))
  before = [bt for ts in toks for bt in ts]
  rho_beh = {bt: math.exp(old[bt] - beh[bt]) for bt in before}
  metrics = {
      "is_weight_mean": np.mean([rho_beh[bt] for bt in before]) if before else 0.0,
      "is_weight_max": max(rho_beh[bt] for bt in before) if before else 0.0,
      "mismatch_k3_kl": (np.mean([rho_beh[bt] - math.log(rho_beh[bt]) - 1 for bt in before])
                         if before else 0.0),
  }
  if cfg.tis:
    metrics["tis_trunc_frac"] = (np.mean([rho_beh[bt] > cfg.tis_cap for bt in before])
                                 if before else 0.0)
  if cfg.mis:
    nonempty = [s for s in range(num_s) if toks[s]]
    dropped = []
    for s in nonempty:
      geo = math.exp(np.mean([old[bt] - beh[bt] for bt in toks[s]]))
      if not cfg.mis_low <= geo <= cfg.mis_high:
        dropped.append(s)
    for s in dropped:
      toks[s] = []
    metrics["mis_masked_frac"] = len(dropped) / max(len(nonempty), 1)

  live = [s for s in range(num_s) if toks[s]]
  kept = [bt for s in live for bt in toks[s]]
  n_tok = len(kept)
  grad_lp = np.zeros((nb, nt))
  grad_ent = np.zeros((nb, nt))
  # Aggregation weight of each token (d loss / d l_t).
  weight = {}
  for s in live:
    for bt in toks[s]:
      if cfg.aggregation == "token_mean":
        weight[bt] = 1.0 / n_tok
      elif cfg.aggregation == "seq_mean_token_mean":
        weight[bt] = 1.0 / (len(live) * len(toks[s]))
      else:
        weight[bt] = 1.0 / (len(live) * cfg.max_tokens)
  loss = pg = 0.0
  per_tok = {}
  clip_lo = clip_hi = 0
  for bt in kept:
    a = adv_tok[bt]
    rho = math.exp(lp[bt] - old[bt])
    surr = min(rho * a, min(max(rho, 1 - cfg.clip_low), 1 + cfg.clip_high) * a)
    w = min(rho_beh[bt], cfg.tis_cap) if cfg.tis else 1.0
    hi, lo = a > 0 and rho > 1 + cfg.clip_high, a < 0 and rho < 1 - cfg.clip_low
    clip_hi += hi
    clip_lo += lo
    dsurr = 0.0 if (hi or lo) else a * rho
    term = -w * surr
    pg += weight[bt] * term
    dterm = -w * dsurr
    if ref is not None and cfg.kl_coef:
      x = ref[bt] - lp[bt]
      term += cfg.kl_coef * (math.exp(x) - x - 1)
      dterm += cfg.kl_coef * (1 - math.exp(x))
    if ent is not None and cfg.entropy_coef:
      term -= cfg.entropy_coef * ent[bt]
      grad_ent[bt] = -cfg.entropy_coef * weight[bt]
    per_tok[bt] = term
    loss += weight[bt] * term
    grad_lp[bt] = weight[bt] * dterm
  tmean = lambda xs: float(np.mean(xs)) if kept else 0.0
  ratios = [math.exp(lp[bt] - old[bt]) for bt in kept]
  advs = [adv_tok[bt] for bt in kept]
  metrics.update({
      "loss": loss, "pg_loss": pg,
      "clip_frac": (clip_lo + clip_hi) / max(n_tok, 1),
      "clip_frac_high": clip_hi / max(n_tok, 1), "clip_frac_low": clip_lo / max(n_tok, 1),
      "ratio_mean": tmean(ratios), "ratio_max": max(ratios) if kept else 0.0,
      "adv_mean": tmean(advs), "adv_std": float(np.std(advs)) if kept else 0.0,
      "adv_min": min(advs) if kept else 0.0, "adv_max": max(advs) if kept else 0.0,
      "masked_token_count": float(n_tok), "num_seqs_live": float(len(live)),
  })
  if ref is not None:
    metrics["kl"] = tmean([math.exp(ref[bt] - lp[bt]) - (ref[bt] - lp[bt]) - 1
                           for bt in kept])
  if ent is not None:
    metrics["entropy"] = tmean([ent[bt] for bt in kept])
  scale = max([abs(v) for v in per_tok.values()] + [1e-3])
  return loss, metrics, grad_lp, grad_ent, scale, toks


# ----------------------------------------------------------------------------- inputs


@st.composite
def loss_cases(draw):
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  packed = draw(st.booleans())
  if packed:  # each row cut into 1-3 sequences plus trailing padding (-1)
    seq_of = -np.ones((B, T), np.int32)
    next_id = 0
    for b in range(B):
      used = rng.integers(1, T + 1)
      cuts = np.sort(rng.choice(np.arange(1, used), size=min(rng.integers(0, 3), used - 1),
                                replace=False)) if used > 1 else []
      for seg, lo_hi in enumerate(np.split(np.arange(used), cuts)):
        if next_id < S_PACKED - 1:  # keep id S_PACKED - 1 unused: an empty sequence
          seq_of[b, lo_hi] = next_id
          next_id += 1
    num_s = S_PACKED
  else:
    seq_of = np.repeat(np.arange(B, dtype=np.int32)[:, None], T, 1)
    num_s = B
  density = draw(st.sampled_from([0.0, 0.4, 0.8, 1.0]))
  mask = rng.random((B, T)) < density
  mask[rng.random(B) < 0.25] = False  # some all-masked rows
  valid = rng.random(num_s) < draw(st.sampled_from([0.6, 1.0]))

  mismatch = draw(st.sampled_from([0.0, 1e-3, 0.05, 0.5]))
  step = draw(st.sampled_from([0.0, 0.1, 0.4]))
  beh = -rng.exponential(1.5, (B, T))
  old = beh + rng.normal(0, 1, (B, T)) * mismatch
  lp = old + rng.normal(0, 1, (B, T)) * step
  ref = lp + rng.normal(0, 0.3, (B, T))
  ent = rng.uniform(0, 3, (B, T))
  per_seq_adv = draw(st.booleans())
  adv = rng.normal(0, 1, num_s if per_seq_adv else (B, T))
  adv[rng.random(adv.shape) < 0.2] = 0.0
  f32 = lambda x: np.asarray(x, np.float32)
  lp, old, beh, ref, ent, adv = map(f32, (lp, old, beh, ref, ent, adv))
  # Garbage where nothing may be read.
  off = ~mask
  lp[off & (rng.random((B, T)) < 0.5)] = np.nan
  beh[off & (rng.random((B, T)) < 0.5)] = -np.inf

  aggregation = draw(st.sampled_from(
      ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]))
  mis_bounds = draw(st.sampled_from([(0.999, 1.001), (0.9, 1.1), (0.5, 2.0)]))
  cfg = LossConfig(
      clip_low=draw(st.sampled_from([0.1, 0.2])), clip_high=draw(st.sampled_from([0.2, 0.28])),
      aggregation=aggregation, max_tokens=T + 3 if aggregation.endswith("norm") else None,
      tis=draw(st.booleans()), tis_cap=draw(st.sampled_from([1.0, 2.0])),
      mis=draw(st.booleans()), mis_low=mis_bounds[0], mis_high=mis_bounds[1],
      kl_coef=draw(st.sampled_from([0.0, 0.05])),
      entropy_coef=draw(st.sampled_from([0.0, 0.01])))
  give_ref = cfg.kl_coef != 0 or draw(st.booleans())
  give_ent = cfg.entropy_coef != 0 or draw(st.booleans())
  return dict(lp=lp, old=old, beh=beh, adv=adv, mask=mask, seq_of=seq_of, num_s=num_s,
              packed=packed, valid=valid, ref=ref if give_ref else None,
              ent=ent if give_ent else None, cfg=cfg)


def _adv_tok(case):
  adv = case["adv"]
  if adv.ndim == 1:
    return np.where(case["seq_of"] >= 0, adv[np.clip(case["seq_of"], 0, None)], 0.0)
  return adv


def _run(case, **overrides):
  c = dict(case, **overrides)

  def f(lp, ent):
    return policy_loss(lp, c["old"], c["beh"], c["adv"], c["mask"], cfg=c["cfg"],
                       valid=c["valid"], seq_ids=c["seq_of"] if c["packed"] else None,
                       num_seqs=c["num_s"] if c["packed"] else None,
                       ref_logprobs=c["ref"], entropy=ent)

  if c["ent"] is None:  # entropy=None path: differentiate w.r.t. lp only
    (loss, metrics), g_lp = jax.value_and_grad(
        lambda lp: f(lp, None), has_aux=True)(c["lp"])
    return loss, metrics, g_lp, np.zeros((B, T), np.float32)
  (loss, metrics), (g_lp, g_ent) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      c["lp"], c["ent"])
  return loss, metrics, g_lp, g_ent


def _near_boundaries(case):
  """Examples where f32 vs f64 rounding could flip a comparison (clip, cap, MIS bound)."""
  cfg, m = case["cfg"], case["mask"]
  lp, old, beh = (np.where(m, case[k], 0.0).astype(np.float64) for k in ("lp", "old", "beh"))
  ratio = np.exp(lp - old)
  for edge in (1 - cfg.clip_low, 1 + cfg.clip_high):
    if np.any(m & (np.abs(ratio - edge) < 1e-4) & (_adv_tok(case) != 0)):
      return True
  if cfg.tis and np.any(m & (np.abs(np.exp(old - beh) - cfg.tis_cap) < 1e-4)):
    return True
  if cfg.mis:
    for s in range(case["num_s"]):
      sel = m & (case["seq_of"] == s)
      if sel.any():
        lg = np.mean((old - beh)[sel])
        if min(abs(lg - math.log(cfg.mis_low)), abs(lg - math.log(cfg.mis_high))) < 1e-5:
          return True
  return False


# ----------------------------------------------------------------------------- tests


@settings(max_examples=60, deadline=None)
@given(case=loss_cases())
def test_matches_numpy_oracle(case):
  assume(not _near_boundaries(case))
  loss, metrics, g_lp, g_ent = _run(case)
  ref_loss, ref_metrics, ref_g_lp, ref_g_ent, scale, toks = np_policy_loss(
      case["lp"], case["old"], case["beh"], _adv_tok(case), case["mask"], case["seq_of"],
      case["num_s"], case["valid"], case["ref"], case["ent"], case["cfg"])
  atol = 1e-5 * scale
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=atol)
  assert set(metrics) == set(ref_metrics), set(metrics) ^ set(ref_metrics)
  for k, v in ref_metrics.items():
    np.testing.assert_allclose(np.asarray(metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
  g_lp = np.asarray(g_lp)
  assert np.all(np.isfinite(g_lp))
  gscale = 1e-5 * max(np.abs(ref_g_lp).max(), 1e-3)
  np.testing.assert_allclose(g_lp, ref_g_lp, rtol=1e-5, atol=gscale)
  np.testing.assert_allclose(np.asarray(g_ent), ref_g_ent, rtol=1e-5, atol=1e-8)
  # Nothing outside the loss tokens receives gradient (infra failures, MIS drops, mask).
  kept = np.zeros((B, T), bool)
  for ts in toks:
    for bt in ts:
      kept[bt] = True
  assert np.all(g_lp[~kept] == 0.0) and np.all(np.asarray(g_ent)[~kept] == 0.0)


def _simple_case(seed=0, **cfg_kw):
  rng = np.random.default_rng(seed)
  beh = -rng.exponential(1.5, (B, T)).astype(np.float32)
  old = (beh + rng.normal(0, 0.05, (B, T))).astype(np.float32)
  lp = (old + rng.normal(0, 0.3, (B, T))).astype(np.float32)
  return dict(lp=lp, old=old, beh=beh, adv=rng.normal(size=B).astype(np.float32),
              mask=rng.random((B, T)) < 0.8, seq_of=None, num_s=B, packed=False,
              valid=np.ones(B, bool), ref=(lp + 0.1).astype(np.float32),
              ent=rng.uniform(0, 2, (B, T)).astype(np.float32),
              cfg=LossConfig(**cfg_kw))


def test_on_policy_corrections_are_identity():
  """old == behaviour (deterministic mode): TIS and MIS change no bit of the loss."""
  case = _simple_case(kl_coef=0.1, entropy_coef=0.01)
  case["beh"] = case["old"]
  base = _run(case)
  for tis, mis in ((True, False), (False, True), (True, True)):
    cfg = dataclasses.replace(case["cfg"], tis=tis, mis=mis, mis_low=1.0, mis_high=1.0)
    out = _run(case, cfg=cfg)
    assert float(out[0]) == float(base[0])
    np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(base[2]))
    assert float(out[1]["is_weight_max"]) == 1.0 and float(out[1]["mismatch_k3_kl"]) == 0.0
    if mis:
      assert float(out[1]["mis_masked_frac"]) == 0.0


def test_old_none_means_stop_gradient_of_current():
  case = _simple_case(aggregation="seq_mean_token_mean")
  out_none = _run(case, old=None, beh=None)
  out_same = _run(case, old=case["lp"], beh=case["lp"])
  assert float(out_none[0]) == float(out_same[0])
  np.testing.assert_array_equal(np.asarray(out_none[2]), np.asarray(out_same[2]))
  assert float(out_none[1]["ratio_max"]) == 1.0


def test_infra_failures_enter_no_gradient_end_to_end():
  """Rewards -> group advantages -> loss: changing anything about an infra-failure sample
  (reward, log-probs, entropy) changes no loss, metric or gradient bit."""
  groups = np.array([0, 0, 1, 1], np.int32)
  valid = np.array([True, False, True, True])
  case = _simple_case(seed=3, tis=True, mis=True, mis_low=0.5, mis_high=2.0, kl_coef=0.1,
                      entropy_coef=0.01)
  case["valid"] = valid

  def run(rewards, lp, beh, ent):
    adv, _ = group_advantages(rewards, groups, valid, kind="grpo", num_groups=2)
    return _run(dict(case, adv=adv), lp=lp, beh=beh, ent=ent)

  rewards = np.float32([1.0, 0.0, 0.0, 1.0])
  base = run(rewards, case["lp"], case["beh"], case["ent"])
  row1 = np.arange(B)[:, None] == 1
  junk = lambda x, v: np.where(row1, np.float32(v), x).astype(np.float32)
  for bad in (np.nan, np.inf, -30.0):
    out = run(np.float32([1.0, bad, 0.0, 1.0]), junk(case["lp"], bad),
              junk(case["beh"], -bad), junk(case["ent"], bad))
    assert float(out[0]) == float(base[0])
    for k in base[1]:
      np.testing.assert_array_equal(np.asarray(out[1][k]), np.asarray(base[1][k]), k)
    for i in (2, 3):
      np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(base[i]))
      assert np.all(np.asarray(base[i])[1] == 0.0)
  # Sample 0 is alone in its group once sample 1 is excluded: zero advantage, so the
  # only gradient on row 0 is the KL and entropy terms'.
  adv, _ = group_advantages(rewards, groups, valid, kind="grpo", num_groups=2)
  assert float(adv[0]) == 0.0 and float(adv[1]) == 0.0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
def test_all_masked_gives_zero_and_no_nan(aggregation):
  case = _simple_case(aggregation=aggregation, max_tokens=T, tis=True, mis=True,
                      kl_coef=0.1, entropy_coef=0.01)
  loss, metrics, g_lp, g_ent = _run(case, mask=np.zeros((B, T), bool))
  assert float(loss) == 0.0
  assert all(np.isfinite(np.asarray(v)) for v in metrics.values())
  assert np.all(np.asarray(g_lp) == 0.0) and np.all(np.asarray(g_ent) == 0.0)


def test_jit_matches_eager_and_traces_once():
  case = _simple_case(tis=True, mis=True, mis_low=0.9, mis_high=1.1, kl_coef=0.05)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(lp, old, beh, adv, mask):
    return jax.value_and_grad(
        lambda x: policy_loss(x, old, beh, adv, mask, cfg=case["cfg"],
                              ref_logprobs=case["ref"]), has_aux=True)(lp)

  args = [case[k] for k in ("lp", "old", "beh", "adv", "mask")]
  (loss, metrics), g = step(*args)
  (loss2, _), g2 = step(*[np.array(a, copy=True) for a in args])  # same shapes: no retrace
  eager = _run(case, ent=None)
  np.testing.assert_allclose(float(loss), float(eager[0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g), np.asarray(eager[2]), rtol=1e-5, atol=1e-8)
  assert float(loss2) == float(loss)


def test_microbatches_with_global_denominator_sum_to_full_batch():
  case = _simple_case()
  cfg = case["cfg"]
  full, _ = policy_loss(case["lp"], case["old"], case["beh"], case["adv"], case["mask"],
                        cfg=cfg)
  denom = float(np.sum(case["mask"]))
  parts = [policy_loss(case["lp"][sl], case["old"][sl], case["beh"][sl], case["adv"][sl],
                       case["mask"][sl], cfg=cfg, loss_denominator=denom)[0]
           for sl in (slice(0, 1), slice(1, B))]
  np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-6)


def test_packed_equals_unpacked():
  """The same three sequences, one per row or packed into one row, give the same loss."""
  rng = np.random.default_rng(5)
  lens = [3, 2, 3]
  cfg = LossConfig(aggregation="seq_mean_token_mean", tis=True, mis=True, mis_low=0.9,
                   mis_high=1.1)
  lp, old, beh = (rng.normal(-1, 0.3, 8).astype(np.float32) for _ in range(3))
  adv = np.float32([0.5, -1.0, 2.0])
  seq = np.repeat(np.arange(3), lens).astype(np.int32)
  packed = policy_loss(lp[None], old[None], beh[None], adv, np.ones((1, 8), bool), cfg=cfg,
                       seq_ids=seq[None], num_seqs=3)
  rows = np.zeros((3, 3, 3), np.float32)
  mask = np.zeros((3, 3), bool)
  for s in range(3):
    for j, x in enumerate((lp, old, beh)):
      rows[j, s, :lens[s]] = x[seq == s]
    mask[s, :lens[s]] = True
  unpacked = policy_loss(rows[0], rows[1], rows[2], adv, mask, cfg=cfg)
  np.testing.assert_allclose(float(packed[0]), float(unpacked[0]), rtol=1e-6)
  for k in packed[1]:
    np.testing.assert_allclose(np.asarray(packed[1][k]), np.asarray(unpacked[1][k]),
                               rtol=1e-6, atol=1e-7, err_msg=k)


def test_k3_is_accurate_for_tiny_mismatch():
  """mismatch_k3_kl ~ x^2/2 must not drown in cancellation at x ~ 1e-3 (fast-mode scale)."""
  x = np.float32(1e-3)
  old = np.full((1, 4), -1.0, np.float32)
  beh = (old - x).astype(np.float32)
  _, m = policy_loss(old, old, beh, np.zeros(1, np.float32), np.ones((1, 4), bool),
                     cfg=LossConfig())
  xd = float(np.float64(old[0, 0]) - np.float64(beh[0, 0]))
  np.testing.assert_allclose(float(m["mismatch_k3_kl"]), math.expm1(xd) - xd, rtol=1e-5)


def test_entropy_from_logits():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (2, 3, 11)).astype(np.float32)
  logits[0, 0, :4] = -np.inf  # masked vocabulary entries
  h = np.asarray(entropy_from_logits(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32)))
  x = logits.astype(np.float64)
  p = np.exp(x - x.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ref = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)
  np.testing.assert_allclose(h, ref, rtol=1e-2)  # bf16 round-trip of the logits
  h32 = np.asarray(entropy_from_logits(logits))
  np.testing.assert_allclose(h32, ref, rtol=1e-5, atol=1e-6)
  assert entropy_from_logits(logits).dtype == jnp.float32
  g = jax.grad(lambda z: entropy_from_logits(z).sum())(jnp.asarray(logits))
  assert np.all(np.isfinite(np.asarray(g)[np.isfinite(logits)]))
  assert not np.any(np.isnan(np.asarray(g)))


def test_global_norm():
  tree = {"a": np.float32([3.0, 4.0]), "b": [jnp.ones((2, 2), jnp.bfloat16)]}
  np.testing.assert_allclose(float(global_norm(tree)), math.sqrt(25 + 4), rtol=1e-6)


@pytest.mark.parametrize("kw", [dict(aggregation="seq_sum"),
                                dict(aggregation="seq_mean_token_sum_norm"),
                                dict(clip_low=1.0), dict(mis=True, mis_low=1.1)])
def test_config_validation(kw):
  with pytest.raises(ValueError):
    LossConfig(**kw)


def test_missing_regulariser_inputs_raise():
  case = _simple_case()
  with pytest.raises(ValueError, match="ref_logprobs"):
    policy_loss(case["lp"], case["old"], case["beh"], case["adv"], case["mask"],
                cfg=LossConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="entropy"):
    policy_loss(case["lp"], case["old"], case["beh"], case["adv"], case["mask"],
                cfg=LossConfig(entropy_coef=0.1))
