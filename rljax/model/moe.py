"""Dropless mixture-of-experts: routing, expert compute and a fixed-order combine.

No capacity, no drops: a token's output depends only on the token. Expert paths:

* fast, "ragged": slots sorted by expert and `lax.ragged_dot` (a grouped GEMM on GPU/TPU).
* fast, "tiled": slots sorted by expert into fixed tiles of `row_tile` rows, one expert per
  tile, one batched dot over the tiles: the routed FLOPs plus under one tile per expert
  (XLA:CPU expands `ragged_dot` into masked dense dots over every expert instead).
* fast, "dense": every expert for every token, each slot's output picked out; the cheapest
  for a few tokens (one engine decode step).
* deterministic, "dense": every local expert applied to every token with plain 2-D bf16
  dots (one per expert for the down projection) whose per-row numerics do not depend on
  the row count, then each token's chosen experts picked out: num_experts / top_k times
  the expert FLOPs, the cheapest for a few tokens.
* deterministic, any other path: routed experts only, in the fast "tiled" path's tiles,
  but one fixed-shape 2-D bf16 dot (row_tile x D) @ (D x F) per tile, in a `lax.map`:
  no split-K, and a row's sums do not depend on its tile's other rows, on how many rows
  its expert got or on the tile count, so its bits are the dense path's.

Expert parallelism (`expert` mesh axis > 1) runs under `jax.shard_map`: each device
gathers the tokens of its expert group, computes its own experts for them, and an
`all_to_all` returns every slot's output to the token's device, where the k slots are
summed in fixed order (no psum: a psum over >= 3 devices does not sum in device order).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from rljax import sharding as sharding_lib
from rljax.numerics import Numerics, det_exp


def silu(x: jax.Array, numerics: Numerics) -> jax.Array:
  x = x.astype(jnp.float32)
  if not numerics.deterministic:
    return jax.nn.silu(x)
  return x / (1.0 + det_exp(-x))


def route(x: jax.Array, router: jax.Array, *, top_k: int, norm_topk_prob: bool,
          numerics: Numerics, replay: jax.Array | None = None):
  """x [T, D] -> (expert ids [T, k] int32, weights [T, k] f32).

  With `replay`, those expert ids are used instead of the top-k; their weights still
  come from this router's probabilities, so the router keeps its gradient.
  """
  probs = numerics.softmax(numerics.matmul(x, router))
  if replay is None:
    _, ids = lax.top_k(probs, top_k)
  else:
    ids = replay
  ids = ids.astype(jnp.int32)
  weights = jnp.take_along_axis(probs, ids, axis=-1)
  if norm_topk_prob:
    weights = weights / numerics.sum(weights)[..., None]
  return ids, weights


PATHS = ("dense", "ragged", "tiled")


def experts_local(x: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, expert_offset: jax.Array | int,
                  numerics: Numerics, path: str = "ragged", row_tile: int = 128) -> jax.Array:
  """Outputs of the local experts [offset, offset + E_local) for each slot.

  x [T, D]; ids [T, k] global expert ids; gate/up [D, E_local, F]; down [E_local, F, D].
  Returns [T, k, D] in x's dtype, zero for slots whose expert is not local. `path` (one
  of `PATHS`, see the module doc) is fast mode's; deterministic mode has its own.
  """
  if path not in PATHS:
    raise ValueError(f"unknown expert path {path!r}; expected one of {PATHS}")
  t, d = x.shape
  e_local, f = gate.shape[1], gate.shape[2]
  local = ids - expert_offset
  is_local = (local >= 0) & (local < e_local)
  if numerics.deterministic and path != "dense":
    y = _experts_tiled_deterministic(x, jnp.where(is_local, local, e_local), gate, up,
                                     down, numerics, row_tile)
  elif path == "tiled":
    y = _experts_tiled(x, jnp.where(is_local, local, e_local), gate, up, down, numerics,
                       row_tile)
  elif path == "dense":  # every local expert, slots picked
    g = numerics.matmul(x, gate.reshape(d, e_local * f)).astype(x.dtype)
    u = numerics.matmul(x, up.reshape(d, e_local * f)).astype(x.dtype)
    hidden = (silu(g, numerics).astype(x.dtype) * u).reshape(t, e_local, f)
    if numerics.deterministic:
      # one plain 2-D dot per expert: a batched dot's kernel (and rounding) is XLA's choice
      y_all = jnp.stack([numerics.matmul(hidden[:, e], down[e]) for e in range(e_local)],
                        axis=1)
    else:
      # f32 operands (bf16 products are exact in f32): XLA:CPU has no bf16 batched dot thunk
      y_all = jnp.einsum("tef,efd->ted", hidden.astype(jnp.float32),
                         down.astype(x.dtype).astype(jnp.float32))
    y = jnp.take_along_axis(y_all.astype(x.dtype), jnp.clip(local, 0, e_local - 1)[..., None],
                            axis=1)
  else:
    k = ids.shape[1]
    slot_expert = jnp.where(is_local, local, e_local).reshape(-1)  # non-local sort last
    order = jnp.argsort(slot_expert, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(slot_expert, length=e_local + 1)[:e_local].astype(jnp.int32)
    gate_e = gate.transpose(1, 0, 2).astype(x.dtype)
    up_e = up.transpose(1, 0, 2).astype(x.dtype)
    g = lax.ragged_dot(xs, gate_e, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    u = lax.ragged_dot(xs, up_e, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    hidden = silu(g, numerics).astype(x.dtype) * u
    ys = lax.ragged_dot(hidden, down.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(ys).at[order].set(ys).astype(x.dtype).reshape(t, k, d)
  return jnp.where(is_local[..., None], y, jnp.zeros((), x.dtype))


def tile_plan(slot_expert: jax.Array, num_experts: int, row_tile: int):
  """Where each slot goes when slots are grouped by expert into tiles of `row_tile` rows.

  slot_expert [S] int in [0, num_experts]; `num_experts` marks a slot computed elsewhere.
  Slots are sorted by expert (stable: slot order within an expert), and each expert's rows
  start on a tile boundary, so every tile belongs to one expert. Returns
  (src [N * row_tile]: the slot in each tile row, S for padding;
   dest [S]: each slot's row, N * row_tile for slots computed elsewhere;
   tile_expert [N]: each tile's expert), with N = ceil(S / row_tile) + num_experts tiles,
  enough for any routing (each expert wastes less than one tile).
  """
  s = slot_expert.shape[0]
  n_tiles = -(-s // row_tile) + num_experts
  order = jnp.argsort(slot_expert, stable=True)
  sorted_expert = slot_expert[order]
  sizes = jnp.bincount(slot_expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  tiles = -(-sizes // row_tile)
  tile_end = jnp.cumsum(tiles)
  first_tile = tile_end - tiles
  first_sorted = jnp.cumsum(sizes) - sizes
  e = jnp.minimum(sorted_expert, num_experts - 1)
  row = first_tile[e] * row_tile + jnp.arange(s, dtype=jnp.int32) - first_sorted[e]
  row = jnp.where(sorted_expert < num_experts, row, n_tiles * row_tile)
  dest = jnp.zeros((s,), jnp.int32).at[order].set(row)
  src = jnp.full((n_tiles * row_tile,), s, jnp.int32).at[row].set(order.astype(jnp.int32),
                                                                  mode="drop")
  tile_expert = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right")
  return src, dest, jnp.minimum(tile_expert, num_experts - 1).astype(jnp.int32)


def _experts_tiled(x, slot_expert, gate, up, down, numerics, row_tile):
  """Routed experts only. slot_expert [T, k]: local expert of each slot, E_local for none.
  Slots grouped by expert into tiles (`tile_plan`); one (row_tile x D) @ (D x F) product
  per tile with its expert's weights. f32 operands holding the compute dtype's values
  (XLA:CPU has no bf16 batched dot thunk; bf16 products are exact in f32). -> [T, k, D]."""
  t, d = x.shape
  k = slot_expert.shape[1]
  src, dest, tile_expert = tile_plan(slot_expert.reshape(-1), gate.shape[1], row_tile)
  as_f32 = lambda w: w.astype(x.dtype).astype(jnp.float32)  # noqa: E731
  xs = x.at[src // k].get(mode="fill", fill_value=0).astype(jnp.float32)
  xs = xs.reshape(-1, row_tile, d)
  g = jnp.einsum("nrd,ndf->nrf", xs, as_f32(gate.transpose(1, 0, 2))[tile_expert])
  u = jnp.einsum("nrd,ndf->nrf", xs, as_f32(up.transpose(1, 0, 2))[tile_expert])
  hidden = silu(g.astype(x.dtype), numerics).astype(x.dtype) * u.astype(x.dtype)
  ys = jnp.einsum("nrf,nfd->nrd", hidden.astype(jnp.float32), as_f32(down)[tile_expert])
  y = ys.reshape(-1, d).at[dest].get(mode="fill", fill_value=0)  # slots elsewhere: 0
  return y.astype(x.dtype).reshape(t, k, d)


def _experts_tiled_deterministic(x, slot_expert, gate, up, down, numerics, row_tile):
  """Routed experts only, deterministic: the tiles of `tile_plan`, each computed by one
  fixed-shape 2-D bf16 dot per projection with its expert's weights (numerics.matmul: f32
  accumulation, the row tile a multiple of numerics.row_tile), tile after tile. A row's
  result is the dense path's, bit for bit. slot_expert [T, k] -> [T, k, D]."""
  t, d = x.shape
  k = slot_expert.shape[1]
  tile = numerics.pad_rows(row_tile)
  src, dest, tile_expert = tile_plan(slot_expert.reshape(-1), gate.shape[1], tile)
  xs = x.at[src // k].get(mode="fill", fill_value=0).reshape(-1, tile, d)

  def one_tile(args):
    rows, e = args
    g = numerics.matmul(rows, gate[:, e]).astype(x.dtype)
    u = numerics.matmul(rows, up[:, e]).astype(x.dtype)
    hidden = silu(g, numerics).astype(x.dtype) * u
    return numerics.matmul(hidden, down[e]).astype(x.dtype)

  ys = lax.map(one_tile, (xs, tile_expert))
  y = ys.reshape(-1, d).at[dest].get(mode="fill", fill_value=0)  # slots elsewhere: 0
  return y.reshape(t, k, d)


def combine(y: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_k weights[:, k] * y[:, k] in order k = 0, 1, ... (f32), returned in y's dtype."""
  w = weights.astype(y.dtype).astype(jnp.float32)  # HF casts routing weights to the model dtype
  acc = y[:, 0].astype(jnp.float32) * w[:, 0:1]
  for j in range(1, y.shape[1]):
    acc = acc + y[:, j].astype(jnp.float32) * w[:, j:j + 1]
  return acc.astype(y.dtype)


def moe_block(x: jax.Array, params: dict, *, top_k: int, norm_topk_prob: bool,
              numerics: Numerics, sharding: sharding_lib.Sharding | None = None,
              replay: jax.Array | None = None, path: str = "ragged", row_tile: int = 128):
  """x [T, D] -> (y [T, D], expert ids [T, k]). `path`, `row_tile`: see `experts_local`."""
  router = sharding_lib.constrain(sharding, params["router"], ("embed", "router"), gathered=True)
  ids, weights = route(x, router, top_k=top_k, norm_topk_prob=norm_topk_prob,
                       numerics=numerics, replay=replay)
  if sharding is not None and sharding.axis_size("expert") > 1:
    y = _experts_expert_parallel(x, ids, params, numerics, sharding, path, row_tile)
  else:
    gate, up, down = (sharding_lib.constrain(sharding, params[n], axes, gathered=True)
                      for n, axes in (("gate", ("embed", "expert", "mlp")),
                                      ("up", ("embed", "expert", "mlp")),
                                      ("down", ("expert", "mlp", "embed"))))
    y = experts_local(x, ids, gate, up, down, 0, numerics, path, row_tile)
  return combine(y, weights), ids


def _experts_expert_parallel(x, ids, params, numerics, sharding, path, row_tile):
  tokens = sharding.spec(("batch", None))
  slots = sharding.spec(("batch", None, None))
  w_in = sharding.spec(("embed", "expert", "mlp"), gathered=True)
  w_out = sharding.spec(("expert", "mlp", "embed"), gathered=True)

  @functools.partial(jax.shard_map, mesh=sharding.mesh,
                     in_specs=(tokens, tokens, w_in, w_in, w_out), out_specs=slots,
                     check_vma=False)
  def run(x_l, ids_l, gate_l, up_l, down_l):
    n = lax.axis_size("expert")
    e_local = gate_l.shape[1]
    me = lax.axis_index("expert")
    x_group = lax.all_gather(x_l, "expert")  # [n, T_l, D]: the tokens of the expert group
    ids_group = lax.all_gather(ids_l, "expert")
    t_l, k = ids_l.shape
    y = experts_local(x_group.reshape(n * t_l, -1), ids_group.reshape(n * t_l, k),
                      gate_l, up_l, down_l, me * e_local, numerics, path, row_tile)
    # y[i] are this device's outputs for device i's tokens; send them home
    y_home = lax.all_to_all(y.reshape(n, t_l, k, -1), "expert", 0, 0)  # [n (source), T_l, k, D]
    owner = ids_l // e_local  # which device computed each slot
    return jnp.take_along_axis(y_home, owner[None, :, :, None], axis=0)[0]

  return run(x, ids, params["gate"], params["up"], params["down"])
