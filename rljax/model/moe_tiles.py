"""The routed experts in fixed row tiles: `rljax.model.moe`'s "tiled" path.

A layer's slots (token, k-th expert) are sorted by expert into tiles of `row_tile` rows,
one expert per tile (`tile_plan`); every tile is one (row_tile x D) @ (D x F) product of
its expert's weights (`tile_matmul`: batched jnp dots on CPU, the Pallas grouped matmul on
TPU / GPU), and the rows go back to their slots. A fixed product shape fixes the order of
a row's sums whatever the routing, so the path is batch-invariant bit for bit: the routed
path of deterministic numerics for trainer and engine. The backward is written out
(`_routed_tiles_bwd`).
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import (expert_weight_grads, grouped_matmul,
                                           grouped_matmul_reference)


def stable_order(keys: jax.Array, num_keys: int) -> jax.Array:
  """`jnp.argsort(keys, stable=True)` for keys [S] int in [0, num_keys): one sort of the
  unique keys key * S + index (3-4x faster than XLA:CPU's two-operand stable sort)."""
  s = keys.shape[0]
  if num_keys * s >= 2 ** 31:
    return jnp.argsort(keys, stable=True)
  index = jnp.arange(s, dtype=jnp.int32)
  return lax.sort(keys.astype(jnp.int32) * s + index) % s


def tile_plan(slot_expert: jax.Array, num_experts: int, row_tile: int, *,
              first_tiles_in_place: bool = False):
  """Where each slot goes when slots are grouped by expert into tiles of `row_tile` rows.

  slot_expert [S] int in [0, num_experts]; `num_experts` marks a slot computed elsewhere.
  Slots are sorted by expert (stable: slot order within an expert), and each expert's rows
  start on a tile boundary, so every tile belongs to one expert. Returns
  (src [N * row_tile]: the slot in each tile row, S for padding;
   dest [S]: each slot's row, N * row_tile for slots computed elsewhere;
   tile_expert [N]: each tile's expert), with N = ceil(S / row_tile) + num_experts tiles,
  enough for any routing (each expert wastes less than one tile).

  Tiles in expert order, each expert's tiles together (what a kernel that reads weights
  in place wants: one weight fetch per expert), or with `first_tiles_in_place` tile e is
  expert e's first tile (so tiles [0, E) take the weights as they are, no gather) and
  experts' further rows follow from tile E on, in expert order. Either way an expert
  wastes under one tile and N tiles hold any routing (further tiles: sum over experts of
  ceil((n_e - r) / r) <= S / r).
  """
  s = slot_expert.shape[0]
  n_tiles = -(-s // row_tile) + num_experts
  order = stable_order(slot_expert, num_experts + 1)
  sorted_expert = slot_expert[order]
  sizes = jnp.bincount(slot_expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  first_sorted = jnp.cumsum(sizes) - sizes
  e = jnp.minimum(sorted_expert, num_experts - 1)
  rank = jnp.arange(s, dtype=jnp.int32) - first_sorted[e]  # the slot's row in its expert
  if first_tiles_in_place:
    tiles = -(-jnp.maximum(sizes - row_tile, 0) // row_tile)  # tiles after the first
    tile_end = jnp.cumsum(tiles)
    later = (num_experts + tile_end[e] - tiles[e]) * row_tile + rank - row_tile
    row = jnp.where(rank < row_tile, e * row_tile + rank, later)
    tile_expert = jnp.concatenate([
        jnp.arange(num_experts, dtype=jnp.int32),
        jnp.searchsorted(tile_end, jnp.arange(n_tiles - num_experts), side="right")])
  else:
    tiles = -(-sizes // row_tile)
    tile_end = jnp.cumsum(tiles)
    row = (tile_end[e] - tiles[e]) * row_tile + rank
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right")
  row = jnp.where(sorted_expert < num_experts, row, n_tiles * row_tile)
  dest = jnp.zeros((s,), jnp.int32).at[order].set(row)
  src = jnp.full((n_tiles * row_tile,), s, jnp.int32).at[row].set(order.astype(jnp.int32),
                                                                  mode="drop")
  return src, dest, jnp.minimum(tile_expert, num_experts - 1).astype(jnp.int32)


GPU_BLOCK_K = 256


def tile_matmul(xs: jax.Array, w: jax.Array, tile_expert: jax.Array, kernel: str,
                in_place: int = 0, exact: bool = True) -> jax.Array:
  """xs [N, r, D] tiles, w [E, D, F], tile_expert [N] -> f32 [N, r, F]: each tile times its
  expert's weights (w rounded to xs's dtype), the whole D in one fixed-shape product.

  kernel "jnp": batched dots with f32 operands holding the input values (bf16 products
  are exact in f32: one rounding, whatever the dot's kernel does with its operands), or,
  with `exact=False` (the engine's fast path), with the operands in xs's dtype and f32
  sums (a YNNPACK bf16 batched dot on CPU; the weights gathered per tile at half the
  bytes); the first `in_place` tiles are experts 0, 1, ... in order
  (`tile_plan(first_tiles_in_place=True)`) and take w as it is, the others' weights are
  gathered per tile;
  "pallas_tpu" / "pallas_gpu": `pallas_kernels.grouped_matmul` (Mosaic / Triton: weights
  read in place through the tile's expert id, operands in xs's dtype; on GPU the whole D
  does not fit shared memory at real widths, so D is summed in blocks of
  gcd(D, GPU_BLOCK_K), in order); "pallas_interpret":
  the TPU kernel interpreted on CPU with the jnp kernel's f32 operands, so the same bits
  (tests). Forward only: `_routed_tiles`' written-out backward differentiates it, with jnp
  dots whatever the kernel (gradients need not be batch-invariant).
  """
  if kernel == "jnp" and not exact:
    return _jnp_tiles_inexact(xs, w.astype(xs.dtype), tile_expert, in_place)
  if kernel == "jnp":
    return _jnp_tiles(xs, w, tile_expert, in_place)
  if kernel == "pallas_interpret":
    return grouped_matmul(xs.astype(jnp.float32), w.astype(xs.dtype).astype(jnp.float32),
                          tile_expert, backend="tpu", interpret=True)
  if kernel == "pallas_gpu":  # Triton: a K loop in fixed blocks (shared memory; power-of-two
    # dot tiles), the same order for every tile
    return grouped_matmul(xs, w, tile_expert, backend="gpu",
                          block_k=math.gcd(xs.shape[-1], GPU_BLOCK_K))
  return grouped_matmul(xs, w, tile_expert, backend="tpu")


def _jnp_tiles(xs, w, tile_expert, in_place):
  """The "jnp" kernel: every tile one (r x D) @ (D x F) product of f32 operands, batched
  (the same per-tile shape in both dots, so the same bits for a row in either)."""
  if not in_place:
    return grouped_matmul_reference(xs, w, tile_expert)
  first = jnp.einsum("nrd,ndf->nrf", xs[:in_place].astype(jnp.float32),
                     w.astype(xs.dtype).astype(jnp.float32))
  later = grouped_matmul_reference(xs[in_place:], w, tile_expert[in_place:])
  return jnp.concatenate([first, later])


def _jnp_tiles_inexact(xs, w, tile_expert, in_place):
  """`_jnp_tiles` on operands in xs's dtype (w already cast), f32 sums: fast numerics."""
  dot = functools.partial(jnp.einsum, "nrd,ndf->nrf", preferred_element_type=jnp.float32)
  later = dot(xs[in_place:], w[tile_expert[in_place:]])
  return jnp.concatenate([dot(xs[:in_place], w), later]) if in_place else later


def _tiles_transposed(dy, w, tile_expert, in_place):
  """dy [N, r, F] f32, w [E, D, F] f32 -> f32 [N, r, D]: each tile times its expert's
  weights transposed (`_jnp_tiles`' backward for its input)."""
  later = jnp.einsum("nrf,ndf->nrd", dy[in_place:], w[tile_expert[in_place:]])
  if not in_place:
    return later
  return jnp.concatenate([jnp.einsum("nrf,ndf->nrd", dy[:in_place], w), later])


def _tile_weight_grads(xs, dy, tile_expert, num_experts, in_place):
  """xs [N, r, D], dy [N, r, F] f32 -> f32 [E, D, F]: per expert, the sum over its tiles (in
  order) of xs_tile^T dy_tile (`_jnp_tiles`' backward for its weights)."""
  per_tile = jnp.einsum("nrd,nrf->ndf", xs[in_place:], dy[in_place:])
  if in_place:
    first = jnp.einsum("nrd,nrf->ndf", xs[:in_place], dy[:in_place])
  else:
    first = jnp.zeros((num_experts, *per_tile.shape[1:]), jnp.float32)
  return first.at[tile_expert[in_place:]].add(per_tile)


def experts_tiled(x, slot_expert, gate, up, down, numerics, row_tile, kernel, exact=True):
  """Routed experts only (the "tiled" path, see the module doc). slot_expert [T, k]: local
  expert of each slot, E_local for none. -> [T, k, D].

  `exact=False` (the engine's fast CPU path, `moe`'s "by_tokens"; a forward that is never
  differentiated): the jnp kernel's dots take the operands in the compute dtype
  (`tile_matmul`); the trainer's tiles keep exact products and the written-out backward.

  The jnp kernel lays expert e's first tile at tile e (no weight gather for those); the
  Pallas kernels read weights in place anyway and get each expert's tiles together. The
  outputs go back to their slots by a scatter of the tile rows: XLA:CPU fuses a gather
  into the combine's loop, where it runs 5-10x slower.
  """
  e_local, k = gate.shape[1], slot_expert.shape[1]
  in_place = e_local if kernel == "jnp" else 0
  src, _, tile_expert = tile_plan(slot_expert.reshape(-1), e_local, row_tile,
                                  first_tiles_in_place=bool(in_place))
  if not exact:
    return _routed_tiles_forward(x, gate, up, down, src, tile_expert, numerics, row_tile,
                                 kernel, in_place, k, exact=False)[0]
  return _routed_tiles(x, gate, up, down, src, tile_expert, numerics, row_tile, kernel,
                       in_place, k)


def _routed_tiles_forward(x, gate, up, down, src, tile_expert, numerics, row_tile, kernel,
                          in_place, k, exact=True):
  t, d = x.shape
  xs = x.at[src // k].get(mode="fill", fill_value=0).reshape(-1, row_tile, d)
  g = tile_matmul(xs, gate.transpose(1, 0, 2), tile_expert, kernel, in_place,
                  exact).astype(x.dtype)
  u = tile_matmul(xs, up.transpose(1, 0, 2), tile_expert, kernel, in_place,
                  exact).astype(x.dtype)
  act = numerics.silu(g).astype(x.dtype)
  hidden = act * u
  ys = tile_matmul(hidden, down, tile_expert, kernel, in_place, exact)
  # padding rows (src = t * k) are dropped; slots computed elsewhere stay 0
  y = jnp.zeros((t * k, d), ys.dtype).at[src].set(ys.reshape(-1, d), mode="drop")
  return y.astype(x.dtype).reshape(t, k, d), (xs, g, u, act, hidden)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _routed_tiles(x, gate, up, down, src, tile_expert, numerics, row_tile, kernel, in_place,
                  k):
  """`experts_tiled`'s tiles; the backward is written out: autodiff of the gathers, casts
  and concatenations took about twice as long (128 experts top-8 on 1,024 tokens, CPU)."""
  return _routed_tiles_forward(x, gate, up, down, src, tile_expert, numerics, row_tile,
                               kernel, in_place, k)[0]


def _routed_tiles_fwd(x, gate, up, down, src, tile_expert, numerics, row_tile, kernel,
                      in_place, k):
  y, saved = _routed_tiles_forward(x, gate, up, down, src, tile_expert, numerics, row_tile,
                                   kernel, in_place, k)
  return y, (gate, up, down, src, tile_expert, saved)  # x: only its shape and dtype


def _routed_tiles_bwd(numerics, row_tile, kernel, in_place, k, residuals, dy):
  """Autodiff's cotangents through the forward's casts (rounded to the compute dtype where
  the forward rounds), with f32 sums: each expert's weight gradient over its tiles in
  order, and each token's k slots in slot order (a scatter-add's order would follow the
  tile layout, which differs between kernels). With the TPU kernel the tiles' input
  gradients are `grouped_matmul`s by the transposed weights and the weight gradients
  megablox's tgmm (`expert_weight_grads`: its own fixed order over an expert's rows)."""
  del row_tile
  gate, up, down, src, tile_expert, (xs, g, u, act, hidden) = residuals
  t, _, d = dy.shape
  dtype, e_local = xs.dtype, gate.shape[1]
  on_tpu_kernels = kernel == "pallas_tpu"  # Mosaic: no per-tile [N, D, F] weights/products

  def weight_grads(x, dyt):
    if on_tpu_kernels:
      return expert_weight_grads(x, dyt, tile_expert, e_local)
    return _tile_weight_grads(x, dyt, tile_expert, e_local, in_place)

  def transposed(dyt, w):
    if on_tpu_kernels:
      return tile_matmul(dyt, w.transpose(0, 2, 1), tile_expert, kernel)
    return _tiles_transposed(dyt, w, tile_expert, in_place)

  operand = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731  (as the kernel's)
  dys = dy.reshape(t * k, d).at[src].get(mode="fill", fill_value=0).reshape(xs.shape)
  dys = dys.astype(jnp.float32)
  d_down = weight_grads(operand(hidden), dys)
  d_hidden = transposed(dys, operand(down)).astype(dtype)
  _, silu_vjp = jax.vjp(lambda z: numerics.silu(z).astype(dtype), g)
  dg = silu_vjp(d_hidden * u)[0].astype(jnp.float32)
  du = (d_hidden * act).astype(jnp.float32)
  dxs = (transposed(dg, operand(gate.transpose(1, 0, 2)))
         + transposed(du, operand(up.transpose(1, 0, 2))))
  d_slots = jnp.zeros((t * k, d), jnp.float32).at[src].set(dxs.reshape(-1, d), mode="drop")
  d_slots = d_slots.reshape(t, k, d)
  dx = d_slots[:, 0]
  for j in range(1, k):
    dx = dx + d_slots[:, j]
  xs = operand(xs)
  d_gate = weight_grads(xs, dg).transpose(1, 0, 2)
  d_up = weight_grads(xs, du).transpose(1, 0, 2)
  return (dx.astype(dtype), d_gate.astype(gate.dtype), d_up.astype(up.dtype),
          d_down.astype(down.dtype), None, None)


_routed_tiles.defvjp(_routed_tiles_fwd, _routed_tiles_bwd)
