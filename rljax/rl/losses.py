"""Policy-gradient loss: PPO clip-higher surrogate, aggregations, off-policy corrections.

A pure function `policy_loss(...) -> (loss, metrics)`; every log-prob is taken in f32.

Three policies meet here, per completion token t of sequence s:

* pi_theta — the policy being optimised; `logprobs` [B, T], the only differentiated input.
* pi_old — the trainer's copy of the weights that produced the batch (the PPO "old"
  policy, recomputed by the trainer's own forward); `old_logprobs`. With one gradient step
  per batch pass `old_logprobs=None` and pi_old = stop_gradient(pi_theta).
* pi_beh — the distribution the engine actually sampled from, recorded per token at
  rollout time (`behaviour_logprobs`). Same weights as pi_old but a different program
  (paged decode kernels, other reduction orders, maybe a staler version), so in fast
  numerics pi_beh != pi_old: the rollout is off-policy even for the "on-policy" step.

Per token, with A_t the advantage, rho_t = pi_theta / pi_old (log-ratio clamped to +-20):

    surr_t = min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t)   # DAPO clip-higher
    w_t    = min(pi_old / pi_beh, tis_cap)          if cfg.tis else 1       # token TIS
    l_t    = -w_t surr_t + kl_coef k3(pi_theta || pi_ref)_t - entropy_coef H_t
    k3_t   = exp(ref_t - lp_t) - (ref_t - lp_t) - 1     (Schulman's k3; GRPO's KL term)

The PPO ratio and its clip act against pi_old (the trust region is about the trainer's
own update). The truncated importance weight w_t (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's TIS) corrects the sampling
mismatch pi_beh -> pi_old; it is data (no gradient) and multiplies only the policy-gradient
term — the KL and entropy regularisers are applied unweighted, as in verl.

MIS (sequence-level geometric masked importance sampling): a sequence whose geometric-mean
ratio exp(mean_t log(pi_old / pi_beh)) over its loss tokens lies outside
[mis_low, mis_high] is dropped from the loss entirely (all its terms, and from the
aggregation's denominators), as if its loss mask were all zero. A sequence without loss
tokens is never "masked". Both corrections are switchable; when pi_old == pi_beh (the
bitwise-deterministic mode) both are the identity: w_t = 1 (for tis_cap >= 1) and every
geometric mean is exactly 1.

Aggregation of the per-token loss l_t over the loss tokens M (loss mask, minus invalid
sequences, minus MIS-dropped sequences), with n_s tokens in sequence s and the "live"
sequences S* = {s : n_s > 0}:

* ``token_mean`` (DAPO, Yu et al. 2025): sum_{t in M} l_t / |M|.
* ``seq_mean_token_mean`` (GRPO, Shao et al. 2024): mean_{s in S*} (sum_t l_t / n_s).
* ``seq_mean_token_sum_norm`` (Dr.GRPO, Liu et al. 2025): mean_{s in S*}
  (sum_t l_t / max_tokens), a constant normaliser independent of the sequence length.

Empty batches give loss 0, never NaN. For gradient accumulation pass the full batch's
denominator (|M|, or |S*| for the sequence modes) as `loss_denominator`, so microbatch
losses sum to the full-batch loss.

Infra failures: pass `valid=False` for them (and their advantage is 0 from
`group_advantages`); their tokens are removed from M, so they enter no term, no gradient,
no denominator and no metric. Values at positions outside M are never read (NaN or inf
there cannot leak into the loss or its gradient).

Packing: by default each row of [B, T] is one sequence. For packed rows pass `seq_ids`
[B, T] (sequence index per token, -1 for padding) and a static `num_seqs`; per-sequence
inputs (`advantages` given as [S], `valid` [S]) are then indexed by sequence.

The gradient norm belongs to the learner: `global_norm(grads)` below, logged as
``grad_norm`` next to these metrics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: large but finite, so 0 * ratio is never NaN


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static loss settings (hashable, so it can be closed over or passed as static)."""

  clip_low: float = 0.2  # ratio floor 1 - clip_low
  clip_high: float = 0.28  # ratio ceiling 1 + clip_high (DAPO clip-higher)
  aggregation: Aggregation = "token_mean"
  max_tokens: int | None = None  # Dr.GRPO's constant; required by seq_mean_token_sum_norm
  tis: bool = False  # token-level truncated importance sampling pi_old / pi_beh
  tis_cap: float = 2.0  # the truncation C
  mis: bool = False  # sequence-level geometric-mean masking
  mis_low: float = 0.999  # keep a sequence iff mis_low <= geo-mean ratio <= mis_high
  mis_high: float = 1.001
  kl_coef: float = 0.0  # k3 KL to the reference policy; 0 = off (ref_logprobs not needed)
  entropy_coef: float = 0.0  # entropy bonus; 0 = off (entropy not needed)

  def __post_init__(self):
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
    if self.aggregation == "seq_mean_token_sum_norm" and not (self.max_tokens or 0) > 0:
      raise ValueError("seq_mean_token_sum_norm needs max_tokens > 0")
    if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
      raise ValueError("need 0 <= clip_low < 1 and clip_high >= 0")
    if self.tis and not self.tis_cap > 0:
      raise ValueError("tis_cap must be > 0")
    if self.mis and not 0 < self.mis_low <= 1.0 <= self.mis_high:
      raise ValueError("need 0 < mis_low <= 1 <= mis_high")


