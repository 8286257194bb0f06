"""LoRA adapters in the functional model (rljax.model.lora) and the learner: specs and
logical axes, the merge against numpy's einsum, a fresh adapter changing nothing,
gradients reaching the adapters (finite differences), and in deterministic numerics two
on-policy LoRA GRPO steps whose trainer log-probs (the merge inside the differentiated
step) are bitwise the engine's (merged once per version)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sharding as sharding_lib
from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.envs import ArithmeticEnv, Verdict
from rljax.model import ModelConfig, forward, init_params
from rljax.model.lora import (DEFAULT_TARGETS, LoraConfig, adapter_axes, init_adapters,
                              merge)
from rljax.model.scoring import next_token_targets
from rljax.numerics import Numerics
from tests.shapes import TINY

DET = Numerics("deterministic")
LORA = LoraConfig(rank=4, alpha=8.0, targets=DEFAULT_TARGETS + ("moe.router",))


def _nonzero(adapters, seed=1, std=0.5):
  """Adapters with random A and B (a fresh B is zero): an adapted model that differs."""
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [std * jax.random.normal(k, x.shape, x.dtype)
                                   for k, x in zip(keys, leaves)])


class _FakeMesh:
  shape = {"data": 2, "fsdp": 4, "expert": 8, "model": 2}


def test_adapters_mirror_their_base_weights_and_shard_like_them(tiny_cfg):
  tiny_cfg = dataclasses.replace(tiny_cfg, num_hidden_layers=3)  # two MoE layers stacked
  ad = init_adapters(tiny_cfg, LORA, jax.random.key(0))
  axes = adapter_axes(tiny_cfg, LORA)
  moe, dense = ad["layers"]["moe"], ad["layers"]["dense"]
  nm, e, d, f = 2, tiny_cfg.num_experts, tiny_cfg.hidden_size, tiny_cfg.moe_intermediate_size
  assert moe["moe"]["gate"]["a"].shape == (nm, d, e, 4)
  assert moe["moe"]["gate"]["b"].shape == (nm, e, 4, f)
  assert moe["moe"]["down"]["a"].shape == (nm, e, f, 4)
  assert moe["moe"]["down"]["b"].shape == (nm, e, 4, d)
  assert axes["layers"]["moe"]["moe"]["gate"] == {"a": ("layers", "embed", "expert", None),
                                                  "b": ("layers", "expert", None, "mlp")}
  assert axes["layers"]["moe"]["moe"]["down"] == {"a": ("layers", "expert", "mlp", None),
                                                  "b": ("layers", "expert", None, "embed")}
  assert axes["layers"]["dense"]["attn"]["q"] == {"a": ("layers", "embed", None),
                                                  "b": ("layers", None, "heads")}
  assert set(dense) == {"attn", "mlp"} and set(moe) == {"attn", "moe"}
  assert set(moe["moe"]) == {"gate", "up", "down", "router"}
  s = sharding_lib.Sharding(_FakeMesh())
  # A's input axis and B's output axis shard as the base weight's do
  assert s.spec(axes["layers"]["moe"]["moe"]["gate"]["a"])[1:3] == s.spec(
      ("layers", "embed", "expert", "mlp"))[1:3]
  assert s.spec(axes["layers"]["moe"]["moe"]["gate"]["b"])[3] == s.spec(("mlp",))[0]
  for a_b in jax.tree.leaves(ad["layers"], is_leaf=lambda x: isinstance(x, dict) and "a" in x):
    assert a_b["a"].dtype == jnp.float32 and not np.asarray(a_b["b"]).any()  # B = 0


def test_a_fresh_adapter_changes_no_bit(tiny_params, tiny_cfg):
  merged = merge(tiny_params, init_adapters(tiny_cfg, LORA, jax.random.key(0)), LORA)
  chex.assert_trees_all_equal(merged, tiny_params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_is_w_plus_scaled_a_times_b_per_expert(tiny_cfg, dtype):
  base = init_params(tiny_cfg, jax.random.key(0), dtype)
  ad = _nonzero(init_adapters(tiny_cfg, LORA, jax.random.key(0)))
  merged = merge(base, ad, LORA)
  checked = 0
  for kind, blocks in ad["layers"].items():
    for block, weights in blocks.items():
      for weight, ab in weights.items():
        a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
        if a.ndim == 3:
          d = np.einsum("lir,lro->lio", a, b)
        elif weight == "down":
          d = np.einsum("leir,lero->leio", a, b)
        else:
          d = np.einsum("lier,lero->lieo", a, b)
        w = np.asarray(base["layers"][kind][block][weight], np.float64)
        want = w + LORA.scale * d
        got = np.asarray(merged["layers"][kind][block][weight], np.float64)
        # f32: the rank-4 sum and the add round a few times (<= 4 ulp of |want|); bf16:
        # the result is rounded once more to 8 bits (half an ulp, 2^-9 relative)
        rel = 2e-6 if dtype == "float32" else 2.0**-8
        np.testing.assert_allclose(got, want, rtol=rel, atol=rel * np.abs(want).max(),
                                   err_msg=f"{kind}/{block}/{weight}")
        checked += 1
  assert checked == 4 + 3 + 4 + 4  # dense: attn + mlp; moe: attn + experts + router
  for name in ("embed", "final_norm", "lm_head"):
    assert merged[name] is base[name]


def test_gradients_reach_the_adapters_and_match_finite_differences(tiny_cfg):
  cfg = dataclasses.replace(tiny_cfg, dtype="float32", param_dtype="float32")
  base = init_params(cfg, jax.random.key(0), "float32")
  ad = _nonzero(init_adapters(cfg, LORA, jax.random.key(0)), std=0.05)
  tokens = jax.random.randint(jax.random.key(3), (2, 24), 1, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
  fast = Numerics("fast")
  # the experts replayed (as the trainer does): top-k is a step function, and a finite
  # difference across a routing flip measures the jump, not the gradient
  routing = forward(merge(base, ad, LORA), tokens, positions, cfg=cfg, numerics=fast).routing

  def loss(adapters):
    out = forward(merge(base, adapters, LORA), tokens, positions, cfg=cfg, numerics=fast,
                  targets=next_token_targets(np.asarray(tokens)), routing=routing)
    return jnp.mean(out.logprobs[:, :-1])

  value, grads = jax.jit(jax.value_and_grad(loss))(ad)
  assert jax.tree.structure(grads) == jax.tree.structure(ad)
  assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
  direction = _nonzero(ad, seed=7, std=1.0)
  eps = 1e-3
  plus = loss(jax.tree.map(lambda x, v: x + eps * v, ad, direction))
  minus = loss(jax.tree.map(lambda x, v: x - eps * v, ad, direction))
  numeric = (plus - minus) / (2 * eps)
  analytic = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(grads),
                                                 jax.tree.leaves(direction)))
  # f32 central difference: truncation O(eps^2) and rounding O(ulp(loss) / eps) ~ 1e-4
  np.testing.assert_allclose(float(numeric), float(analytic), rtol=2e-2, atol=1e-4)
  assert np.isfinite(float(value))


def test_bad_lora_configs_are_refused():
  for kwargs, message in [(dict(rank=0), "rank must be an int >= 1"),
                          (dict(alpha=0.0), "alpha must be > 0"),
                          (dict(targets=("attn.qkv",)), r"\['attn.qkv'\] are not among"),
                          (dict(targets=("attn.q", "attn.q")), "repeat")]:
    with pytest.raises(ValueError, match=message):
      LoraConfig(**kwargs)
  with pytest.raises(ValueError, match="unknown lora fields"):
    LoraConfig.from_dict({"rank": 4, "dropout": 0.1})
  all_moe = ModelConfig(**{**TINY, "mlp_only_layers": ()})
  with pytest.raises(ValueError, match="the model has none of them"):
    init_adapters(all_moe, LoraConfig(targets=("mlp.gate",)), jax.random.key(0))
  assert LoraConfig.from_dict({"rank": 16, "alpha": 32.0}).scale == 2.0


def test_a_lora_grpo_step_trains_only_the_adapters_and_stays_on_policy_bitwise(tiny_cfg,
                                                                              tiny_params):
  # Two on-policy GRPO steps: the engine samples with serving_params (the base with the
  # state's adapters merged), the step trains the adapters on those samples. Both times
  # every sampled token's trainer log-prob is its behaviour log-prob exactly (the second
  # time with adapters the first step moved); the base is never touched.
  from rljax.pipeline.run import rows_for  # pylint: disable=import-outside-toplevel
  from rljax.rl import learner  # pylint: disable=import-outside-toplevel
  from rljax.rl.batch import build_batch, split_microbatches  # pylint: disable=import-outside-toplevel
  from rljax.rl.losses import LossConfig  # pylint: disable=import-outside-toplevel
  base = tiny_params
  base_before = jax.tree.map(np.asarray, base)
  adapters = init_adapters(tiny_cfg, LORA, jax.random.key(0))
  optimizer = learner.make_optimizer(1e-2)
  state = learner.init_state(adapters, optimizer)
  step = learner.make_grpo_step(tiny_cfg, optimizer, numerics=DET, loss_cfg=LossConfig(),
                                lora=LORA)
  served = learner.serving_params(state, tiny_cfg, base=base, lora=LORA)
  chex.assert_trees_all_equal(served, base)  # a fresh adapter: the base's bits
  engine = DecodeEngine(tiny_cfg, served, numerics=DET, num_slots=8, max_seq_len=64)
  prompts = [np.arange(3, 3 + n) % tiny_cfg.vocab_size for n in (5, 11)]
  first_b = None
  for version in (0, 1):
    trajs = engine.generate([Request(10 * version + i, p, n=4,
                                     sampling=SamplingParams(max_new_tokens=10))
                             for i, p in enumerate(prompts)])
    adv = np.where(np.arange(len(trajs)) % 2, 1.0, -1.0).astype(np.float32)
    batch = split_microbatches(build_batch(
        trajs, adv, np.ones(len(trajs), bool), row_len=64, page_size=tiny_cfg.page_size,
        num_rows=rows_for(len(trajs), 64, 64, tiny_cfg.page_size), num_seqs=len(trajs),
        with_routing=True), 1)
    state, metrics = step(state, batch, version, base=base)
    assert not bool(metrics["skipped"]) and int(metrics["mismatch_tokens"]) > 0
    assert float(metrics["mismatch_max_abs"]) == 0.0, metrics
    if version == 0:
      first_b = jax.tree.map(np.asarray, state.params)
    served = learner.serving_params(state, tiny_cfg, base=base, lora=LORA)
    engine.update_weights(served, version + 1)
  # the second step sampled with adapted weights: every MoE expert weight moved
  assert np.all(np.asarray(served["layers"]["moe"]["moe"]["gate"]
                           != base["layers"]["moe"]["moe"]["gate"]).any(axis=(1, 3)))
  # only adapters in the state; B moved off zero, the base kept every bit
  assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
  assert jax.tree.structure(state.opt_state[1][0].mu) == jax.tree.structure(adapters)
  assert np.asarray(first_b["layers"]["moe"]["moe"]["gate"]["b"]).any()
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, base), base_before)
  with pytest.raises(ValueError, match="frozen base"):
    step(state, batch, 2)


class _ParityArithmetic(ArithmeticEnv):
  """arith_tiny's prompts scored by the parity of the completion's token-id sum: rewards
  differ within a group whatever the policy (a random start's samples all run out of
  max_new_tokens, so their lengths would tie), so a two-step run has gradients."""

  def verify(self, task, completion_ids):
    return Verdict.success() if sum(completion_ids) % 2 else Verdict.model_failure("even")


def parity_arithmetic(**kwargs):
  return _ParityArithmetic(**kwargs)


def test_a_lockstep_lora_run_trains_adapters_on_its_frozen_base_with_zero_mismatch(tmp_path):
  # config.lora in the lockstep loop: GRPO trains rank-4 adapters on the frozen base in
  # deterministic numerics, every sampled token's trainer log-prob its behaviour log-prob
  # (0.0) on every step; final_params is the merged policy (adapted weights moved, the
  # rest the base's bf16 bits); the async trainer takes the block too (test_lora_stream.py)
  import ml_collections  # pylint: disable=import-outside-toplevel
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  from rljax.model import abstract_params, init_sharded  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import lockstep  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.metrics import read_jsonl  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import ASYNC_TRAINER, ConfigError, build  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.numerics = "deterministic"
  config.env.name = "tests.test_lora:parity_arithmetic"
  config.lora = ml_collections.ConfigDict(dict(rank=4, alpha=8.0, targets=DEFAULT_TARGETS))
  config.sft.steps = 0
  config.rl.update(dict(steps=2, prompts_per_step=4, group_size=4, learning_rate=1e-2,
                        num_tasks=64))
  config.eval.update(dict(num_tasks=4, n=2, k=2, every=0))
  config.engine.num_slots = 16
  config.log.tensorboard = False
  summary = lockstep.run_experiment(config, str(tmp_path / "run"))
  assert summary["steps"] == 2 and summary["mismatch_max_abs"] == 0.0, summary
  grpo = [r for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if r["phase"] == "grpo"]
  assert len(grpo) == 2 and all(r["mismatch_tokens"] > 0 for r in grpo)
  assert all(r["mismatch_max_abs"] == 0.0 and not r["skipped"] for r in grpo)
  assert all(r["signal_fraction"] > 0 for r in grpo), grpo  # the parity env always has one
  # arith_tiny's rl.kl_to_start: a LoRA run's reference is the base itself, and fresh
  # adapters (B = 0) are the base bit for bit: kl 0.0 on the first step
  assert grpo[0]["kl"] == 0.0 and grpo[0]["entropy"] > 0
  cfg = build(config, ("model", "mesh"), devices=False).cfg
  init = init_sharded(cfg, config.seed, None, dtype=jnp.float32)
  with Checkpointer(summary["final_params"], keep_last=1) as ckpt:
    final = ckpt.restore({"params": abstract_params(cfg, jnp.float32)}).state["params"]
  as_base = lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
  gate = final["layers"]["moe"]["moe"]["gate"]
  assert np.any(np.asarray(gate) != as_base(init["layers"]["moe"]["moe"]["gate"]))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, final["embed"]),
                              jax.tree.map(as_base, init["embed"]))
  assert build(config, ASYNC_TRAINER, devices=False).lora == LoraConfig(
      rank=4, alpha=8.0, targets=DEFAULT_TARGETS)
  config.lora.rank = 0
  with pytest.raises(ConfigError, match="config.lora: lora rank must be"):
    build(config, ("model", "mesh", "rl"), devices=False)
