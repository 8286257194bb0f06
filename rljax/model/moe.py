"""Dropless mixture-of-experts: routing, expert compute and a fixed-order combine.

No capacity, no drops: a token's output depends only on the token. Expert paths:

* "tiled": slots sorted by expert into fixed tiles of `row_tile` rows, one expert per
  tile, batched dots over the tiles (expert e's first tile is tile e, so those take the
  weights in place; further tiles gather theirs) with f32 operands holding the compute
  dtype's values (bf16 products are exact in f32; XLA:CPU has no bf16 batched dot thunk): the routed FLOPs
  plus under one tile per expert (XLA:CPU expands `ragged_dot` into masked dense dots over
  every expert instead). Every tile is the same (row_tile x D) @ (D x F) product, with no
  split-K, so a row's sums depend neither on its tile's other rows, nor on how many rows
  its expert got, nor on the tile count: in deterministic mode this is the routed path
  ("ragged" there means "tiled"), batch-invariant bit for bit.
* fast, "ragged": slots sorted by expert and `lax.ragged_dot` (a grouped GEMM on GPU/TPU).
* "dense": every expert for every token, each slot's output picked out; the cheapest for a
  few tokens (one engine decode step) when experts are few. In deterministic mode every
  local expert is applied with plain 2-D bf16 dots (one per expert for the down
  projection) whose per-row numerics do not depend on the row count: num_experts / top_k
  times the expert FLOPs, and not the tiled path's bits (another dot kernel), so trainer
  and engine must both use it or neither (`ModelConfig.resolved` checks).
  In fast numerics on one device (`moe_block` without expert parallelism) it is
  `dense_mixture`: the combine folded into one down-projection dot.
* fast, "by_tokens" (the engine's CPU choice): "tiled" when the dense path would compute
  enough more rows than the tiled path (`tiled_beats_dense`, from the call's static
  shapes: prefills of many tokens with many experts), else "dense" (decode steps); the
  threshold is where the two cross on CPU (experiments/bench_engine_experts).

Expert parallelism (`expert` mesh axis > 1), and any sharded run whose tiles a Pallas kernel
multiplies (XLA cannot partition a kernel call), runs under `jax.shard_map`: each device
gathers the tokens of its expert group, computes its own experts for them, and an
`all_to_all` returns every slot's output to the token's device, where the k slots are
summed in fixed order (no psum: a psum over >= 3 devices does not sum in device order).
A `model` axis does not split an expert's width there (that would leave each device a
partial sum of the down projection): the expert weights are gathered over it at use, as
over `fsdp`, and the tokens are split over it instead, so every slot is one device's
whole dot: the same bits whatever the mesh.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import (expert_weight_grads, grouped_matmul,
                                           grouped_matmul_reference, ragged_dot_tgmm)
from rljax import sharding as sharding_lib
from rljax.model.config import KERNELS
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


PATHS = ("dense", "ragged", "tiled", "by_tokens")


def experts_local(x: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, expert_offset: jax.Array | int,
                  numerics: Numerics, path: str = "ragged", row_tile: int = 32,
                  kernel: str = "jnp") -> jax.Array:
  """Outputs of the local experts [offset, offset + E_local) for each slot.

  x [T, D]; ids [T, k] global expert ids; gate/up [D, E_local, F]; down [E_local, F, D].
  Returns [T, k, D] in x's dtype, zero for slots whose expert is not local. `path`: one
  of `PATHS` (see the module doc; in deterministic mode "ragged" runs "tiled"). `kernel`:
  what multiplies the tiles (one of `KERNELS`, see `tile_matmul`).
  """
  if path not in PATHS:
    raise ValueError(f"unknown expert path {path!r}; expected one of {PATHS}")
  if kernel not in KERNELS:
    raise ValueError(f"unknown expert kernel {kernel!r}; expected one of {KERNELS}")
  t, d = x.shape
  e_local = gate.shape[1]
  local = ids - expert_offset
  is_local = (local >= 0) & (local < e_local)
  path = resolved_path(path, numerics, t, e_local, ids.shape[1], row_tile)
  if path == "tiled" or (numerics.deterministic and path == "ragged"):
    y = _experts_tiled(x, jnp.where(is_local, local, e_local), gate, up, down, numerics,
                       row_tile, kernel)
  elif path == "dense":  # every local expert, slots picked
    hidden = _every_experts_hidden(x, gate, up, numerics)
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
    order = stable_order(slot_expert, e_local + 1)
    xs = x[order // k]
    sizes = jnp.bincount(slot_expert, length=e_local + 1)[:e_local].astype(jnp.int32)
    gate_e = gate.transpose(1, 0, 2).astype(x.dtype)
    up_e = up.transpose(1, 0, 2).astype(x.dtype)
    if kernel in ("pallas_tpu", "pallas_interpret"):  # weight gradients by megablox tgmm
      dot = functools.partial(ragged_dot_tgmm, interpret=kernel == "pallas_interpret")
    else:
      dot = functools.partial(lax.ragged_dot, preferred_element_type=jnp.float32)
    g = dot(xs, gate_e, sizes).astype(x.dtype)
    u = dot(xs, up_e, sizes).astype(x.dtype)
    hidden = silu(g, numerics).astype(x.dtype) * u
    ys = dot(hidden, down.astype(x.dtype), sizes)
    y = jnp.zeros_like(ys).at[order].set(ys).astype(x.dtype).reshape(t, k, d)
  return jnp.where(is_local[..., None], y, jnp.zeros((), x.dtype))


def resolved_path(path: str, numerics: Numerics, tokens: int, num_experts: int, top_k: int,
                  row_tile: int) -> str:
  """`path` with "by_tokens" made "tiled" or "dense" for a call of `tokens` tokens
  (`tiled_beats_dense`)."""
  if path != "by_tokens":
    return path
  if numerics.deterministic:
    raise ValueError("expert path 'by_tokens' mixes the dense and tiled paths' bits: "
                     "not in deterministic numerics")
  return "tiled" if tiled_beats_dense(tokens, num_experts, top_k, row_tile) else "dense"


def dense_mixture(x: jax.Array, ids: jax.Array, weights: jax.Array, gate: jax.Array,
                  up: jax.Array, down: jax.Array, numerics: Numerics) -> jax.Array:
  """Fast numerics' "dense" path with the combine folded in: x [T, D] -> y [T, D].

  Every expert for every token; each expert's hidden activations are scaled by the
  token's routing weight on it (0 on the experts it did not pick) before the down
  projection, so every expert's down projection and the sum over the token's k experts
  are one 2-D dot [T, E*F] @ [E*F, D] on the weights as they are. The per-slot form (a
  batched dot per expert, then `combine`) spent a third of a 32-slot CPU decode step on
  that dot and on a transposed f32 copy of the down weights made every step. Not the
  per-slot form's rounding (weight x hidden rounded to the compute dtype instead of each
  slot's output): fast numerics only.
  """
  if numerics.deterministic:
    raise ValueError("dense_mixture sums a token's experts inside one dot: fast numerics only")
  t, d = x.shape
  e, f = gate.shape[1], gate.shape[2]
  hidden = _every_experts_hidden(x, gate, up, numerics)
  # routing weights cast to the model dtype first, as `combine` (and HF) do
  w = weights.astype(x.dtype).astype(jnp.float32)
  per_expert = jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32) * w[..., None], axis=1)
  mixed = (hidden.astype(jnp.float32) * per_expert[..., None]).astype(x.dtype)
  return numerics.matmul(mixed.reshape(t, e * f), down.reshape(e * f, d)).astype(x.dtype)


def _every_experts_hidden(x: jax.Array, gate: jax.Array, up: jax.Array,
                          numerics: Numerics) -> jax.Array:
  """The dense paths' hidden activations of every expert for every token: x [T, D], gate
  and up [D, E, F] -> silu(x gate) * (x up) [T, E, F] in x's dtype (two 2-D dots)."""
  t, d = x.shape
  e, f = gate.shape[1], gate.shape[2]
  g = numerics.matmul(x, gate.reshape(d, e * f)).astype(x.dtype)
  u = numerics.matmul(x, up.reshape(d, e * f)).astype(x.dtype)
  return (silu(g, numerics).astype(x.dtype) * u).reshape(t, e, f)


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


