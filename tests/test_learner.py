"""Learner: packing of trajectories, the GRPO/SFT steps, microbatching, skipping, replay."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.rl import learner
from rljax.rl.batch import build_batch, split_microbatches
from rljax.rl.losses import LossConfig
from rljax.numerics import Numerics

DET = Numerics("deterministic")


@pytest.fixture(scope="module")
def rollouts(tiny_cfg, tiny_params):
  eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, max_seq_len=64)
  rng = np.random.default_rng(0)
  trajs = eng.generate([Request(g, rng.integers(3, tiny_cfg.vocab_size, size=int(n)), n=4,
                                sampling=SamplingParams(max_new_tokens=12), seed=1)
                        for g, n in enumerate((5, 9, 14, 20))])
  adv = np.random.default_rng(1).standard_normal(len(trajs)).astype(np.float32)
  return trajs, adv


def _batch(tiny_cfg, trajs, adv, valid=None):
  valid = np.ones(len(trajs), bool) if valid is None else valid
  return build_batch(trajs, adv, valid, row_len=64, num_rows=8, num_seqs=16,
                     page_size=tiny_cfg.page_size, with_routing=True)


def test_build_batch_aligns_targets_with_behaviour(tiny_cfg, rollouts):
  trajs, adv = rollouts
  b = _batch(tiny_cfg, trajs, adv)
  assert b.tokens.shape == (8, 64) and b.routing.shape[:2] == (8, 64)
  assert int(b.loss_mask.sum()) == sum(int(t.loss_mask.sum()) for t in trajs)
  for j, t in enumerate(trajs):
    on = (b.seq_ids == j) & b.loss_mask
    np.testing.assert_array_equal(b.targets[on], t.completion_ids[t.loss_mask])
    np.testing.assert_array_equal(b.behaviour_logprobs[on], t.behaviour_logprobs[t.loss_mask])


def test_grpo_step_is_on_policy_bitwise_and_updates(tiny_cfg, tiny_params, rollouts):
  trajs, adv = rollouts
  opt = learner.make_optimizer(1e-3)
  # committed params, as a checkpoint or an SFT step hands them over
  state = learner.init_state(jax.device_put(tiny_params, jax.devices()[0]), opt)
  before = jax.tree.map(np.asarray, state.params)
  step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig())
  new, metrics = step(state, split_microbatches(_batch(tiny_cfg, trajs, adv), 1))
  # the engine sampled with the bf16 cast of the same masters: zero mismatch, exactly
  assert float(metrics["mismatch_max_abs"]) == 0.0
  assert not bool(metrics["skipped"]) and int(new.step) == 1
  assert float(metrics["grad_norm"]) > 0
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), new.params, before)
  assert all(jax.tree.leaves(changed))
  # the next step runs the same executable: a state fresh from init_state (optax's counts
  # made uncommitted) once compiled the step again for the first step's committed outputs
  step(new, split_microbatches(_batch(tiny_cfg, trajs, adv), 1))
  assert step.jitted._cache_size() == 1  # pylint: disable=protected-access


def test_masters_between_bf16_values_still_give_zero_mismatch(tiny_cfg, tiny_params):
  # After the first update the f32 masters are no longer bf16 values. Every use of a
  # master in the forward (matmul weights, norm scales, embeddings) must see exactly the
  # serving cast's bits, or the trainer drifts from the engine from step 2 on (it did:
  # norm scales were multiplied in f32, 0.19 max |diff| in the arith_tiny run).
  rng = np.random.default_rng(3)
  masters = jax.tree.map(
      lambda x: jnp.asarray(np.asarray(x, np.float32) * (1 + 1e-3 * rng.standard_normal(
          x.shape)).astype(np.float32)), tiny_params)
  opt = learner.make_optimizer(1e-3)
  state = learner.init_state(masters, opt)
  serving = learner.serving_params(state, tiny_cfg)
  assert any(bool(jnp.any(m != s.astype(jnp.float32)))
             for m, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(serving)))
  eng = DecodeEngine(tiny_cfg, serving, numerics=DET, num_slots=8, max_seq_len=64)
  trajs = eng.generate([Request(g, rng.integers(3, tiny_cfg.vocab_size, size=9), n=4,
                                sampling=SamplingParams(max_new_tokens=12), seed=2)
                        for g in range(3)])
  adv = rng.standard_normal(len(trajs)).astype(np.float32)
  step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig())
  _, metrics = step(state, split_microbatches(_batch(tiny_cfg, trajs, adv), 1))
  assert float(metrics["mismatch_max_abs"]) == 0.0


def test_microbatches_accumulate_to_the_full_batch_gradient(tiny_cfg, tiny_params, rollouts):
  trajs, adv = rollouts
  opt = learner.make_optimizer(1e-3)
  batch = _batch(tiny_cfg, trajs, adv)
  results = []
  for micro in (1, 4):
    step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig())
    _, m = step(learner.init_state(tiny_params, opt), split_microbatches(batch, micro))
    results.append(m)
  # same loss and gradient up to f32 summation order of the accumulation
  np.testing.assert_allclose(results[0]["loss"], results[1]["loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(results[0]["grad_norm"], results[1]["grad_norm"], rtol=1e-4)


def test_non_finite_step_is_skipped(tiny_cfg, tiny_params, rollouts):
  trajs, adv = rollouts
  opt = learner.make_optimizer(1e-3)
  state = learner.init_state(tiny_params, opt)
  before = jax.tree.map(np.asarray, state.params)
  bad = adv.copy()
  bad[0] = np.nan
  step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig())
  new, metrics = step(state, split_microbatches(_batch(tiny_cfg, trajs, bad), 1))
  assert bool(metrics["skipped"]) and int(new.step) == 0
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, new.params), before)


def test_router_replay_uses_recorded_experts_and_router_still_learns(tiny_cfg, tiny_params,
                                                                     rollouts):
  trajs, adv = rollouts
  batch = _batch(tiny_cfg, trajs, adv)
  # a different router: the trainer would route differently on its own
  perturbed = jax.tree.map(lambda x: x, tiny_params)
  moe = perturbed["layers"]["moe"]
  moe["moe"] = dict(moe["moe"], router=jnp.roll(moe["moe"]["router"], 1, axis=2))
  from rljax.model import forward  # pylint: disable=g-import-not-at-top
  own = forward(perturbed, batch.tokens, batch.positions, cfg=tiny_cfg, numerics=DET,
                segment_ids=batch.segment_ids)
  real = batch.seq_ids >= 0
  assert np.any(np.asarray(own.routing)[real] != batch.routing[real])
  replayed = forward(perturbed, batch.tokens, batch.positions, cfg=tiny_cfg, numerics=DET,
                     segment_ids=batch.segment_ids, routing=batch.routing)
  np.testing.assert_array_equal(np.asarray(replayed.routing)[real], batch.routing[real])
  opt = learner.make_optimizer(1e-3)
  step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig(), replay=True)
  state = learner.init_state(perturbed, opt)
  routers = np.asarray(state.params["layers"]["moe"]["moe"]["router"], np.float32)
  new, _ = step(state, split_microbatches(batch, 1))
  for j, r in enumerate(routers):  # every MoE layer's router got a gradient
    assert np.any(np.asarray(new.params["layers"]["moe"]["moe"]["router"][j]) != r)


def test_sft_step_lowers_nll(tiny_cfg, tiny_params, rollouts):
  trajs, adv = rollouts
  opt = learner.make_optimizer(3e-3)
  state = learner.init_state(tiny_params, opt)
  step = learner.make_sft_step(tiny_cfg, opt, numerics=Numerics("fast"))
  batch = split_microbatches(_batch(tiny_cfg, trajs, adv), 2)
  nlls = []
  for _ in range(5):
    state, m = step(state, batch)
    nlls.append(float(m["loss"]))
  assert nlls[-1] < nlls[0]
  assert learner.serving_params(state, tiny_cfg)["embed"]["embedding"].dtype == jnp.bfloat16


# Bounds on max over parameter leaves of ||g_mesh - g_one|| / ||g_one||, the step's f32
# gradient (tests/learner_sharded_worker.py records it in the optimizer state).
# Weight gradients are f32 sums over tokens (rljax.numerics.matmul's VJP) that a mesh adds
# in another order: <= (T - 1) * 2^-24 of sum|terms| (T = 512 tokens: ~3e-5), well inside
# both bounds. What moves more is bf16: activation cotangents are rounded to bf16.
# fsdp: the f32 values rounded differ only by summation order (on AVX2 also by XLA:CPU's
#   f32 GEMM blocking, which follows the local row count), so only elements within that
#   noise of a rounding boundary land one bf16 ulp (2^-8 relative) away; even if every
#   one did, a gradient would move by ~2^-8 of its norm. Bound 2^-8; measured 3.8e-5
#   (AMD EPYC, AVX-512 BF16; 3.4e-4 on AVX2 with a third layer).
# expert parallel: the all_gather's transpose sums the cotangents across devices in bf16,
#   so *every* element may differ by one bf16 rounding (2^-9) at each MoE layer the
#   backward crosses, and the x10 weights amplify what reaches the layers below.
#   Bound 2^-5 (8 ulps); measured 9.2e-3 (AMD EPYC; 1.05e-2 with a second MoE layer).
# A real sharding bug is far above both: a leaf doubled (a reduction applied twice) or
# dropped scores 1, one of 8 shards lost 0.30 (the worker applies these to the smallest
# leaf and the test checks the measure rejects them: above 0.2, 6x the loosest bound).
GRAD_REL_TOL = {"fsdp8": 2.0**-8, "data2_fsdp2_expert2": 2.0**-5}


@pytest.mark.multidevice
def test_grpo_step_on_an_8_device_mesh_matches_one_device():
  """fsdp and expert layouts with explicit state shardings and donation. Log-probs are
  bitwise (deterministic mode), so the on-policy mismatch is 0 on the mesh too and the
  loss differs only by the order of its f32 sum over tokens. The gradient each layout
  computed is compared per leaf (GRAD_REL_TOL above); the update the mesh applied is
  exactly SGD of its own gradient, bit for bit."""
  import json, pathlib, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  worker = pathlib.Path(__file__).parent / "learner_sharded_worker.py"
  proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  print(out)
  assert out["single_mismatch_max_abs"] == 0.0
  for name in ("fsdp8", "data2_fsdp2_expert2"):
    e = out[name]
    assert e["mismatch_max_abs"] == 0.0, e
    # |loss| ~ 1 summed over 512 token terms of |.| <~ 1e-2 each in another f32 order
    assert e["loss_diff"] < 1e-5, e
    assert e["update_is_sgd_of_grad"], e
    assert e["grad_rel_err"] <= GRAD_REL_TOL[name], e  # NaN fails too
    assert e["grad_cosine"] > 0.9999, e
    for bug, err in e["bug_grad_rel_err"].items():
      assert err > 0.2 > GRAD_REL_TOL[name], (name, bug, err)  # the measure sees a bug
  assert "fsdp" in out["fsdp8"]["gate_spec"]


def test_grpo_step_logs_entropy_and_a_kl_to_the_start_that_is_zero_there(tiny_cfg, tiny_params,
                                                                         rollouts):
  """rl.kl_to_start: the step scores the batch with the frozen start policy (the serving
  cast of the masters it started from). On the first step the policy is that policy: in
  deterministic numerics the trainer's forward of the f32 masters has the bits of the
  forward of their bf16 cast (the contract mismatch_max_abs == 0 checks), so every token's
  log-ratio is exactly 0 and k3(0) = 0: kl is 0.0, not just small. After updates it is > 0.
  The entropy is the policy's at the sampling temperature: in (0, log V]."""
  trajs, adv = rollouts
  opt = learner.make_optimizer(1e-3)
  state = learner.init_state(tiny_params, opt)
  start = learner.serving_params(state, tiny_cfg)  # a new array: the masters move on
  step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig(),
                                reference=True)
  batch = split_microbatches(_batch(tiny_cfg, trajs, adv), 1)
  with pytest.raises(ValueError, match="ref_params"):
    step(state, batch)
  kls = []
  for _ in range(3):
    state, metrics = step(state, batch, ref_params=start)
    kls.append(float(metrics["kl"]))
    assert 0.0 < float(metrics["entropy"]) <= np.log(tiny_cfg.vocab_size)
  assert float(metrics["mismatch_max_abs"]) > 0  # the batch is off-policy after updates
  assert kls[0] == 0.0
  assert kls[1] > 0 and kls[2] > 0, kls
  # reference=False holds and runs no reference: no kl metric, ref_params refused
  plain = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig())
  with pytest.raises(ValueError, match="reference=True"):
    plain(state, batch, ref_params=start)
  with pytest.raises(ValueError, match="reference"):
    learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig(kl_coef=0.1))


