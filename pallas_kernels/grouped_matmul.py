"""Grouped matmul for the routed-only MoE: a Pallas kernel (TPU and GPU) and its jnp reference.

The routed-only experts (`rljax.model.moe_tiles.tile_plan`) sort a layer's slots by expert into
N tiles of r rows, each tile belonging to one expert (a tile's rows past its expert's
count are padding), and multiply every tile by its expert's weights:

  out[n] = xs[n] @ w[tile_expert[n]]        xs [N, r, D], w [E, D, F] -> out [N, r, F] f32

`grouped_matmul_reference` is that product in jnp as the routed-only path
(`moe_tiles.experts_tiled`) writes it: operands as f32 holding the input dtype's values (bf16
products are exact in f32), f32 accumulation, one (r x D) @ (D x F) dot per tile, no
split-K.

Kernel design (`grouped_matmul`): one program per (F block, tile); each computes
xs[n] @ w[e][:, F block] with the whole K (= D) in one dot with f32 accumulation, alone,
so a row's result depends only on its own values and its expert's weights: not on how
many rows its expert got, on the other tiles in the call, or on their order (batch
invariance; the tests check it bitwise). Operands enter the dot in xs's dtype (the MXU /
tensor cores take bf16; a weight of another dtype is cast to it inside the kernel, as the
reference casts it), with `precision=HIGHEST` for f32 operands so they are not rounded to
bf16 (TPU) or TF32 (GPU).

* TPU (Mosaic): `pltpu.PrefetchScalarGridSpec` with `tile_expert` as the scalar-prefetch
  operand (SMEM); the weight BlockSpec's index_map reads it, so the pipeline DMAs the
  [D, block_f] block of w[tile_expert[n]] straight from the stacked weights (no per-tile
  weight copy in HBM). Grid (F // block_f, N), tiles innermost: consecutive tiles of one
  expert (tile_plan sorts them) ask for the same weight block index, and the pipeline
  skips a block's copy when its index does not change, so each expert's weight block is
  read once per F block whatever block_f (with the tiles outermost, that would hold only
  for block_f = F). Default block_f: F when the double-buffered [D, F] weight block fits
  `TPU_WEIGHT_VMEM_BYTES` (8 MiB: Qwen3-30B-A3B's 2048 x 768 bf16 is 2 x 3 MiB), else the
  widest multiple of 128 dividing F that fits. Mosaic block rules (checked): r a multiple
  of 8 (16 fills bf16's packed (16, 128) tiles), block_f a multiple of 128 or F.
* GPU (Triton): Triton has no scalar prefetch, so `tile_expert` and w are whole refs
  (`memory_space=pl.ANY`): the program loads its tile's expert id as a scalar and the
  [D, block_f] slice of w[e] by dynamic ref indexing (a strided pointer load). Grid
  (N, F // block_f). `tl.dot` needs every tile dimension >= 16 and Triton tensors have
  power-of-two sizes: r, D (or block_k) and block_f must be powers of two >= 16 (checked).
  Default block_f: the largest power of two <= 128 dividing F.
  Shared memory: the whole-K default holds an [r, D] and a [D, block_f] tile at once; at
  r = 32, D = 2048 in bf16 that is 128 KiB + 256 KiB (block_f = 64) or + 512 KiB (the
  default 128), over an H100 / H200 block's 227 KiB, so at Qwen3 widths expect Triton to
  refuse it (not run on a GPU here: the tests check only that the Triton IR is produced).
  `block_k` (GPU only) is the way out: a fixed in-program loop over K in blocks of
  block_k, accumulated in f32 in K order. A row's sum order then depends only on
  (D, block_k), still not on the batch, but it is no longer the reference's single dot.

Interpret mode: `interpret=True` runs the TPU path in Pallas' TPU interpret mode (scalar
prefetch and block copies simulated on CPU) and the GPU path in the generic interpreter;
`pltpu.force_tpu_interpret_mode()` does the same for the TPU path. There each block dot is
an XLA:CPU dot: f32 gives the reference's bits; bf16 gives the bits of a per-tile bf16
dot (`Numerics.matmul`, the deterministic routed-only path's), not the f32 reference's
(XLA:CPU sums bf16 and f32 GEMMs in different orders; the tests bound the difference).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

BACKENDS = ("tpu", "gpu")
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
GPU_MIN_TILE = 16  # tl.dot's smallest tile dimension
GPU_MAX_BLOCK_F = 128
TPU_WEIGHT_VMEM_BYTES = 8 << 20  # two [D, block_f] weight buffers (double buffering)


def grouped_matmul_reference(xs: jax.Array, w: jax.Array, tile_expert: jax.Array) -> jax.Array:
  """xs [N, r, D], w [E, D, F], tile_expert [N] int -> f32 [N, r, F]: out[n] = xs[n] @ w[e_n].

  w is rounded to xs's dtype first; products and sums in f32 (one batched einsum).
  """
  w_in = w.astype(xs.dtype).astype(jnp.float32)[tile_expert]
  return jnp.einsum("nrd,ndf->nrf", xs.astype(jnp.float32), w_in)


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _default_block_f(d: int, f: int, itemsize: int, backend: str) -> int:
  if backend == "tpu":  # the widest block whose double-buffered weights fit the budget
    fits = lambda b: 2 * d * b * itemsize <= TPU_WEIGHT_VMEM_BYTES  # noqa: E731
    if fits(f) or f % 128:
      return f
    b = max(128, (TPU_WEIGHT_VMEM_BYTES // (2 * d * itemsize)) // 128 * 128)
    while f % b:
      b -= 128
    return b
  b = GPU_MAX_BLOCK_F
  while b > 1 and f % b:
    b //= 2
  return b


def _check(xs, w, tile_expert, backend, block_f, block_k):
  """Shapes, dtypes and block sizes -> (N, r, D, F, block_f, block_k); ValueError if bad."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if xs.ndim != 3:
    raise ValueError(f"xs must be [N, r, D], got shape {xs.shape}")
  if w.ndim != 3:
    raise ValueError(f"w must be [E, D, F], got shape {w.shape}")
  n, r, d = xs.shape
  e, dw, f = w.shape
  if dw != d:
    raise ValueError(f"xs {xs.shape} and w {w.shape} disagree on D ({d} vs {dw})")
  if tile_expert.shape != (n,) or not jnp.issubdtype(tile_expert.dtype, jnp.integer):
    raise ValueError(f"tile_expert must be integer [N] = [{n}], got {tile_expert.dtype} "
                     f"{tile_expert.shape}")
  for name, a in (("xs", xs), ("w", w)):
    if jnp.dtype(a.dtype) not in DTYPES:
      raise ValueError(f"{name} dtype must be bfloat16 or float32, got {a.dtype}")
  if min(n, r, d, e, f) == 0:
    raise ValueError(f"empty operand: xs {xs.shape}, w {w.shape}")
  if block_f is None:
    block_f = _default_block_f(d, f, jnp.dtype(w.dtype).itemsize, backend)
  if block_f <= 0 or f % block_f:
    raise ValueError(f"block_f={block_f} must divide F={f}")
  if block_k is not None and backend != "gpu":
    raise ValueError("block_k is for the gpu backend only (the TPU path takes the whole K)")
  block_k = d if block_k is None else block_k
  if block_k <= 0 or d % block_k:
    raise ValueError(f"block_k={block_k} must divide D={d}")
  if backend == "tpu":
    if r % 8:
      raise ValueError(f"tpu: the row tile r={r} must be a multiple of 8 (Mosaic block rule)")
    if block_f != f and block_f % 128:
      raise ValueError(f"tpu: block_f={block_f} must be a multiple of 128 or F={f}")
  else:
    for name, v in (("row tile r", r), ("block_f", block_f), ("block_k (default D)", block_k)):
      if v < GPU_MIN_TILE or not _is_pow2(v):
        raise ValueError(f"gpu: {name}={v} must be a power of two >= {GPU_MIN_TILE} "
                         "(Triton tl.dot tiles)")
  return n, r, d, f, block_f, block_k