# The engine's CPU choice between every expert for every token ("dense": `dense_mixture`,
# one device) and only the routed ones in tiles ("tiled", then `combine`): tiled when the
# dense path has more than this many rows per tiled row (`dense_work_ratio`).
# experiments/bench_engine_experts.py (AMD EPYC, 2 cores, bf16): dense was the faster at
# every ratio up to 3.8 (0.20-0.94 of tiled's time), tiled from 5.3 up (1.2-2.1x) but
# once (7.1: 0.58); with dense as a per-expert batched dot and a separate combine the two
# crossed at 2.0.
TILED_BEATS_DENSE_AT = 4.0


def tiled_beats_dense(tokens: int, num_experts: int, top_k: int, row_tile: int) -> bool:
  """Whether the tiled path is the faster on CPU for a call of `tokens` tokens."""
  return dense_work_ratio(tokens, num_experts, top_k, row_tile) > TILED_BEATS_DENSE_AT


def dense_work_ratio(tokens: int, num_experts: int, top_k: int, row_tile: int) -> float:
  """The dense path's rows (every expert for every token) over the tiled path's (each
  token's k slots, and at most a row tile of padding per expert)."""
  return tokens * num_experts / (tokens * top_k + num_experts * row_tile)


GPU_BLOCK_K = 256