def test_kl_coef_adds_the_kl_penalty_to_the_loss_and_its_gradient(tiny_cfg, tiny_params,
                                                                  rollouts):
  """Away from the start (a reference 1% off the policy), kl_coef > 0 adds kl_coef * kl to
  the loss (one microbatch, token mean) and changes the gradient; kl_coef = 0 only logs it."""
  trajs, adv = rollouts
  opt = learner.make_optimizer(1e-3)
  rng = np.random.default_rng(5)
  reference = jax.device_put(jax.tree.map(lambda x: jnp.asarray(
      (np.asarray(x, np.float32) * (1 + 1e-2 * rng.standard_normal(x.shape))).astype(
          np.float32)).astype(x.dtype), tiny_params), jax.devices()[0])  # committed, as
  # serving_params hands the reference over: kl_coef 0 is then the previous test's program
  batch = split_microbatches(_batch(tiny_cfg, trajs, adv), 1)
  out = {}
  for coef in (0.0, 0.5):
    step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET,
                                  loss_cfg=LossConfig(kl_coef=coef), reference=True)
    out[coef] = step(learner.init_state(tiny_params, opt), batch, ref_params=reference)
  (_, m0), (new1, m1) = out[0.0], out[0.5]
  kl = float(m0["kl"])
  assert kl > 0
  np.testing.assert_allclose(float(m1["kl"]), kl, rtol=1e-6)  # the same forwards
  assert float(m0["loss"]) == float(m0["pg_loss"])
  np.testing.assert_allclose(float(m1["loss"]) - float(m1["pg_loss"]), 0.5 * kl, rtol=1e-5)
  assert float(m1["grad_norm"]) != float(m0["grad_norm"])
  new0 = out[0.0][0]
  assert any(bool(np.any(np.asarray(a) != np.asarray(b)))
             for a, b in zip(jax.tree.leaves(new0.params), jax.tree.leaves(new1.params)))