def _f32(x):
  return jnp.asarray(x).astype(jnp.float32)


def k3(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """Schulman's k3 estimator of KL(q || p) from samples of q: exp(x) - x - 1, x = log p/q.

  Computed without cancellation: exp(x) - x - 1 ~ x^2 / 2 is tiny exactly in the regime
  it is meant to measure (a trainer/engine mismatch of 1e-3 in log-prob), where the naive
  f32 formula has ~10% relative error. A Taylor series for |x| < 0.1, expm1(x) - x above.
  """
  x = jnp.clip(log_p - log_q, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  small = jnp.abs(x) < 0.1
  xs = jnp.where(small, x, 0.0)
  series = xs * xs * (0.5 + xs * (1 / 6 + xs * (1 / 24 + xs * (1 / 120 + xs * (1 / 720)))))
  xl = jnp.where(small, 1.0, x)
  return jnp.where(small, series, jnp.expm1(xl) - xl)


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array | None,
                behaviour_logprobs: jax.Array | None, advantages: jax.Array,
                mask: jax.Array, *, cfg: LossConfig, valid: jax.Array | None = None,
                seq_ids: jax.Array | None = None, num_seqs: int | None = None,
                ref_logprobs: jax.Array | None = None, entropy: jax.Array | None = None,
                loss_denominator: jax.Array | float | None = None,
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The policy loss and its metrics (see the module docstring for the definitions).

  Args:
    logprobs: [B, T] log pi_theta of the sampled tokens (differentiated).
    old_logprobs: [B, T] log pi_old, or None for stop_gradient(logprobs).
    behaviour_logprobs: [B, T] log pi_beh recorded by the engine, or None (= pi_old).
    advantages: [B, T] per token, or [S] per sequence.
    mask: [B, T] loss mask (nonzero on tokens the policy produced).
    cfg: LossConfig.
    valid: optional [S] bool; False (infra failure, padding) removes the whole sequence.
    seq_ids: optional [B, T] int sequence index per token for packed rows; ids outside
      [0, num_seqs) are padding. Default: row b is sequence b (S = B).
    num_seqs: static S when seq_ids is given.
    ref_logprobs: [B, T] log pi_ref; required when cfg.kl_coef != 0, else only logged.
    entropy: [B, T] per-token entropy of pi_theta (e.g. `entropy_from_logits`), required
      when cfg.entropy_coef != 0, else only logged. Differentiated.
    loss_denominator: overrides |M| (token_mean) or |S*| (sequence modes).

  Returns:
    (loss, metrics). Metrics over the loss tokens M: ``pg_loss`` (the aggregated
    -w surr term), ``clip_frac`` (tokens where the clip is active, i.e. the clipped branch
    is selected and zeroes the gradient: A > 0 and rho > 1 + clip_high, or A < 0 and
    rho < 1 - clip_low), ``clip_frac_low``, ``clip_frac_high``, ``ratio_mean``,
    ``ratio_max``, ``adv_mean``/``adv_std`` (population)/``adv_min``/``adv_max``,
    ``entropy`` and ``kl`` (token means, when given), ``masked_token_count`` (|M|),
    ``num_seqs_live``. Mismatch diagnostics over the loss tokens *before* MIS (so
    rejected sequences still show): ``is_weight_mean``/``is_weight_max`` of the raw
    pi_old / pi_beh, ``mismatch_k3_kl`` = mean k3 estimate of KL(pi_beh || pi_old),
    ``tis_trunc_frac`` (weights above tis_cap; when cfg.tis), ``mis_masked_frac``
    (fraction of sequences with loss tokens that MIS dropped; when cfg.mis).
  """
  lp = _f32(logprobs)
  if lp.ndim != 2:
    raise ValueError(f"logprobs must be [B, T], got shape {lp.shape}")
  b, t = lp.shape
  if cfg.kl_coef and ref_logprobs is None:
    raise ValueError("kl_coef != 0 needs ref_logprobs")
  if cfg.entropy_coef and entropy is None:
    raise ValueError("entropy_coef != 0 needs entropy")

  # Which sequence each token belongs to, and the loss tokens before MIS.
  if seq_ids is None:
    num_s = b
    seg = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    in_range = jnp.ones((b, t), bool)
  else:
    if num_seqs is None:
      raise ValueError("seq_ids needs a static num_seqs")
    num_s = num_seqs
    seg = jnp.asarray(seq_ids, jnp.int32)
    in_range = (seg >= 0) & (seg < num_s)
    seg = jnp.where(in_range, seg, 0)
  m0 = (jnp.asarray(mask) != 0) & in_range
  if valid is not None:
    m0 = m0 & jnp.asarray(valid, bool)[seg]
  seg_flat = seg.reshape(-1)
  seq_sum = lambda x: jax.ops.segment_sum(x.reshape(-1), seg_flat, num_segments=num_s)

  # Sanitise: nothing outside the loss tokens is ever read, even through a gradient.
  z = lambda x: jnp.where(m0, _f32(x), 0.0)
  lp = z(lp)
  old = jax.lax.stop_gradient(lp if old_logprobs is None else z(old_logprobs))
  beh = old if behaviour_logprobs is None else z(behaviour_logprobs)
  adv = _f32(advantages)
  adv = z(adv[seg] if adv.ndim == 1 else adv)

  # Rollout-vs-trainer mismatch (data, no gradient).
  log_w = jnp.clip(old - beh, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  w_raw = jnp.exp(log_w)
  m0f = m0.astype(jnp.float32)
  n0 = jnp.sum(m0f)
  mean0 = lambda x: jnp.sum(x * m0f) / jnp.maximum(n0, 1.0)
  metrics = {
      "is_weight_mean": mean0(w_raw),
      "is_weight_max": jnp.max(jnp.where(m0, w_raw, 0.0)),
      "mismatch_k3_kl": mean0(jnp.where(m0, k3(old, beh), 0.0)),
  }

  m = m0
  if cfg.mis:
    n_s0 = seq_sum(m0f)
    log_geo = seq_sum(log_w) / jnp.maximum(n_s0, 1.0)
    keep = (n_s0 == 0) | ((log_geo >= math.log(cfg.mis_low)) &
                          (log_geo <= math.log(cfg.mis_high)))
    m = m0 & keep[seg]
    has0 = (n_s0 > 0).astype(jnp.float32)
    metrics["mis_masked_frac"] = (jnp.sum(has0 * (~keep).astype(jnp.float32)) /
                                  jnp.maximum(jnp.sum(has0), 1.0))
  if cfg.tis:
    w = jnp.minimum(w_raw, cfg.tis_cap)
    metrics["tis_trunc_frac"] = mean0((w_raw > cfg.tis_cap).astype(jnp.float32))
  else:
    w = jnp.ones_like(w_raw)
  w = jax.lax.stop_gradient(w)

  # PPO clip-higher surrogate against pi_old.
  ratio = jnp.exp(jnp.clip(lp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
  surr = jnp.minimum(ratio * adv, clipped * adv)
  pg_tok = -w * surr
  tok = pg_tok
  if ref_logprobs is not None:
    kl_tok = k3(z(ref_logprobs), lp)  # KL(pi_theta || pi_ref), samples from pi_theta
    if cfg.kl_coef:
      tok = tok + cfg.kl_coef * kl_tok
  if entropy is not None:
    ent_tok = z(entropy)
    if cfg.entropy_coef:
      tok = tok - cfg.entropy_coef * ent_tok

  # Aggregation over the loss tokens M.
  mf = m.astype(jnp.float32)
  n_tok = jnp.sum(mf)
  n_s = seq_sum(mf)
  n_live = jnp.sum((n_s > 0).astype(jnp.float32))
  if cfg.aggregation == "token_mean":
    denom = n_tok if loss_denominator is None else _f32(loss_denominator)
    per_seq_norm = None
  else:
    denom = n_live if loss_denominator is None else _f32(loss_denominator)
    if cfg.aggregation == "seq_mean_token_mean":
      per_seq_norm = jnp.maximum(n_s, 1.0)
    else:
      per_seq_norm = jnp.float32(cfg.max_tokens)
  denom = jnp.where(denom > 0, denom, 1.0)  # no loss tokens: the numerator is 0

  def agg(x):
    x = jnp.where(m, x, 0.0)
    total = jnp.sum(x) if per_seq_norm is None else jnp.sum(seq_sum(x) / per_seq_norm)
    return total / denom

  loss = agg(tok)

  mean = lambda x: jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(n_tok, 1.0)
  big = jnp.float32(jnp.inf)
  any_tok = n_tok > 0
  clip_hi = m & (adv > 0) & (ratio > 1.0 + cfg.clip_high)
  clip_lo = m & (adv < 0) & (ratio < 1.0 - cfg.clip_low)
  adv_mean = mean(adv)
  metrics.update({
      "loss": loss,
      "pg_loss": agg(pg_tok),
      "clip_frac": mean((clip_hi | clip_lo).astype(jnp.float32)),
      "clip_frac_high": mean(clip_hi.astype(jnp.float32)),
      "clip_frac_low": mean(clip_lo.astype(jnp.float32)),
      "ratio_mean": mean(ratio),
      "ratio_max": jnp.max(jnp.where(m, ratio, 0.0)),
      "adv_mean": adv_mean,
      "adv_std": jnp.sqrt(mean((adv - adv_mean) ** 2)),
      "adv_min": jnp.where(any_tok, jnp.min(jnp.where(m, adv, big)), 0.0),
      "adv_max": jnp.where(any_tok, jnp.max(jnp.where(m, adv, -big)), 0.0),
      "masked_token_count": n_tok,
      "num_seqs_live": n_live,
  })
  if ref_logprobs is not None:
    metrics["kl"] = mean(kl_tok)
  if entropy is not None:
    metrics["entropy"] = mean(ent_tok)
  metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
  return loss, metrics


def entropy_from_logits(logits: jax.Array) -> jax.Array:
  """Per-position entropy [..., V] -> [...] in f32 (log-softmax in f32; -inf logits ok).

  Materialises an f32 copy of the logits; for large vocabularies call it per chunk.
  """
  logp = jax.nn.log_softmax(_f32(logits), axis=-1)
  finite = jnp.isfinite(logp)
  logp = jnp.where(finite, logp, 0.0)
  return -jnp.sum(jnp.where(finite, jnp.exp(logp) * logp, 0.0), axis=-1)


def global_norm(tree) -> jax.Array:
  """sqrt(sum of squares) over every leaf, accumulated in f32 (the learner's grad_norm)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.float32(0.0)
  return jnp.sqrt(sum(jnp.sum(jnp.square(_f32(x))) for x in leaves))
