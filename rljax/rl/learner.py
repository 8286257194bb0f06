"""The learner: a train state and one jitted `(state, batch) -> (state, metrics)` step.

The state holds f32 master params, the optax state and the step. The forward runs on the
params cast to the serving dtype (bf16), the same bits the engine samples with, so in
deterministic mode the trainer's log-probs equal the behaviour log-probs exactly; the
gradient flows back through the cast into the f32 masters. Microbatches are a `lax.scan`
over the leading axis of the batch (one trace, fixed shapes). A step whose loss or
gradients are not finite is skipped: params, optimizer state and step stay as they were,
and `metrics["skipped"]` says so.

LoRA (`lora=LoraConfig`): the state's params are the adapters' f32 masters (their
gradients and optimizer state only); the frozen base (serving dtype, bf16) is an argument
of every step, never copied into the state. The forward runs on `lora.merge(base,
adapters)`, the function the engine's weights come from (`serving_params`), so
deterministic mode stays bitwise engine = trainer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from rljax import distributed
from rljax import sharding as sharding_lib
from rljax.model import ModelConfig, abstract_params, forward, param_shardings
from rljax.model import lora as lora_lib
from rljax.numerics import Numerics
from rljax.rl.batch import TrainBatch
from rljax.rl.losses import LossConfig, global_norm, policy_loss


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  params: Any  # f32 masters
  opt_state: Any
  step: jax.Array  # int32 applied updates


def make_optimizer(learning_rate: float | optax.Schedule, *, weight_decay: float = 0.0,
                   clip_norm: float = 1.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, skip_empty: bool = False) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW. `skip_empty`: a step whose gradient is exactly zero
  (a GRPO batch in which no sample has an advantage) moves nothing: Adam's moments and
  count stay as they were, while the learning-rate schedule still advances with the step.
  Plain Adam would keep moving on such steps on the momentum of the last batch that had a
  signal (and its second moment, decaying towards zero, would make the next signal's step
  larger): from a sharp start, where most batches tie, a single sample's gradient then
  moves every parameter by several learning rates (experiments/study_vs_trl.py)."""
  direction = optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                          optax.add_decayed_weights(weight_decay))
  if skip_empty:
    direction = _skip_without_gradient(direction)
  return optax.chain(optax.clip_by_global_norm(clip_norm), direction,
                     optax.scale_by_learning_rate(learning_rate))