def test_skip_empty_is_adamw_on_the_steps_with_a_gradient():
  """make_optimizer(skip_empty=True): bitwise AdamW over the steps whose gradient is not
  all zero; the all-zero steps move nothing and leave Adam's state, while the learning-rate
  schedule goes on counting every step."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3), jnp.float32)}
  schedule = lambda count: 1e-2 * (count + 1.0)  # noqa: E731
  skip = learner.make_optimizer(schedule, weight_decay=0.1, skip_empty=True)
  grads = [jax.tree.map(lambda p, i=i: jnp.asarray(rng.standard_normal(p.shape), p.dtype)
                        * (i % 3 != 1), params) for i in range(7)]  # steps 1 and 4: zero
  p, s = params, skip.init(params)
  p_ref, s_ref = params, None
  for i, g in enumerate(grads):
    u, s = skip.update(g, s, p)
    p = optax.apply_updates(p, u)
    if i % 3 == 1:
      chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))
      continue
    # the reference: AdamW that only ever saw the steps with a gradient, at this step's lr
    ref = learner.make_optimizer(lambda _, i=i: schedule(i), weight_decay=0.1)
    s_ref = ref.init(params) if s_ref is None else s_ref
    u_ref, s_ref = ref.update(g, s_ref, p_ref)
    p_ref = optax.apply_updates(p_ref, u_ref)
    chex.assert_trees_all_equal(p, p_ref)
  # with a gradient every step, skip_empty is plain AdamW (optax.adamw) bit for bit
  plain, adamw = learner.make_optimizer(1e-2), optax.chain(optax.clip_by_global_norm(1.0),
                                                           optax.adamw(1e-2, weight_decay=0.0))
  sa, sb = plain.init(params), adamw.init(params)
  for g in grads[::3]:
    ua, sa = plain.update(g, sa, params)
    ub, sb = adamw.update(g, sb, params)
    chex.assert_trees_all_equal(ua, ub)


def test_update_scale_multiplies_the_optimizer_update():
  """_apply's update_scale (the signal fraction of make_grpo_step(scale_by_signal=True))
  scales the update and nothing else: the optimizer state is the unscaled run's."""
  params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.float32)}
  loss_fn = lambda p, mb: (jnp.sum((p["w"] - mb) ** 2), {})  # noqa: E731
  batches = jnp.asarray([[0.5, 0.5, 0.5], [1.0, 0.0, -1.0]], jnp.float32)
  opt = learner.make_optimizer(0.1)
  full, _ = learner._apply(learner.init_state(params, opt), opt, loss_fn, batches)
  part, _ = learner._apply(learner.init_state(params, opt), opt, loss_fn, batches,
                           jnp.float32(0.25))
  # lr 0.1 on weights of order 1: the updates are far above the weights' ulp
  np.testing.assert_allclose(np.asarray(part.params["w"]) - np.asarray(params["w"]),
                             0.25 * (np.asarray(full.params["w"]) - np.asarray(params["w"])),
                             rtol=1e-5)
  chex.assert_trees_all_equal(part.opt_state, full.opt_state)