def tile_matmul(xs: jax.Array, w: jax.Array, tile_expert: jax.Array, kernel: str,
                in_place: int = 0) -> jax.Array:
  """xs [N, r, D] tiles, w [E, D, F], tile_expert [N] -> f32 [N, r, F]: each tile times its
  expert's weights (w rounded to xs's dtype), the whole D in one fixed-shape product.

  kernel "jnp": batched dots with f32 operands holding the input values (bf16 products
  are exact in f32; XLA:CPU has no bf16 batched dot thunk); the first `in_place` tiles
  are experts 0, 1, ... in order (`tile_plan(first_tiles_in_place=True)`) and take w as
  it is, the others' weights are gathered per tile;
  "pallas_tpu" / "pallas_gpu": `pallas_kernels.grouped_matmul` (Mosaic / Triton: weights
  read in place through the tile's expert id, operands in xs's dtype; on GPU the whole D
  does not fit shared memory at real widths, so D is summed in blocks of
  gcd(D, GPU_BLOCK_K), in order); "pallas_interpret":
  the TPU kernel interpreted on CPU with the jnp kernel's f32 operands, so the same bits
  (tests). Forward only: `_routed_tiles`' written-out backward differentiates it, with jnp
  dots whatever the kernel (gradients need not be batch-invariant).
  """
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


def _experts_tiled(x, slot_expert, gate, up, down, numerics, row_tile, kernel):
  """Routed experts only (the "tiled" path, see the module doc). slot_expert [T, k]: local
  expert of each slot, E_local for none. -> [T, k, D].

  The jnp kernel lays expert e's first tile at tile e (no weight gather for those); the
  Pallas kernels read weights in place anyway and get each expert's tiles together. The
  outputs go back to their slots by a scatter of the tile rows: XLA:CPU fuses a gather
  into the combine's loop, where it runs 5-10x slower.
  """
  e_local, k = gate.shape[1], slot_expert.shape[1]
  in_place = e_local if kernel == "jnp" else 0
  src, _, tile_expert = tile_plan(slot_expert.reshape(-1), e_local, row_tile,
                                  first_tiles_in_place=bool(in_place))
  return _routed_tiles(x, gate, up, down, src, tile_expert, numerics, row_tile, kernel,
                       in_place, k)


