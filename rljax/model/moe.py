"""Dropless mixture-of-experts: routing, expert compute and a fixed-order combine.

No capacity, no drops: a token's output depends only on the token. Expert paths:

* "tiled" (`rljax.model.moe_tiles`): slots sorted by expert into fixed tiles of
  `row_tile` rows, one expert per tile, batched dots over the tiles (expert e's first tile
  is tile e, so those take the weights in place; further tiles gather theirs) with f32
  operands holding the compute dtype's values (bf16 products are exact in f32; the
  engine's "by_tokens" tiles, never differentiated, take the operands in the compute
  dtype): the routed FLOPs plus under one tile per expert (XLA:CPU expands `ragged_dot`
  into masked dense dots over every expert instead). Every tile is
  the same (row_tile x D) @ (D x F) product, with no split-K, so a row's sums depend
  neither on its tile's other rows, nor on how many rows its expert got, nor on the tile
  count: in deterministic mode this is the routed path ("ragged" there means "tiled"),
  batch-invariant bit for bit.
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

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import ragged_dot_tgmm
from rljax import sharding as sharding_lib
from rljax.model import moe_tiles
from rljax.model.config import KERNELS
from rljax.numerics import Numerics


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
  what multiplies the tiles (one of `KERNELS`, see `moe_tiles.tile_matmul`).
  """
  if path not in PATHS:
    raise ValueError(f"unknown expert path {path!r}; expected one of {PATHS}")
  if kernel not in KERNELS:
    raise ValueError(f"unknown expert kernel {kernel!r}; expected one of {KERNELS}")
  t, d = x.shape
  e_local = gate.shape[1]
  local = ids - expert_offset
  is_local = (local >= 0) & (local < e_local)
  engine_cpu = path == "by_tokens"  # an engine forward: exact tile products not needed
  path = resolved_path(path, numerics, t, e_local, ids.shape[1], row_tile)
  if path == "tiled" or (numerics.deterministic and path == "ragged"):
    y = moe_tiles.experts_tiled(x, jnp.where(is_local, local, e_local), gate, up, down,
                                numerics, row_tile, kernel, exact=not engine_cpu)
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
    order = moe_tiles.stable_order(slot_expert, e_local + 1)
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
    hidden = numerics.silu(g).astype(x.dtype) * u
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
  return (numerics.silu(g).astype(x.dtype) * u).reshape(t, e, f)


# The engine's CPU choice between every expert for every token ("dense": `dense_mixture`,
# one device) and only the routed ones in tiles ("tiled", then `combine`; the engine's
# tiles take bf16 operands, `moe_tiles.experts_tiled(exact=False)`): tiled when the dense
# path has more than this many rows per tiled row (`dense_work_ratio`).
# experiments/bench_engine_experts.py (AMD EPYC, 2 cores, bf16; dense over tiled time):
# tiled 1.6-2.6x from ratio 5.3 up (32 and 128 experts), dense 1.7-3.1x below 1.0; from
# 2 to 4 neither on every shape or run (0.73-1.57x over three runs; the rule picked the
# faster in 17 of 20 rows), and a threshold of 2.0 made arith_tiny's whole engine at 256
# slots 0.90-0.95x (its decode steps tiled).
TILED_BEATS_DENSE_AT = 4.0


def tiled_beats_dense(tokens: int, num_experts: int, top_k: int, row_tile: int) -> bool:
  """Whether the tiled path is the faster on CPU for a call of `tokens` tokens."""
  return dense_work_ratio(tokens, num_experts, top_k, row_tile) > TILED_BEATS_DENSE_AT


def dense_work_ratio(tokens: int, num_experts: int, top_k: int, row_tile: int) -> float:
  """The dense path's rows (every expert for every token) over the tiled path's (each
  token's k slots, and at most a row tile of padding per expert)."""
  return tokens * num_experts / (tokens * top_k + num_experts * row_tile)


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