def test_step_clip_norm_bounds_adams_step_by_the_raw_gradient_norm():
  """_apply(step_clip_norm=c): the update is times min(1, c / |g|) of the raw gradient
  (gradient clipping before Adam leaves Adam's step size as it was: it divides the size
  back out); at |g| <= c nothing changes, bitwise, and the optimizer state is the
  unclipped run's either way. Combined with update_scale, the two multiply."""
  params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.float32)}
  loss_fn = lambda p, mb: (jnp.sum((p["w"] - mb) ** 2), {})  # noqa: E731
  batches = jnp.asarray([[0.5, 0.5, 0.5], [1.0, 0.0, -1.0]], jnp.float32)
  opt = learner.make_optimizer(0.1)
  delta = lambda st: np.asarray(st.params["w"]) - np.asarray(params["w"])  # noqa: E731
  full, m = learner._apply(learner.init_state(params, opt), opt, loss_fn, batches)
  norm = float(m["grad_norm"])
  assert norm > 2.0, norm  # 2 * |(1, -2, 3) - (0.75, 0.25, -0.25)| * 2 microbatches
  clipped, mc = learner._apply(learner.init_state(params, opt), opt, loss_fn, batches,
                               step_clip_norm=2.0)
  np.testing.assert_allclose(delta(clipped), (2.0 / norm) * delta(full), rtol=1e-5)
  assert float(mc["grad_norm"]) == norm  # the logged norm is the raw gradient's
  chex.assert_trees_all_equal(clipped.opt_state, full.opt_state)
  # a bound above the gradient's norm changes nothing, bit for bit
  loose, _ = learner._apply(learner.init_state(params, opt), opt, loss_fn, batches,
                            step_clip_norm=2.0 * norm)
  chex.assert_trees_all_equal(loose.params, full.params)
  both, _ = learner._apply(learner.init_state(params, opt), opt, loss_fn, batches,
                           jnp.float32(0.5), step_clip_norm=2.0)
  np.testing.assert_allclose(delta(both), 0.5 * (2.0 / norm) * delta(full), rtol=1e-5)