def _routed_tiles_forward(x, gate, up, down, src, tile_expert, numerics, row_tile, kernel,
                          in_place, k):
  t, d = x.shape
  xs = x.at[src // k].get(mode="fill", fill_value=0).reshape(-1, row_tile, d)
  g = tile_matmul(xs, gate.transpose(1, 0, 2), tile_expert, kernel, in_place).astype(x.dtype)
  u = tile_matmul(xs, up.transpose(1, 0, 2), tile_expert, kernel, in_place).astype(x.dtype)
  act = silu(g, numerics).astype(x.dtype)
  hidden = act * u
  ys = tile_matmul(hidden, down, tile_expert, kernel, in_place)
  # padding rows (src = t * k) are dropped; slots computed elsewhere stay 0
  y = jnp.zeros((t * k, d), ys.dtype).at[src].set(ys.reshape(-1, d), mode="drop")
  return y.astype(x.dtype).reshape(t, k, d), (xs, g, u, act, hidden)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _routed_tiles(x, gate, up, down, src, tile_expert, numerics, row_tile, kernel, in_place,
                  k):
  """`_experts_tiled`'s tiles; the backward is written out: autodiff of the gathers, casts
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
  _, silu_vjp = jax.vjp(lambda z: silu(z, numerics).astype(dtype), g)
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


@jax.custom_vjp
def combine(y: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_k weights[:, k] * y[:, k] in order k = 0, 1, ... (f32), returned in y's dtype.

  The backward is written out: autodiff of the ordered sum pads each slot's cotangent to
  [T, k, D] and adds k of them (k^2 the work; 9% of a 128-expert top-8 train step).
  """
  w = weights.astype(y.dtype).astype(jnp.float32)  # HF casts routing weights to the model dtype
  acc = y[:, 0].astype(jnp.float32) * w[:, 0:1]
  for j in range(1, y.shape[1]):
    acc = acc + y[:, j].astype(jnp.float32) * w[:, j:j + 1]
  return acc.astype(y.dtype)


def _combine_fwd(y, weights):
  return combine(y, weights), (y, weights)


def _combine_bwd(residuals, g):
  y, weights = residuals
  g = g.astype(jnp.float32)[:, None, :]  # [T, 1, D]
  w = weights.astype(y.dtype).astype(jnp.float32)
  dy = (g * w[..., None]).astype(y.dtype)
  dw = jnp.sum(g * y.astype(jnp.float32), axis=-1)
  # through the routing weights' cast to y's dtype, as autodiff of the forward would
  return dy, dw.astype(y.dtype).astype(weights.dtype)


combine.defvjp(_combine_fwd, _combine_bwd)


def moe_block(x: jax.Array, params: dict, *, top_k: int, norm_topk_prob: bool,
              numerics: Numerics, sharding: sharding_lib.Sharding | None = None,
              replay: jax.Array | None = None, path: str = "ragged", row_tile: int = 32,
              kernel: str = "jnp"):
  """x [T, D] -> (y [T, D], expert ids [T, k]). `path`, `row_tile`, `kernel`: see
  `experts_local`."""
  router = sharding_lib.constrain(sharding, params["router"], ("embed", "router"), gathered=True)
  ids, weights = route(x, router, top_k=top_k, norm_topk_prob=norm_topk_prob,
                       numerics=numerics, replay=replay)
  kernel_on_mesh = kernel != "jnp" and sharding is not None and sharding.mesh.size > 1
  if sharding is not None and (sharding.axis_size("expert") > 1 or kernel_on_mesh):
    y = _experts_sharded(x, ids, params, numerics, sharding, path, row_tile, kernel)
  else:
    gate, up, down = (sharding_lib.constrain(sharding, params[n], axes, gathered=True)
                      for n, axes in (("gate", ("embed", "expert", "mlp")),
                                      ("up", ("embed", "expert", "mlp")),
                                      ("down", ("expert", "mlp", "embed"))))
    path = resolved_path(path, numerics, x.shape[0], gate.shape[1], top_k, row_tile)
    if path == "dense" and not numerics.deterministic:
      return dense_mixture(x, ids, weights, gate, up, down, numerics), ids
    y = experts_local(x, ids, gate, up, down, 0, numerics, path, row_tile, kernel)
  return combine(y, weights), ids


def _token_axes(sharding: sharding_lib.Sharding, num_tokens: int) -> tuple[str, ...]:
  """The mesh axes `_experts_sharded` splits the tokens over: the batch's, and `model`
  where it divides each batch shard's tokens (else every model shard computes them all)."""
  axes = sharding.mesh_axes("batch")
  model = sharding.axis_size("model")
  if model > 1 and (num_tokens // sharding.shards("batch")) % model == 0:
    axes += ("model",)
  return axes


def _experts_sharded(x, ids, params, numerics, sharding, path, row_tile, kernel):
  split = _token_axes(sharding, x.shape[0])
  tokens = jax.sharding.PartitionSpec(split or None, None)
  slots = jax.sharding.PartitionSpec(split or None, None, None)
  w_in = sharding.spec(("embed", "expert", None), gathered=True)
  w_out = sharding.spec(("expert", None, "embed"), gathered=True)

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
                      gate_l, up_l, down_l, me * e_local, numerics, path, row_tile, kernel)
    # y[i] are this device's outputs for device i's tokens; send them home
    y_home = lax.all_to_all(y.reshape(n, t_l, k, -1), "expert", 0, 0)  # [n (source), T_l, k, D]
    owner = ids_l // e_local  # which device computed each slot
    return jnp.take_along_axis(y_home, owner[None, :, :, None], axis=0)[0]

  return run(x, ids, params["gate"], params["up"], params["down"])
