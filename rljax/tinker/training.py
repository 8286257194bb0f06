"""One Tinker training client's state: LoRA adapters on a frozen base, the gradients summed
over `forward_backward` calls, and AdamW applied by `optim_step`.

Tinker's losses are sums over every token of every datum (never means), with the
learner's log-probability `lp` of each target token, the sampler's `q`, advantages `A` and
weights `w`:

  cross_entropy        sum(-lp * w)
  importance_sampling  sum(-exp(lp - q) * A)
  ppo                  sum(-min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)),
                       r = exp(lp - q), thresholds from the loss config (0.8, 1.2)

A datum is `model_input` tokens [N] with per-token inputs [N] (target_tokens: the token
after each position); its output is `lp` [N]. Datums are packed into rows
(`rljax.model.packing`: one segment each), rows and row length rounded up to powers of two
so the jitted programs are a few shapes. The adapters' model is the base with them merged
(`lora.merge`: what a sampler of these weights serves).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.model import ModelConfig, forward
from rljax.model import lora as lora_lib
from rljax.model.packing import pack, unpack
from rljax.numerics import Numerics
from rljax.rl import learner
from rljax.rl.losses import global_norm

LOSSES = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
MIN_ROW = 64


class UserError(ValueError):
  """A request the client can fix (the SDK raises it as RequestFailedError, category user)."""


@dataclasses.dataclass(frozen=True)
class Datum:
  tokens: np.ndarray  # [N] int32 model input
  inputs: dict[str, np.ndarray]  # loss_fn_inputs, each [N]


@dataclasses.dataclass(frozen=True)
class AdamParams:
  """Tinker's AdamParams: AdamW with decoupled weight decay, global-norm clip (0: none)."""

  learning_rate: float = 1e-4
  beta1: float = 0.9
  beta2: float = 0.95
  eps: float = 1e-12
  weight_decay: float = 0.0
  grad_clip_norm: float = 0.0

  @classmethod
  def from_dict(cls, d: dict) -> "AdamParams":
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise UserError(f"unknown adam_params {sorted(unknown)}")
    params = cls(**{k: float(v) for k, v in d.items()})
    if not (params.learning_rate >= 0 and 0 <= params.beta1 < 1 and 0 <= params.beta2 < 1
            and params.eps > 0 and params.weight_decay >= 0 and params.grad_clip_norm >= 0):
      raise UserError(f"adam_params out of range: {params}")
    return params


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
  """The weights a sampling client samples with: the base with `adapters` merged (None:
  the base itself). Only the adapters are kept (a LoRA's size, not the model's): the
  sampler merges them when it switches to them."""

  lora: lora_lib.LoraConfig | None = None
  adapters: Any = None


def _pow2(n: int, floor: int) -> int:
  return max(floor, 1 << max(0, (n - 1).bit_length()))


def _token_loss(kind: str, lp, inputs, clip):
  if kind == "cross_entropy":
    return -lp * inputs["weights"]
  ratio = jnp.exp(lp - inputs["logprobs"])
  a = inputs["advantages"]
  if kind == "importance_sampling":
    return -ratio * a
  return -jnp.minimum(ratio * a, jnp.clip(ratio, clip[0], clip[1]) * a)


