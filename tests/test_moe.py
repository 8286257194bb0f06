"""The expert paths (rljax.model.moe): in fast mode dense, ragged and tiled agree, in values
and in gradients; in deterministic mode the routed-only tiles are batch-invariant bit for
bit for any routing, tile size and token count, at the routed FLOPs (XLA's cost analysis,
also at Qwen3-30B-A3B's shape); the tile plan covers every routed slot with one expert
per tile."""

import dataclasses
import re
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import qwen3_30b_a3b, tiny_moe
from rljax import aot
from rljax.aot_compile import mosaic_kernels
from rljax.model import ModelConfig, forward, init_params, moe, moe_tiles
from rljax.numerics import Numerics
from tests.mosaic import compile_for_tpu
from tests.shapes import TINY

FAST = Numerics("fast")
DET = Numerics("deterministic")


def _problem(t, d, e, f, k, dtype, seed=0, extra_ids=2):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(t, d)), dtype)
  gate, up = (jnp.asarray(rng.normal(size=(d, e, f)) * 0.2, dtype) for _ in range(2))
  down = jnp.asarray(rng.normal(size=(e, f, d)) * 0.2, dtype)
  # ids past e: experts of another expert-parallel shard (with offset 2, ids below it too)
  ids = jnp.asarray(np.stack([rng.choice(e + extra_ids, k, replace=False) for _ in range(t)]),
                    jnp.int32)
  return x, ids, gate, up, down


@pytest.mark.parametrize("row_tile", [1, 8, 32, 512])
@pytest.mark.parametrize("offset", [0, 2])
def test_every_fast_path_gives_the_ragged_outputs(row_tile, offset):
  x, ids, gate, up, down = _problem(40, 64, 8, 32, 2, jnp.bfloat16)
  out = {path: jax.jit(lambda *a, path=path: moe.experts_local(
      *a, offset, FAST, path, row_tile))(x, ids, gate, up, down) for path in moe.PATHS}
  for path in ("dense", "tiled"):
    # bf16 outputs of f32 sums in different orders: one bf16 rounding apart (2^-8 rel,
    # rtol ~2.5 ulps); atol for outputs near zero (terms ~0.2 * |x| each, cancelling)
    np.testing.assert_allclose(np.asarray(out[path], np.float32),
                               np.asarray(out["ragged"], np.float32), atol=2e-2, rtol=1e-2,
                               err_msg=path)
  non_local = (ids < offset) | (ids >= offset + 8)
  assert non_local.any() and not np.asarray(out["tiled"])[np.asarray(non_local)].any()