def test_signal_fraction_counts_valid_samples_with_an_advantage(tiny_cfg, tiny_params,
                                                                rollouts):
  trajs, adv = rollouts
  n = len(trajs)
  some = adv.copy()
  some[: n // 2] = 0.0
  valid = np.ones(n, bool)
  valid[-1] = False  # an infra failure: neither signal nor a sample that counts
  batch = split_microbatches(_batch(tiny_cfg, trajs, some, valid), 1)
  assert float(learner.signal_fraction(batch)) == pytest.approx((n - n // 2 - 1) / (n - 1))
  # a batch without any advantage: the step moves nothing and leaves Adam's state
  opt = learner.make_optimizer(1e-3, skip_empty=True)
  state = learner.init_state(tiny_params, opt)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  step = learner.make_grpo_step(tiny_cfg, opt, numerics=DET, loss_cfg=LossConfig(),
                                scale_by_signal=True)
  new, metrics = step(state, split_microbatches(_batch(tiny_cfg, trajs, 0 * adv), 1))
  assert float(metrics["signal_fraction"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, (new.params, new.opt_state)), before)


def test_the_step_traces_the_same_program_whatever_order_a_set_iterates_in(monkeypatch):
  # A set of strings iterates in an order of the process's hash seed: a step that traced
  # its token means (entropy, kl) in that order lowered to another program in each process
  # (the GRPO step missed the persistent compile cache in every trainer: 10-15 s each)
  class Ordered(frozenset):
    order = ()

    def __and__(self, other):
      return [k for k in self.order if k in other]

  def loss_fn(params, mb):
    x = jnp.sum(params["w"] * mb)
    return x, {"entropy": x * 2.0, "kl": x * 3.0, "masked_token_count": x + 1.0}

  params = {"w": jnp.ones(3)}
  state = learner.TrainState(params, optax.sgd(0.1).init(params), jnp.zeros((), jnp.int32))
  texts = []
  for order in (("entropy", "kl"), ("kl", "entropy")):
    means = Ordered(order)
    means.order = order
    monkeypatch.setattr(learner, "TOKEN_MEANS", means)
    step = jax.jit(lambda s, b: learner._apply(s, optax.sgd(0.1), loss_fn, b))
    texts.append(step.lower(state, jnp.ones((2, 3))).as_text())
  assert texts[0] == texts[1]
