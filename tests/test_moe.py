"""The expert paths (rljax.model.moe): in fast mode dense, ragged and tiled agree, in values
and in gradients; in deterministic mode the routed-only tiles give the dense path's bits
for any routing, tile size and token count, at a fraction of its FLOPs; the tile plan
covers every routed slot with one expert per tile."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_moe
from rljax.model import ModelConfig, moe
from rljax.numerics import Numerics

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


@pytest.mark.parametrize("row_tile", [8, 32, 128])
def test_deterministic_routed_tiles_give_the_dense_paths_bits(row_tile):
  # skewed routing (expert 0 takes most slots), slots of another shard (offset 2), token
  # counts that fill tiles differently: every slot's output is the dense path's, bitwise
  x, ids, gate, up, down = _problem(96, 64, 8, 32, 2, jnp.bfloat16, seed=3)
  ids = ids.at[::3, 0].set(2)
  for t in (96, 37, 5, 1):
    args = (x[:t], ids[:t], gate, up, down)
    dense, tiled = (jax.jit(lambda *a, path=path: moe.experts_local(
        *a, 2, DET, path, row_tile))(*args) for path in ("dense", "tiled"))
    chex.assert_trees_all_equal(tiled, dense)
    # and a token's outputs do not depend on its companions
    chex.assert_trees_all_equal(tiled[t - 1:], jax.jit(lambda *a: moe.experts_local(
        *a, 2, DET, "tiled", row_tile))(x[t - 1:t], ids[t - 1:t], gate, up, down))


def test_deterministic_routed_tiles_cost_the_routed_flops():
  # 32 experts, top-2, 512 tokens: dense computes 16x the routed expert FLOPs; the tiles
  # compute the routed ones plus under one tile of padding per expert. XLA's cost analysis
  # counts a loop body once, so the tiled path's FLOPs are its compiled loop's trip count
  # (read from the executable) times one tile's three (tile x d) @ (d x f)-sized dots.
  t, d, e, f, k, tile = 512, 64, 32, 32, 2, 32
  x, ids, gate, up, down = _problem(t, d, e, f, k, jnp.bfloat16, seed=4, extra_ids=0)
  compiled = {path: jax.jit(lambda *a, path=path: moe.experts_local(
      *a, 0, DET, path, tile)).lower(x, ids, gate, up, down).compile() for path in
              ("dense", "tiled")}
  n_tiles = -(-t * k // tile) + e
  assert f'"known_trip_count":{{"n":"{n_tiles}"}}' in compiled["tiled"].as_text()
  routed = 2 * t * k * 3 * d * f  # gate, up, down per routed slot
  tiled = n_tiles * 2 * tile * 3 * d * f
  assert tiled <= 2 * routed  # routed + at most one tile per expert (here 32 of 64 tiles)
  assert compiled["dense"].cost_analysis()["flops"] >= 0.9 * e / k * routed  # 16x


@pytest.mark.parametrize("row_tile", [1, 4, 16])
def test_the_tile_plan_holds_every_slot_once_in_a_tile_of_its_expert(row_tile):
  rng = np.random.default_rng(row_tile)
  e, s = 5, 37
  # skewed routing (one expert takes most slots) and slots computed elsewhere (= e)
  slot_expert = rng.choice(e + 1, s, p=[0.6, 0.1, 0.1, 0.05, 0.0, 0.15])
  src, dest, tile_expert = map(np.asarray, jax.jit(moe.tile_plan, static_argnums=(1, 2))(
      jnp.asarray(slot_expert, jnp.int32), e, row_tile))
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


def test_an_unknown_path_is_refused():
  x, ids, gate, up, down = _problem(4, 8, 2, 4, 1, jnp.float32, extra_ids=0)
  with pytest.raises(ValueError, match="unknown expert path 'sparse'"):
    moe.experts_local(x, ids, gate, up, down, 0, FAST, "sparse")
  with pytest.raises(ValueError, match="unknown train_experts 'sparse'"):
    ModelConfig.from_dict(dict(tiny_moe.get_config().model, train_experts="sparse"))
  with pytest.raises(ValueError, match="expert_row_tile must be >= 1"):
    ModelConfig.from_dict(dict(tiny_moe.get_config().model, expert_row_tile=0))