@pytest.mark.parametrize("tokens,path", [(8, "dense"), (40, "dense"), (512, "tiled")])
def test_by_tokens_runs_dense_for_a_few_tokens_and_tiled_for_many(tokens, path):
  # the engine's CPU path: 32 experts top-4, row tile 32: the dense path's rows over the
  # tiled path's are 0.24 / 1.1 / 5.3 (threshold 4.0); it is that path, bit for bit
  x, ids, gate, up, down = _problem(tokens, 64, 32, 32, 4, jnp.bfloat16, seed=4)
  run = lambda p: jax.jit(lambda *a: moe.experts_local(*a, 0, FAST, p, 32))(  # noqa: E731
      x, ids, gate, up, down)
  assert moe.tiled_beats_dense(tokens, 32, 4, 32) == (path == "tiled")
  want = run(path)
  if path == "tiled":  # the engine's tiles: operands in bf16, not the trainer's exact products
    local = ids < 32
    inexact = jax.jit(lambda *a: moe_tiles.experts_tiled(*a, FAST, 32, "jnp", exact=False))(
        x, jnp.where(local, ids, 32), gate, up, down)
    np.testing.assert_allclose(np.asarray(inexact, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=1e-2)  # bf16 outputs: rounding apart
    want = jnp.where(local[..., None], inexact, 0)
  chex.assert_trees_all_equal(run("by_tokens"), want)
  # 8 experts top-2 (tiny_moe, arith_tiny): at most 8 / 2 = 4 dense rows per tiled row
  assert not any(moe.tiled_beats_dense(t, 8, 2, 32) for t in (8, 512, 2 ** 20))
  with pytest.raises(ValueError, match="not in deterministic numerics"):
    moe.experts_local(x, ids, gate, up, down, 0, DET, "by_tokens", 32)
  with pytest.raises(ValueError, match="'by_tokens' expert path mixes"):
    ModelConfig(**TINY, engine_experts="by_tokens").resolved("cpu", DET)


def test_the_dense_mixture_is_the_dense_paths_weighted_sum():
  # the combine folded into one down-projection dot: the same products summed in another
  # order (f32: within f32 rounding of ~100-term sums, rtol 1e-5), and in bf16 one more
  # rounding of weight x hidden (2^-8 relative) before a sum of 3 x 16 products
  rng = np.random.default_rng(5)
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
    x, ids, gate, up, down = _problem(40, 32, 6, 16, 3, dtype, seed=2, extra_ids=0)
    w = jnp.asarray(rng.dirichlet(np.ones(3), 40), jnp.float32)
    want = moe.combine(moe.experts_local(x, ids, gate, up, down, 0, FAST, "dense", 32), w)
    got = moe.dense_mixture(x, ids, w, gate, up, down, FAST)
    assert got.dtype == dtype and got.shape == (40, 32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
  with pytest.raises(ValueError, match="fast numerics only"):
    moe.dense_mixture(x, ids, w, gate, up, down, DET)
  # moe_block on one device: the dense path is the mixture, bit for bit
  params = {"router": jnp.asarray(rng.normal(size=(32, 6)), dtype), "gate": gate, "up": up,
            "down": down}
  y, chosen = moe.moe_block(x, params, top_k=3, norm_topk_prob=True, numerics=FAST,
                            path="dense")
  _, weights = moe.route(x, params["router"], top_k=3, norm_topk_prob=True, numerics=FAST)
  chex.assert_trees_all_equal(y, moe.dense_mixture(x, chosen, weights, gate, up, down, FAST))


def test_tiled_gradients_equal_the_dense_paths():
  # f32 end to end: both paths sum the same products (one expert's dot per slot), so the
  # gradients agree to f32 rounding of sums over <= 64 terms (rtol 1e-5)
  x, ids, gate, up, down = _problem(96, 32, 6, 16, 3, jnp.float32, seed=1, extra_ids=0)
  w = jnp.asarray(np.random.default_rng(2).normal(size=(96, 3, 32)), jnp.float32)

  def loss(path, *args):
    return jnp.sum(moe.experts_local(args[0], ids, *args[1:], 0, FAST, path, 16) * w)

  grads = {p: jax.jit(jax.grad(lambda *a, p=p: loss(p, *a), argnums=(0, 1, 2, 3)))(
      x, gate, up, down) for p in ("dense", "tiled")}
  chex.assert_trees_all_close(grads["tiled"], grads["dense"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_the_routed_tiles_written_out_backward_equals_autodiff_of_their_forward(dtype, tol):
  # experts with several tiles (row tile 8, 3 x 96 slots over 6 experts, skewed), slots
  # of another shard (offset 2), k = 3: the custom VJP against JAX's autodiff of the same
  # forward; f32 sums in other orders (rtol 1e-5), and in bf16 autodiff rounds partial
  # sums (dx over the k slots, weight gradients over tiles) to bf16 where ours stay f32
  x, ids, gate, up, down = _problem(96, 32, 6, 16, 3, dtype, seed=3)
  ids = jnp.where(jnp.arange(96)[:, None] % 3 == 0, jnp.asarray([2, 3, 4]), ids)  # skew
  w = jnp.asarray(np.random.default_rng(4).normal(size=(96, 3, 32)), jnp.float32)
  slot_expert = jnp.where((ids >= 2) & (ids < 8), ids - 2, 6)
  src, _, tile_expert = moe_tiles.tile_plan(slot_expert.reshape(-1), 6, 8,
                                            first_tiles_in_place=True)

  def loss(tiles, x, gate, up, down):
    y = tiles(x, gate, up, down, src, tile_expert, FAST, 8, "jnp", 6, 3)
    return jnp.sum(y.astype(jnp.float32) * w)

  autodiff = lambda *a: moe_tiles._routed_tiles_forward(*a)[0]  # noqa: E731
  grads = {name: jax.jit(jax.grad(functools.partial(loss, tiles), argnums=(0, 1, 2, 3)))(
      x, gate, up, down) for name, tiles in (("custom", moe_tiles._routed_tiles),
                                            ("autodiff", autodiff))}
  assert np.asarray(jnp.bincount(slot_expert.reshape(-1), length=7))[:6].max() > 16
  for got, want in zip(grads["custom"], grads["autodiff"]):
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("row_tile", [8, 32, 128])
def test_deterministic_routed_tiles_are_batch_invariant(row_tile):
  # skewed routing (expert 0 takes most slots), slots of another shard (offset 2), token
  # counts that fill tiles differently, tokens in another order: a token's outputs are
  # the same bits whatever its companions ("ragged" runs the tiles in deterministic mode)
  x, ids, gate, up, down = _problem(96, 64, 8, 32, 2, jnp.bfloat16, seed=3)
  ids = ids.at[::3, 0].set(2)
  run = lambda path, *a: jax.jit(lambda *a: moe.experts_local(  # noqa: E731
      *a, 2, DET, path, row_tile))(*a, gate, up, down)
  full = run("tiled", x, ids)
  chex.assert_trees_all_equal(run("ragged", x, ids), full)
  order = np.random.default_rng(5).permutation(96)
  chex.assert_trees_all_equal(run("tiled", x[order], ids[order]), full[order])
  for t in (37, 5, 1):
    chex.assert_trees_all_equal(run("tiled", x[-t:], ids[-t:]), full[-t:])
  # the dense path sums the same exact products with another kernel: a bf16 rounding apart
  np.testing.assert_allclose(np.asarray(run("dense", x, ids), np.float32),
                             np.asarray(full, np.float32), atol=2e-2, rtol=1e-2)


def test_deterministic_routed_tiles_cost_the_routed_flops():
  # 32 experts, top-2, 512 tokens: dense computes 16x the routed expert FLOPs; the tiles
  # compute the routed ones plus under one tile of padding per expert (one batched dot
  # per projection, which XLA's cost analysis counts whole)
  t, d, e, f, k, tile = 512, 64, 32, 32, 2, 32
  cfg = ModelConfig.from_dict(dict(tiny_moe.get_config().model, hidden_size=d, num_experts=e,
                                   moe_intermediate_size=f, num_experts_per_tok=k,
                                   expert_row_tile=tile)).resolved("cpu", DET)
  routed = aot.routed_expert_flops(cfg, t)
  assert routed == 2 * t * k * 3 * d * f  # gate, up, down per routed slot
  n_tiles = -(-t * k // tile) + e
  matmuls = n_tiles * tile * routed / (t * k) + 2 * t * d * e  # the tiles' and the router's
  tiled = aot.moe_layer_flops(cfg, t, DET, "tiled")
  # elementwise work (polynomial silu and softmax, combine) adds ~22% at this tiny width
  assert routed <= tiled <= 1.3 * matmuls
  assert aot.moe_layer_flops(cfg, t, DET, "dense") >= 0.9 * e / k * routed  # 16x


def test_deterministic_moe_flops_at_qwen3_30b_a3b_shape():
  # one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of width 768, top-8) on 4,096
  # tokens, with the default row tile: the deterministic block (router and combine
  # included) costs at most 1.15x the routed expert FLOPs (tiles: 1.125x at most)
  cfg = ModelConfig.from_dict(qwen3_30b_a3b.get_config().model.to_dict())
  assert (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
          cfg.num_experts_per_tok) == (2048, 128, 768, 8)
  resolved = cfg.resolved("cpu", DET)
  assert resolved.train_experts == resolved.engine_experts == "tiled"
  flops = aot.moe_layer_flops(resolved, 4096, DET, resolved.train_experts)
  assert flops <= 1.15 * aot.routed_expert_flops(cfg, 4096)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("row_tile", [1, 4, 16])
def test_the_tile_plan_holds_every_slot_once_in_a_tile_of_its_expert(row_tile, in_place):
  rng = np.random.default_rng(row_tile)
  e, s = 5, 37
  # skewed routing (one expert takes most slots) and slots computed elsewhere (= e)
  slot_expert = rng.choice(e + 1, s, p=[0.6, 0.1, 0.1, 0.05, 0.0, 0.15])
  plan = jax.jit(functools.partial(moe_tiles.tile_plan, first_tiles_in_place=in_place),
                 static_argnums=(1, 2))
  src, dest, tile_expert = map(np.asarray, plan(jnp.asarray(slot_expert, jnp.int32), e,
                                                row_tile))
  n_tiles = -(-s // row_tile) + e
  assert src.shape == (n_tiles * row_tile,) and tile_expert.shape == (n_tiles,)
  for slot in range(s):
    if slot_expert[slot] == e:
      assert dest[slot] == n_tiles * row_tile and slot not in src
    else:
      assert src[dest[slot]] == slot
      assert tile_expert[dest[slot] // row_tile] == slot_expert[slot]
  assert (src[src < s].size == (slot_expert < e).sum()) and (src <= s).all()
  # routed rows plus padding: under one tile per expert that has slots
  used = np.unique(dest[slot_expert < e] // row_tile).size
  assert used <= -(-(slot_expert < e).sum() // row_tile) + len(set(slot_expert) - {e})
  if in_place:  # tile i < e is expert i's first tile, and holds its first slots in order
    np.testing.assert_array_equal(tile_expert[:e], np.arange(e))
    for expert in range(e):
      first = np.flatnonzero(slot_expert == expert)[:row_tile]
      np.testing.assert_array_equal(dest[first], expert * row_tile + np.arange(first.size))


def test_an_unknown_path_is_refused():
  x, ids, gate, up, down = _problem(4, 8, 2, 4, 1, jnp.float32, extra_ids=0)
  with pytest.raises(ValueError, match="unknown expert path 'sparse'"):
    moe.experts_local(x, ids, gate, up, down, 0, FAST, "sparse")
  with pytest.raises(ValueError, match="unknown train_experts 'sparse'"):
    ModelConfig.from_dict(dict(tiny_moe.get_config().model, train_experts="sparse"))
  with pytest.raises(ValueError, match="expert_row_tile must be >= 1"):
    ModelConfig.from_dict(dict(tiny_moe.get_config().model, expert_row_tile=0))


def test_the_interpreted_pallas_kernel_gives_the_jnp_tiles_bits_and_gradients():
  # the TPU grouped-matmul kernel, interpreted on CPU with the jnp kernel's f32 operands:
  # the same bits forward; the backward is the jnp kernel's VJP, so the same gradients
  x, ids, gate, up, down = _problem(40, 64, 8, 32, 2, jnp.bfloat16, seed=6)
  w = jnp.asarray(np.random.default_rng(7).normal(size=(40, 2, 64)), jnp.float32)

  def loss(kernel, x, gate, up, down):
    y = moe.experts_local(x, ids, gate, up, down, 2, DET, "tiled", 16, kernel)
    return jnp.sum(y.astype(jnp.float32) * w), y

  out = {kn: jax.jit(jax.value_and_grad(lambda *a, kn=kn: loss(kn, *a), argnums=(0, 1, 2, 3),
                                        has_aux=True))(x, gate, up, down)
         for kn in ("jnp", "pallas_interpret")}
  chex.assert_trees_all_equal(out["pallas_interpret"], out["jnp"])
  with pytest.raises(ValueError, match="unknown expert kernel 'cuda'"):
    moe.experts_local(x, ids, gate, up, down, 0, DET, "tiled", 16, "cuda")
  with pytest.raises(ValueError, match="unknown expert_kernel 'cuda'"):
    ModelConfig.from_dict(dict(tiny_moe.get_config().model, expert_kernel="cuda"))


@pytest.mark.parametrize("platform,kernel,call", [("tpu", "pallas_tpu", "tpu_custom_call"),
                                                  ("cuda", "pallas_gpu", "triton")])
def test_a_qwen3_30b_a3b_moe_layer_lowers_with_the_pallas_kernel(platform, kernel, call):
  # the whole MoE block (router, tiles, combine) at Qwen3-30B-A3B's shape on 4,096 tokens,
  # lowered for the accelerator (nothing compiled or allocated): the projections are the
  # kernel's custom calls (gate and up share one jitted call), and no per-tile copy of the
  # weights ([tiles, D, F]) is made: the kernel reads each tile's expert in place
  cfg = dataclasses.replace(ModelConfig.from_dict(qwen3_30b_a3b.get_config().model.to_dict()),
                            expert_kernel=kernel)
  d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  params = {"router": sds(d, e), "gate": sds(d, e, f), "up": sds(d, e, f), "down": sds(e, f, d)}
  fn = jax.jit(lambda x, p: moe.moe_block(x, p, top_k=cfg.num_experts_per_tok,
                                          norm_topk_prob=True, numerics=DET, path="tiled",
                                          row_tile=cfg.expert_row_tile, kernel=kernel)[0])
  text = fn.trace(sds(4096, d), params).lower(lowering_platforms=(platform,)).as_text()
  assert text.count(call) == 2
  n_tiles = 4096 * cfg.num_experts_per_tok // cfg.expert_row_tile + e
  assert f"tensor<{n_tiles}x{d}x{f}x" not in text and f"tensor<{n_tiles}x{f}x{d}x" not in text


def _experts_value_and_grad_for_tpu(numerics, path):
  """The MoE experts' forward and backward on the TPU kernels at Qwen3-30B-A3B's widths
  (D 2048, 128 x F 768, top-8, row tile 32) on 512 tokens, compiled for one TPU chip by
  libtpu's compiler: (its optimized HLO text, the 30B model config)."""
  cfg = ModelConfig.from_dict(qwen3_30b_a3b.get_config().model.to_dict())
  d, e, f, k = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                cfg.num_experts_per_tok)
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731

  def loss(x, gate, up, down, ids):
    y = moe.experts_local(x, ids, gate, up, down, 0, numerics, path, cfg.expert_row_tile,
                          "pallas_tpu")
    return jnp.sum(y.astype(jnp.float32))

  compiled = compile_for_tpu(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), sds(512, d),
                             sds(d, e, f), sds(d, e, f), sds(e, f, d),
                             jax.ShapeDtypeStruct((512, k), jnp.int32))
  return compiled.as_text(), cfg


def _tgmm_calls(kernels: dict[str, int]) -> int:
  return sum(n for name, n in kernels.items() if "tgmm" in name)


def test_the_routed_tiles_and_their_backward_compile_for_tpu_at_qwen3_30b_a3b_widths():
  # the training path's routed tiles on the TPU kernels, forward and written-out backward
  # (the tiles' input gradients on grouped_matmul, the weight gradients on megablox's
  # tgmm), 512 tokens (256 tiles). No per-tile [N, D, F] weight copy or weight-gradient
  # product is left in the program (the jnp backward's were 48 GiB a v5p chip in the 30B
  # GRPO step).
  text, cfg = _experts_value_and_grad_for_tpu(DET, "tiled")
  d, f = cfg.hidden_size, cfg.moe_intermediate_size
  kernels = mosaic_kernels(text)
  assert kernels["grouped_matmul_tpu"] == 6, kernels  # gate, up, down: forward and backward
  assert _tgmm_calls(kernels) == 3, kernels
  n_tiles = 512 * cfg.num_experts_per_tok // cfg.expert_row_tile + cfg.num_experts
  assert not re.search(rf"\[{n_tiles},({d},{f}|{f},{d})\]", text)


def test_the_fast_ragged_path_takes_its_weight_gradients_from_tgmm_on_tpu():
  # fast numerics' "ragged" path with the TPU kernel ("auto" on TPU): the three weight
  # gradients are megablox tgmm kernels (XLA's own transpose of ragged_dot was a dense
  # masked convolution over every expert: 81% of the 30B step's FLOPs), the forward and
  # input gradients the TPU's ragged dots
  text, _ = _experts_value_and_grad_for_tpu(FAST, "ragged")
  kernels = mosaic_kernels(text)
  assert _tgmm_calls(kernels) == 3, kernels


def test_the_model_runs_its_tiles_on_the_configured_kernel():
  # the tiny policy's training forward with `expert_kernel="pallas_interpret"`: the same
  # log-prob bits as with the jnp tiles (deterministic numerics); lowered for a TPU with
  # "pallas_tpu", the kernel is in the program
  base = ModelConfig(**TINY).resolved("cpu", DET)
  params = init_params(base, jax.random.key(0))
  rng = np.random.default_rng(8)
  tokens = jnp.asarray(rng.integers(1, base.vocab_size, size=(2, 32)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (2, 32))
  lps = {kernel: jax.jit(lambda p, cfg=dataclasses.replace(base, expert_kernel=kernel): forward(
      p, tokens, positions, cfg=cfg, numerics=DET, targets=tokens).logprobs)(params)
         for kernel in ("jnp", "pallas_interpret")}
  chex.assert_trees_all_equal(lps["pallas_interpret"], lps["jnp"])
  tpu = dataclasses.replace(base, expert_kernel="pallas_tpu")
  lowered = jax.jit(lambda p: forward(p, tokens, positions, cfg=tpu, numerics=DET).logits).trace(
      params).lower(lowering_platforms=("tpu",))
  assert "tpu_custom_call" in lowered.as_text()


def test_the_combine_backward_is_autodiffs():
  # combine's written-out VJP gives autodiff's gradients of the ordered sum, bit for bit
  rng = np.random.default_rng(9)
  y = jnp.asarray(rng.normal(size=(24, 8, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.random(size=(24, 8)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(24, 16)), jnp.bfloat16)
  _, vjp = jax.vjp(moe.combine, y, w)
  _, vjp_autodiff = jax.vjp(moe.combine.fun, y, w)
  dy, dw = vjp(g)
  dy_ref, dw_ref = vjp_autodiff(g)
  chex.assert_trees_all_equal(dy, dy_ref)
  # dw: the same products summed over D in another order (f32), then rounded to bf16
  chex.assert_trees_all_close(dw, dw_ref, rtol=2 ** -7)


@pytest.mark.parametrize("s,num_keys", [(1, 1), (37, 6), (8192, 129)])
def test_stable_order_is_a_stable_argsort(s, num_keys):
  keys = jnp.asarray(np.random.default_rng(s).integers(0, num_keys, size=s), jnp.int32)
  order = jax.jit(moe_tiles.stable_order, static_argnums=1)(keys, num_keys)
  np.testing.assert_array_equal(order, jnp.argsort(keys, stable=True))