def _skip_without_gradient(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner`, except that an all-zero gradient gives a zero update and leaves its state."""

  def update(grads, state, params=None):
    signal = optax.tree.norm(grads) > 0
    updates, new_state = inner.update(grads, state, params)
    updates = jax.tree.map(lambda u: jnp.where(signal, u, jnp.zeros_like(u)), updates)
    return updates, jax.tree.map(lambda new, old: jnp.where(signal, new, old), new_state, state)

  return optax.GradientTransformation(inner.init, update)


def signal_fraction(batches: TrainBatch) -> jax.Array:
  """The share of the batch's trainable samples (valid) whose advantage is not zero."""
  valid = jnp.asarray(batches.valid, bool)
  signal = valid & (jnp.asarray(batches.advantages) != 0)
  return jnp.sum(signal.astype(jnp.float32)) / jnp.maximum(jnp.sum(valid.astype(jnp.float32)),
                                                           1.0)


def init_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
  # a copy: the step donates the state, which must not delete the caller's arrays
  params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
  # committed: optax's step counts are made uncommitted, the step's outputs are not
  return sharding_lib.committed(
      TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32)))


def state_shardings(cfg: ModelConfig, optimizer: optax.GradientTransformation,
                    sharding: sharding_lib.Sharding,
                    lora: lora_lib.LoraConfig | None = None) -> TrainState:
  """NamedShardings of the whole state: optimizer moments follow their params (the
  adapters' with `lora`)."""
  if lora is None:
    p_sh = param_shardings(cfg, sharding)
    abstract = abstract_params(cfg, jnp.float32)
  else:
    p_sh = sharding.tree_shardings(lora_lib.adapter_axes(cfg, lora))
    abstract = jax.eval_shape(lambda k: lora_lib.init_adapters(cfg, lora, k),
                              jax.random.key(0))
  opt_abstract = jax.eval_shape(optimizer.init, abstract)
  replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  opt_sh = optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, opt_abstract, p_sh,
                                            transform_non_params=lambda _: replicated)
  return TrainState(p_sh, opt_sh, replicated)


def serving_params(state: TrainState, cfg: ModelConfig, *, base: Any = None,
                   lora: lora_lib.LoraConfig | None = None) -> Any:
  """The params the engine samples with (and the trainer's forward sees): cfg.param_dtype;
  with `lora`, the frozen `base` with the state's adapters merged in."""
  if lora is not None:
    return merged_params(base, state.params, lora)
  return jax.tree.map(lambda x: x.astype(cfg.param_dtype), state.params)


@functools.partial(jax.jit, static_argnums=(2,))
def merged_params(base: Any, adapters: Any, lora: lora_lib.LoraConfig) -> Any:
  """`lora.merge(base, adapters)` as a program of its own, never fused into a caller's:
  the trainer's `serving_params` and a rollout host's weights (the base and the adapters
  it read from the weight stream, rljax.pipeline.adapter_stream) both come from here. The
  merge is elementwise, so the bits do not depend on which devices hold the inputs: in
  deterministic numerics a host on its own mesh serves the trainer's weights exactly."""
  return lora_lib.merge(base, adapters, lora)


def _grpo_microbatch_loss(params, mb: TrainBatch, current_version, *, cfg, numerics,
                          loss_cfg, replay, sharding, temperature, denominator,
                          ref_params=None):
  # f32 masters go in: every use casts to the compute dtype (the serving params' bits) and
  # the gradients come back in f32 (rljax.numerics.matmul)
  routing = mb.routing if replay else None
  out = forward(params, mb.tokens, mb.positions, cfg=cfg, numerics=numerics,
                segment_ids=mb.segment_ids, targets=mb.targets, temperature=temperature,
                routing=routing, entropy=True, sharding=sharding)
  ref_logprobs = None
  if ref_params is not None:  # the frozen start policy: forward only, routed alike
    ref_logprobs = lax.stop_gradient(forward(
        ref_params, mb.tokens, mb.positions, cfg=cfg, numerics=numerics,
        segment_ids=mb.segment_ids, targets=mb.targets, temperature=temperature,
        routing=routing, sharding=sharding).logprobs)
  # the entropy is logged, not trained on (rl.loss.entropy_coef is 0: run.py)
  loss, metrics = policy_loss(out.logprobs, None, mb.behaviour_logprobs, mb.advantages,
                              mb.loss_mask, cfg=loss_cfg, valid=mb.valid, seq_ids=mb.seq_ids,
                              num_seqs=mb.advantages.shape[0], loss_denominator=denominator,
                              entropy=lax.stop_gradient(out.entropy),
                              ref_logprobs=ref_logprobs)
  on = mb.loss_mask & (mb.seq_ids >= 0)
  # only tokens sampled with the weights trained on now (-1: every token)
  on &= (current_version < 0) | (mb.versions == current_version)
  # jnp.max propagates a NaN on a covered token; `mismatch_tokens` says what it covers
  metrics["mismatch_max_abs"] = jnp.max(jnp.where(on, jnp.abs(
      out.logprobs - mb.behaviour_logprobs), 0.0))
  metrics["mismatch_tokens"] = jnp.sum(on.astype(jnp.int32))
  return loss, metrics


def _sft_microbatch_loss(params, mb: TrainBatch, *, cfg, numerics, sharding, denominator):
  lp = forward(params, mb.tokens, mb.positions, cfg=cfg, numerics=numerics,
               segment_ids=mb.segment_ids, targets=mb.targets, sharding=sharding).logprobs
  nll = -jnp.sum(jnp.where(mb.loss_mask, lp, 0.0)) / denominator
  return nll, {"nll": nll}


# policy_loss's per-microbatch token means that the step reports as means over all of its
# loss tokens (a microbatch without loss tokens reports 0 and weighs nothing)
TOKEN_MEANS = frozenset({"entropy", "kl"})


def _apply(state: TrainState, optimizer, loss_fn, batches: TrainBatch, update_scale=None,
           step_clip_norm: float | None = None):
  """Accumulates gradients over the microbatch axis, then applies them if finite (times
  `update_scale`, a traced scalar, when given; times min(1, step_clip_norm / grad_norm)
  with `step_clip_norm`)."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def body(acc, mb):
    (loss, metrics), grads = grad_fn(state.params, mb)
    return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  grads, (losses, metrics) = lax.scan(body, zeros, batches)
  loss = jnp.sum(losses)
  grad_norm = global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  if step_clip_norm is not None:
    shrink = jnp.minimum(1.0, step_clip_norm / jnp.maximum(grad_norm, 1e-30))
    update_scale = shrink if update_scale is None else update_scale * shrink
  if update_scale is not None:
    updates = jax.tree.map(lambda u: u * update_scale.astype(u.dtype), updates)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
  new_state = TrainState(jax.tree.map(keep, params, state.params),
                         jax.tree.map(keep, opt_state, state.opt_state),
                         state.step + finite.astype(jnp.int32))
  out = {k: jnp.mean(v) for k, v in metrics.items()}
  if "masked_token_count" in metrics:  # token means over the whole batch's loss tokens
    n = metrics["masked_token_count"]
    for k in sorted(TOKEN_MEANS & set(metrics)):  # a set iterates in the hash seed's order
      out[k] = jnp.sum(metrics[k] * n) / jnp.maximum(jnp.sum(n), 1.0)
  if "mismatch_max_abs" in metrics:
    out["mismatch_max_abs"] = jnp.max(metrics["mismatch_max_abs"])
    out["mismatch_tokens"] = jnp.sum(metrics["mismatch_tokens"])
  out.update(loss=loss, grad_norm=grad_norm, skipped=~finite)
  return new_state, out


def make_grpo_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, *,
                   numerics: Numerics, loss_cfg: LossConfig, replay: bool = True,
                   temperature: float = 1.0, sharding: sharding_lib.Sharding | None = None,
                   state_sharding: TrainState | None = None,
                   lora: lora_lib.LoraConfig | None = None, reference: bool = False,
                   scale_by_signal: bool = False, step_clip_norm: float | None = None):
  """Jitted `(state, microbatches[, current_version][, base=][, ref_params=]) -> (state,
  metrics)`; the state is donated (with `lora`, `base` is the frozen base params, not
  donated).

  `microbatches` is a TrainBatch whose leaves carry a leading microbatch axis
  (`split_microbatches`). The token-mean denominator is the whole batch's loss-token count.
  `current_version` (the version of the params in `state`; -1 = unknown) limits
  `mismatch_max_abs` to the tokens that version sampled (`mismatch_tokens` of them): in an
  async run older tokens differ by design (their behaviour is another policy).

  Metrics include `entropy`, the token mean of the policy's entropy per loss token (at
  `temperature`; data, never differentiated). `reference`: the step takes `ref_params`,
  a frozen reference policy (serving dtype, not donated; `rl.kl_to_start`: the params GRPO
  started from), scores each microbatch with it (one more forward, no backward, router
  replay as the policy's) and reports `kl`, the k3 estimate of KL(pi_theta || pi_ref) per
  loss token; `loss_cfg.kl_coef` != 0 adds it to the loss. Without `reference` no
  reference params are held or run.

  `scale_by_signal`: the optimizer's update is multiplied by the share of the batch's
  trainable samples that have an advantage (`signal_fraction`, logged as
  `signal_fraction`), so a batch in which one group of sixteen has a signal moves the
  params a sixteenth of what a batch whose every group has one does. Adam normalises the
  gradient's size away: without this, one sample's gradient moves every parameter as far
  as a whole batch's would.
  """
  if loss_cfg.entropy_coef:
    raise ValueError("the GRPO step logs the entropy as data (no gradient through it): "
                     "entropy_coef must be 0")
  if loss_cfg.kl_coef and not reference:
    raise ValueError("kl_coef != 0 needs a reference policy: make_grpo_step(reference=True)")

  def step(state: TrainState, batches: TrainBatch, current_version, base, ref_params):
    denominator = jnp.maximum(jnp.sum(batches.loss_mask & (batches.seq_ids >= 0)), 1)
    if loss_cfg.aggregation != "token_mean":
      denominator = None  # sequence means per microbatch, summed (one microbatch = exact)
    loss_fn = functools.partial(_grpo_microbatch_loss, current_version=current_version,
                                cfg=cfg, numerics=numerics, loss_cfg=loss_cfg, replay=replay,
                                sharding=sharding, temperature=temperature,
                                denominator=denominator, ref_params=ref_params)
    if lora is not None:
      loss_fn = _on_merged(loss_fn, base, lora)
    fraction = signal_fraction(batches)
    state, metrics = _apply(state, optimizer, loss_fn, batches,
                            fraction if scale_by_signal else None, step_clip_norm)
    return state, metrics | {"signal_fraction": fraction}

  jitted = jax.jit(step, donate_argnums=(0,),
                   in_shardings=None if state_sharding is None else (state_sharding, None, None,
                                                                     None, None),
                   out_shardings=None if state_sharding is None else (state_sharding, None))
  together = distributed.started_together(jitted, "grpo step", sharding and sharding.mesh)

  def run(state: TrainState, batches: TrainBatch, current_version: int = -1, *,
          base: Any = None, ref_params: Any = None):
    if (base is None) != (lora is None):
      raise ValueError("a LoRA step takes the frozen base params (base=...), and only it")
    if (ref_params is None) == reference:
      raise ValueError("a step made with reference=True takes the reference policy's params "
                       "(ref_params=...), and only it")
    return together(state, batches, np.int32(current_version), base, ref_params)

  run.jitted = jitted  # for ahead-of-time lowering (experiments/aot_check.py)
  return run


def _on_merged(loss_fn, base, lora):
  """loss_fn of the adapters: the base with them merged in (the engine's weights)."""
  return lambda adapters, mb: loss_fn(lora_lib.merge(base, adapters, lora), mb)


def make_sft_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, *,
                  numerics: Numerics, sharding: sharding_lib.Sharding | None = None):
  """Jitted SFT (masked next-token NLL) step on the same state, for the warm start."""
  def step(state: TrainState, batches: TrainBatch):
    denominator = jnp.maximum(jnp.sum(batches.loss_mask), 1)
    loss_fn = functools.partial(_sft_microbatch_loss, cfg=cfg, numerics=numerics,
                                sharding=sharding, denominator=denominator)
    return _apply(state, optimizer, loss_fn, batches)

  return distributed.started_together(jax.jit(step, donate_argnums=(0,)), "sft step",
                                     sharding and sharding.mesh)