def _dot(x, w):
  """x [m, k] @ w [k, n] -> f32, operands in x's dtype. HIGHEST only for f32 operands (bf16
  operands are exact on the MXU / tensor cores at the default precision)."""
  f32 = jnp.dtype(x.dtype) == jnp.dtype(jnp.float32)
  return lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())),
                         precision=lax.Precision.HIGHEST if f32 else None,
                         preferred_element_type=jnp.float32)


def _tpu_kernel(tile_expert_ref, x_ref, w_ref, o_ref):
  """One (F block, tile) program. x_ref [r, D], w_ref [D, block_f] (its expert's), o_ref
  [r, block_f]; tile_expert_ref (SMEM) is only read by the index maps."""
  del tile_expert_ref
  o_ref[...] = _dot(x_ref[...], w_ref[...])


def _tpu_call(xs, w, tile_expert, block_f, interpret):
  n, r, d = xs.shape
  f = w.shape[2]
  grid = (f // block_f, n)  # tiles innermost: a run of one expert's tiles keeps its block
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=grid,
      in_specs=[pl.BlockSpec((None, r, d), lambda j, i, te: (i, 0, 0)),
                pl.BlockSpec((None, d, block_f), lambda j, i, te: (te[i], 0, j))],
      out_specs=pl.BlockSpec((None, r, block_f), lambda j, i, te: (i, 0, j)),
  )
  return pl.pallas_call(
      _tpu_kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((n, r, f), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="grouped_matmul_tpu",
      # for the compiler's cost model (and rljax.hlo_flops): every tile's dot; an expert's
      # weights read once per F block (its tiles run together), the tiles and outputs once
      cost_estimate=pl.CostEstimate(
          flops=2 * n * r * d * f, transcendentals=0,
          bytes_accessed=xs.size * xs.dtype.itemsize + w.size * w.dtype.itemsize + n * r * f * 4),
  )(tile_expert, xs, w)


def _gpu_kernel(tile_expert_ref, x_ref, w_ref, o_ref, *, block_f: int, block_k: int):
  """One (tile, F block) program. x_ref [r, D] and o_ref [r, block_f] blocked;
  tile_expert_ref [N] and w_ref [E, D, F] whole refs."""
  e = tile_expert_ref[pl.program_id(0)]
  cols = pl.ds(pl.multiple_of(pl.program_id(1) * block_f, block_f), block_f)
  d = x_ref.shape[1]
  if block_k == d:
    o_ref[...] = _dot(x_ref[...], w_ref[e, :, cols])
    return

  def step(k, acc):
    ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
    return acc + _dot(x_ref[:, ks], w_ref[e, ks, cols])

  o_ref[...] = lax.fori_loop(0, d // block_k, step, jnp.zeros(o_ref.shape, jnp.float32))


def _gpu_call(xs, w, tile_expert, block_f, block_k, interpret, num_warps, num_stages):
  n, r, d = xs.shape
  f = w.shape[2]
  whole = pl.BlockSpec(memory_space=pl.ANY)
  compiler_params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                                num_stages=num_stages)
  return pl.pallas_call(
      functools.partial(_gpu_kernel, block_f=block_f, block_k=block_k),
      grid=(n, f // block_f),
      in_specs=[whole, pl.BlockSpec((None, r, d), lambda i, j: (i, 0, 0)), whole],
      out_specs=pl.BlockSpec((None, r, block_f), lambda i, j: (i, 0, j)),
      out_shape=jax.ShapeDtypeStruct((n, r, f), jnp.float32),
      interpret=interpret,
      compiler_params=compiler_params,
      name="grouped_matmul_gpu",
  )(tile_expert, xs, w)


@functools.partial(jax.jit, static_argnames=("backend", "interpret", "block_f", "block_k",
                                             "num_warps", "num_stages"))
def grouped_matmul(xs: jax.Array, w: jax.Array, tile_expert: jax.Array, *, backend: str,
                   interpret: bool = False, block_f: int | None = None,
                   block_k: int | None = None, num_warps: int = 4,
                   num_stages: int = 2) -> jax.Array:
  """xs [N, r, D], w [E, D, F], tile_expert [N] int in [0, E) -> f32 [N, r, F] (Pallas).

  out[n] = xs[n] @ w[tile_expert[n]] with f32 accumulation over the whole D (see the
  module docstring). backend: "tpu" (Mosaic) or "gpu" (Triton). block_f: output columns
  per program (default: F on TPU, the largest power of two <= 128 dividing F on GPU).
  block_k (GPU only): K loop block, default the whole D. num_warps / num_stages: Triton
  launch parameters. tile_expert is data, so its range cannot raise: it is clipped to
  [0, E) (as tile_plan's is), so a bad id reads a real expert, never memory past w.
  """
  _, _, _, _, block_f, block_k = _check(xs, w, tile_expert, backend, block_f, block_k)
  tile_expert = jnp.clip(tile_expert.astype(jnp.int32), 0, w.shape[0] - 1)
  if backend == "tpu":
    return _tpu_call(xs, w, tile_expert, block_f, interpret)
  return _gpu_call(xs, w, tile_expert, block_f, block_k, interpret, num_warps, num_stages)


def _megablox_tile(size: int, preferred: int = 128) -> int:
  """A megablox block edge for a dimension: `preferred` where it divides, else the whole."""
  return preferred if size % preferred == 0 else size


def expert_weight_grads(xs: jax.Array, dy: jax.Array, tile_expert: jax.Array,
                        num_experts: int, *, interpret: bool = False) -> jax.Array:
  """xs [N, r, D], dy [N, r, F] -> f32 [E, D, F]: per expert, the sum over its tiles' rows of
  xs_row^T dy_row, the weight gradient of `grouped_matmul` (TPU: Mosaic).

  Tiles in expert order (`tile_plan` without `first_tiles_in_place`: an expert's tiles
  together, the unused last ones its last expert's, their rows zero). The tiles' rows are
  the groups of megablox's `tgmm` (the grouped transposed matmul shipped with JAX): an
  expert's gradient accumulates in VMEM over its rows, blocks of 128 rows in a fixed order,
  so the program is deterministic and holds no per-tile [N, D, F] product (the batched jnp
  form's f32 [N, D, F] was 48 GiB a v5p chip in Qwen3-30B-A3B's step). The sum order is not
  the jnp form's (tile by tile), so the bits differ from it by f32 rounding.
  """
  n, r, d = xs.shape
  f = dy.shape[-1]
  if dy.shape[:2] != (n, r) or tile_expert.shape != (n,):
    raise ValueError(f"xs {xs.shape}, dy {dy.shape}, tile_expert {tile_expert.shape}: "
                     "want [N, r, D], [N, r, F], [N]")
  group_sizes = (jnp.bincount(tile_expert, length=num_experts) * r).astype(jnp.int32)
  return rows_weight_grads(xs.reshape(n * r, d), dy.reshape(n * r, f), group_sizes,
                           interpret=interpret)


def rows_weight_grads(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
                      interpret: bool = False) -> jax.Array:
  """x [M, D], dy [M, F] rows grouped by expert (group_sizes [E]: the first rows are
  expert 0's, ...; rows past their sum belong to none) -> f32 [E, D, F]: per expert, the sum
  of x_row^T dy_row over its rows, by megablox's `tgmm` (blocks of 128 rows, fixed order)."""
  m, d = x.shape
  tiling = (_megablox_tile(m), _megablox_tile(d), _megablox_tile(dy.shape[1]))
  return tgmm(x.T, dy, group_sizes, preferred_element_type=jnp.float32, tiling=tiling,
              interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_dot_tgmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                    interpret: bool = False) -> jax.Array:
  """`lax.ragged_dot(x, w, group_sizes)` in f32 (x [M, D] rows grouped by expert, w [E, D, F])
  whose weight gradient is `rows_weight_grads` (megablox tgmm) and input gradient a
  ragged_dot by the transposed weights. XLA's own transpose of ragged_dot on TPU is a dense
  masked convolution over every row for every expert (81% of Qwen3-30B-A3B's fast GRPO
  step's FLOPs, read in its optimized HLO). The cotangent enters both dots in x's dtype."""
  del interpret
  return lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)


def _ragged_dot_tgmm_fwd(x, w, group_sizes, interpret):
  return ragged_dot_tgmm(x, w, group_sizes, interpret), (x, w, group_sizes)


def _ragged_dot_tgmm_bwd(interpret, residuals, g):
  x, w, group_sizes = residuals
  g = g.astype(x.dtype)
  dx = lax.ragged_dot(g, w.transpose(0, 2, 1), group_sizes,
                      preferred_element_type=jnp.float32).astype(x.dtype)
  dw = rows_weight_grads(x, g, group_sizes, interpret=interpret).astype(w.dtype)
  return dx, dw, None


ragged_dot_tgmm.defvjp(_ragged_dot_tgmm_fwd, _ragged_dot_tgmm_bwd)