@functools.partial(jax.jit, static_argnames=("cfg", "numerics", "lora", "kind", "backward"))
def _loss_and_grads(adapters, base, batch, clip, *, cfg, numerics, lora, kind, backward):
  """(loss sum, per-token log-probs [rows, row_len], adapter gradients or None)."""
  def loss(adapters):
    params = lora_lib.merge(base, adapters, lora)
    lp = forward(params, batch["tokens"], batch["positions"], cfg=cfg, numerics=numerics,
                 segment_ids=batch["segments"], targets=batch["target_tokens"]).logprobs
    per_token = _token_loss(kind, lp, batch, clip)
    return jnp.sum(jnp.where(batch["segments"] > 0, per_token, 0.0)), lp

  if not backward:
    total, lp = loss(adapters)
    return total, lp, None
  (total, lp), grads = jax.value_and_grad(loss, has_aux=True)(adapters)
  return total, lp, grads


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _adamw(adapters, opt_state, grads, hyper):
  """One AdamW step on the summed gradients (clipped to hyper['clip'] global norm if > 0)."""
  norm = global_norm(grads)
  scale = jnp.where((hyper["clip"] > 0) & (norm > hyper["clip"]), hyper["clip"] / norm, 1.0)
  grads = jax.tree.map(lambda g: g * scale, grads)
  count = opt_state["count"] + 1
  mu = jax.tree.map(lambda m, g: hyper["b1"] * m + (1 - hyper["b1"]) * g, opt_state["mu"], grads)
  nu = jax.tree.map(lambda v, g: hyper["b2"] * v + (1 - hyper["b2"]) * g * g, opt_state["nu"],
                    grads)
  c1, c2 = 1 - hyper["b1"] ** count, 1 - hyper["b2"] ** count

  def update(p, m, v):
    step = (m / c1) / (jnp.sqrt(v / c2) + hyper["eps"]) + hyper["wd"] * p
    return p - hyper["lr"] * step

  adapters = jax.tree.map(update, adapters, mu, nu)
  return adapters, {"count": count, "mu": mu, "nu": nu}, norm


def _zeros_like(tree: Any) -> Any:
  return jax.tree.map(jnp.zeros_like, tree)


def _fresh_adam(adapters: Any) -> dict[str, Any]:
  """AdamW's state before its first step: no steps, zero moments."""
  return {"count": jnp.zeros((), jnp.int32), "mu": _zeros_like(adapters),
          "nu": _zeros_like(adapters)}


class LoraTrainer:
  """A training client's adapters on `base` (the model's params in its serving dtype)."""

  def __init__(self, cfg: ModelConfig, base: Any, lora: lora_lib.LoraConfig, *, seed: int,
               numerics: Numerics, max_tokens: int):
    self.cfg, self.base, self.lora, self.numerics = cfg, base, lora, numerics
    self.max_tokens = max_tokens
    self.adapters = lora_lib.init_adapters(cfg, lora, jax.random.key(seed))
    self.grads = _zeros_like(self.adapters)
    self.opt_state = _fresh_adam(self.adapters)
    self.pending_datums = 0  # datums whose gradients are in self.grads

  def merged(self) -> Any:
    """The base with the adapters merged: the weights a sampler of this client serves."""
    return learner.merged_params(self.base, self.adapters, self.lora)

  def snapshot(self) -> Snapshot:
    """The adapters as they are now (copied: `optim_step` donates the live ones)."""
    return Snapshot(self.lora, jax.tree.map(jnp.copy, self.adapters))

  def check(self, datums: list[Datum], kind: str) -> None:
    if kind not in LOSSES:
      raise UserError(f"loss_fn {kind!r} is not supported; this server has {sorted(LOSSES)}")
    if not datums:
      raise UserError("forward_backward needs at least one datum")
    for i, d in enumerate(datums):
      n = len(d.tokens)
      if n == 0 or n > self.max_tokens:
        raise UserError(f"datum {i}: model_input has {n} tokens; this model takes 1 to "
                        f"{self.max_tokens}")
      if d.tokens.min() < 0 or d.tokens.max() >= self.cfg.vocab_size:
        raise UserError(f"datum {i}: model_input token ids must be in [0, "
                        f"{self.cfg.vocab_size})")
      missing = [k for k in LOSSES[kind] if k not in d.inputs]
      if missing:
        raise UserError(f"datum {i}: loss {kind!r} needs loss_fn_inputs {missing}")
      for key in LOSSES[kind]:
        if d.inputs[key].shape != (n,):
          raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has shape "
                          f"{list(d.inputs[key].shape)}, model_input has {n} tokens")
        if not np.all(np.isfinite(d.inputs[key])):
          raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] is not finite")
      targets = d.inputs["target_tokens"]
      if targets.min() < 0 or targets.max() >= self.cfg.vocab_size:
        raise UserError(f"datum {i}: target_tokens must be in [0, {self.cfg.vocab_size})")

  def forward_backward(self, datums: list[Datum], kind: str, config: dict[str, float],
                       *, backward: bool = True) -> tuple[list[np.ndarray], dict[str, float]]:
    """Per-datum log-probs of the target tokens and the metrics; with `backward`, the
    loss's gradients are added to those since the last `optim_step`."""
    self.check(datums, kind)
    clip = (float(config.get("clip_low_threshold", PPO_CLIP["clip_low_threshold"])),
            float(config.get("clip_high_threshold", PPO_CLIP["clip_high_threshold"])))
    unknown = set(config) - set(PPO_CLIP)
    if unknown:
      raise UserError(f"loss_fn_config keys {sorted(unknown)} are not known to {kind!r}")
    page = self.cfg.page_size
    row_len = _pow2(max(len(d.tokens) for d in datums), MIN_ROW)
    row_len = -(-row_len // page) * page
    packed = pack([d.tokens for d in datums], row_len, page)
    rows = packed.tokens.shape[0]
    pad = ((0, _pow2(rows, 1) - rows), (0, 0))  # padding rows: segment 0, no loss
    packed = dataclasses.replace(packed, **{f: np.pad(getattr(packed, f), pad) for f in
                                            ("tokens", "positions", "segment_ids")})
    batch = {"tokens": packed.tokens, "positions": packed.positions,
             "segments": packed.segment_ids}
    for key in LOSSES[kind]:
      dtype = np.int32 if key == "target_tokens" else np.float32
      arr = np.zeros(packed.tokens.shape, dtype)
      for d, (row, start, n) in zip(datums, packed.placements):
        arr[row, start:start + n] = d.inputs[key]
      batch[key] = arr
    total, lp, grads = _loss_and_grads(
        self.adapters, self.base, batch, jnp.asarray(clip, jnp.float32), cfg=self.cfg,
        numerics=self.numerics, lora=self.lora, kind=kind, backward=backward)
    if backward:
      self.grads = jax.tree.map(jnp.add, self.grads, grads)
      self.pending_datums += len(datums)
    logprobs = unpack(np.asarray(lp, np.float32), packed)
    tokens = sum(len(d.tokens) for d in datums)
    return logprobs, {"loss:sum": float(total), "tokens:sum": float(tokens)}

  def state(self) -> dict[str, Any]:
    """What `save_state` keeps: the adapters and AdamW's moments and step count."""
    return {"adapters": self.adapters, "opt_state": self.opt_state}

  def load_state(self, state: dict[str, Any], *, optimizer: bool) -> None:
    """The adapters of a saved state (and, with `optimizer`, its AdamW state; else a fresh
    one); gradients summed since the last optim_step are dropped."""
    self.adapters = state["adapters"]
    self.opt_state = state["opt_state"] if optimizer else _fresh_adam(self.adapters)
    self.grads = _zeros_like(self.adapters)
    self.pending_datums = 0

  def optim_step(self, adam: AdamParams) -> dict[str, float]:
    hyper = {"lr": adam.learning_rate, "b1": adam.beta1, "b2": adam.beta2, "eps": adam.eps,
             "wd": adam.weight_decay, "clip": adam.grad_clip_norm}
    hyper = {k: jnp.float32(v) for k, v in hyper.items()}
    self.adapters, self.opt_state, norm = _adamw(self.adapters, self.opt_state, self.grads,
                                                 hyper)
    self.grads = _zeros_like(self.adapters)
    datums, self.pending_datums = self.pending_datums, 0
    return {"optim/grad_norm:mean": float(norm), "optim/datums:sum": float(datums),
            "optim/step:max": float(self.opt_state["count"])}
