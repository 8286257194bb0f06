"""Deterministic attention as Pallas kernels (TPU and GPU), with the jnp path's tiling.

`rljax.block_attention._det_attention` (what `attend` runs in deterministic numerics, on
CPU) reduces every query row over fixed key blocks of `page_size` keys, in block order,
each (ROW_TILE = 8 query rows x page) block of scores and of p @ v one dot of a fixed
shape. These kernels run exactly that schedule on a device, one program per (sequence b,
KV head h, query tile i), walking the key blocks j = 0, 1, ... in order:

  s     = (q_tile @ k_j^T) * scale                 one [R, D] x [D, P] dot, f32 accumulation
  s     = where(visible, s, NEG)
  m_new = max(m, max(s over the page))           m starts at NEG (= lax.cummax of block maxima)
  p     = where(visible, det_exp(s - m_new), 0)
  l     = l * det_exp(m - m_new) + tree_sum(p)   (tree_sum: the pairwise tree of `numerics`)
  acc   = acc * det_exp(m - m_new) + p_v @ v_j   p_v: p rounded to v's dtype; one [R, P] x [P, D] dot
  out   = acc / where(l == 0, 1, l)

The rows of a tile are the jnp path's rows: the `qg` rows of one KV head, i.e. (query,
group member) pairs in HF repeat_kv order (row t * G + g is query t, query head h * G + g),
padded to a multiple of the tile (padding rows see no key). A row's result depends only on
its own query, the keys it sees and the fixed dot shapes: not on the batch, the packing,
the page layout, the other rows of its tile or how many blocks past its last visible one
exist (a fully masked block is an exact no-op of the online softmax: m, l and acc pass
through unchanged), which is what makes it batch invariant.

Two entry points over one kernel body:

* `det_attention`: training / prefill over a packed row, `block_attention.attend`'s
  contract (q [B, T, H, D], k, v [B, N, Hkv, D], key n visible to a query when n <= its
  q_index and, given segments, in its segment). The row's blocks are pages of an identity
  page table.
* `det_paged_attention`: decode / prefill over the engine's paged KV (pools [num_pages, P,
  Hkv, D], page_table [B, NB], absolute positions, -1 = padding), `attention.attend_paged`'s
  contract. Same kernel, the sequence's page table.

Each tile reads only the blocks up to the last one any of its rows can see (`tile_last`,
computed from the query indices outside the kernel); blocks past it are skipped (their
pages are never read).

Backends:

* TPU (Mosaic): `pltpu.PrefetchScalarGridSpec` with the flattened page table and
  `tile_last` as scalar-prefetch operands (SMEM). Grid (B, Hkv, tiles, NB), key blocks
  innermost ("arbitrary"), m / l / acc in VMEM scratch. The K and V BlockSpecs index a
  [num_pages, P, Hkv * D] view of the pools (a free reshape) with index map
  (page_table[b, min(j, tile_last)], 0, h): the pipeline DMAs the page's [P, D] slice of
  head h straight from the pool, and for j past tile_last the block index repeats, so no
  copy is issued and `pl.when` skips the compute. ROW_TILE = 8 rows (the jnp tiling).
  Mosaic block rules (checked): D a multiple of 128 (or Hkv = 1), P a multiple of 8.
  SMEM holds the page table (B * NB int32: 64 x 256 = 64 KiB at 64 sequences x 4096
  tokens, page 16).
* GPU (Triton): no scalar prefetch, so page table, tile_last and pools are whole refs
  (`memory_space=pl.ANY`); grid (B, Hkv, tiles), each program a `fori_loop` over its
  tile_last + 1 blocks, loading `page_table[b, j]` and the page's [P, D] slice of head h by
  dynamic ref indexing. `tl.dot` needs every tile dimension >= 16, so the GPU path's row
  tile is GPU_ROW_TILE = 16 rows (the `qg` rows padded to a multiple of 16; a tile holds 16
  real rows where there are, rather than 8 rows and 8 of padding: a row's sums do not
  depend on its tile-mates, and this halves the programs). Still one fixed dot shape, the
  same for every tile, so batch invariance holds, but it is a (16 x D) @ (D x P) dot where
  the jnp path has (8 x D) @ (D x P). Triton constraints (checked): D, P powers of two
  >= 16.

Dot operands (`dot_dtype`): the jnp path feeds its dots f32 operands holding the input's
values (bf16 x bf16 products are exact in f32). Default: float32 in interpret mode (the
jnp path's dots, so interpret mode gives its bits: tested bitwise for both paths; for the
GPU path that rests on XLA:CPU's f32 dot summing a row alike in 16- and 8-row tiles,
measured on this CPU), the
input dtype when compiled (bf16 MXU / tensor-core dots: the same exact products, f32
accumulation, in the device's summation order). f32 operands use `precision=HIGHEST`
(no bf16 / TF32 rounding). On a device the bits are the device's, not the CPU's; they are
the same for a row in every batch, packing and page layout, and the same from both entry
points (one kernel body, one tile shape).

Interpret mode: `interpret=True` runs the TPU path in Pallas' TPU interpret mode (scalar
prefetch and block copies simulated on CPU) and the GPU path in the generic interpreter.

Cost: the tiling is the jnp path's, not a fast one. On TPU every (tile, block) pair is a
grid step with an (8 x D) @ (D x 16) dot: 4096 x 256 steps per KV head for a 4096-token
training row (the causal half skipped in compute, not in grid steps); decode is
B x Hkv x NB steps. No device has run either path yet (lowering only).

Not covered: gradients (use `attend`, whose backward is the dense VJP); a pool stacked
over layers (pass one layer's pool); skipping blocks *before* a segment's start (only the
causal end of a tile is skipped; earlier blocks of other segments are computed as masked
no-ops).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from rljax.block_attention import NEG, as_values
from rljax.numerics import det_exp

ROW_TILE = 8  # the jnp path's query tile (block_attention.ROW_TILE; a test checks they agree)
BACKENDS = ("tpu", "gpu")
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
GPU_ROW_TILE = 16  # tl.dot's smallest tile dimension: the GPU path's rows per tile
GPU_MIN_TILE = 16


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def row_tile(backend: str) -> int:
  """Query rows per program: ROW_TILE (8, the jnp path's) on TPU, 16 on GPU."""
  return ROW_TILE if backend == "tpu" else GPU_ROW_TILE


# ----------------------------------------------------------------------------- kernel body


def _lane_tree_sum(x: jax.Array) -> jax.Array:
  """[R, P] -> [R, 1]: `numerics.tree_sum` over the lanes (P a power of two), the same
  pairwise tree (x[:, :half] + x[:, half:], halving), as equal splits (Mosaic and Triton
  both lower `lax.split`)."""
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    lo, hi = lax.split(x, (half, half), axis=1)
    x = lo + hi
  return x


def _dot(a: jax.Array, b: jax.Array, contract_b: int, dot_dtype) -> jax.Array:
  """a [m, k] with b ([n, k] if contract_b == 1 else [k, n]) -> f32 [m, n], operands as
  dot_dtype; HIGHEST for f32 operands (no bf16 / TF32 rounding on devices)."""
  f32 = jnp.dtype(dot_dtype) == jnp.dtype(jnp.float32)
  return lax.dot_general(a.astype(dot_dtype), b.astype(dot_dtype),
                         (((1,), (contract_b,)), ((), ())),
                         precision=lax.Precision.HIGHEST if f32 else None,
                         preferred_element_type=jnp.float32)


def _block_step(carry, q, k, v, visible, *, scale: float, dot_dtype):
  """One key block of the online softmax, in `_det_attention`'s op order.

  carry (m [R, 1], l [R, 1], acc [R, D]) f32; q [R, D]; k, v [P, D]; visible [R, P] bool.
  """
  m, l, acc = carry
  s = _dot(q, k, 1, dot_dtype)  # [R, P]
  s = jnp.where(visible, s * scale, NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))  # the cummax of block maxima
  p = jnp.where(visible, det_exp(s - m_new), 0.0)
  block_sum = _lane_tree_sum(p)
  p_v = p.astype(v.dtype)  # p rounded to v's dtype, as the jnp path's p @ v sees it
  pv = _dot(p_v, v, 0, dot_dtype)  # [R, D]
  alpha = det_exp(m - m_new)  # exactly 1 where the block changes nothing
  return m_new, l * alpha + block_sum, acc * alpha + pv


def _visible(j, page_size, row_index, row_seg, kv_seg):
  """[R, P]: key j * P + lane <= the row's query index (and in its segment).
  row_index, row_seg [R, 1]; kv_seg [1, P] or None."""
  lane = lax.broadcasted_iota(jnp.int32, (row_index.shape[0], page_size), 1)
  vis = j * page_size + lane <= row_index
  if kv_seg is not None:
    vis &= kv_seg == row_seg
  return vis


def _finish(l, acc):
  return acc / jnp.where(l == 0.0, 1.0, l)


# ------------------------------------------------------------------------------------ TPU


def _tpu_kernel(page_table_ref, tile_last_ref, q_ref, k_ref, v_ref, ri_ref, *rest,
                scale: float, dot_dtype, segments: bool):
  """One (b, h, i, j) grid step. q_ref, o_ref [R, D]; k_ref, v_ref [P, D] (page of head h);
  ri_ref (and rs_ref) [R, 1]; ks_ref [1, P]; scratch m, l [R, 1], acc [R, D]."""
  del page_table_ref  # read by the index maps only
  if segments:
    rs_ref, ks_ref, o_ref, m_sc, l_sc, acc_sc = rest
  else:
    o_ref, m_sc, l_sc, acc_sc = rest
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  last = tile_last_ref[b * pl.num_programs(2) + i]

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(j <= last)
  def _():
    page_size = k_ref.shape[0]
    vis = _visible(j, page_size, ri_ref[...], rs_ref[...] if segments else None,
                   ks_ref[...] if segments else None)
    m, l, acc = _block_step((m_sc[...], l_sc[...], acc_sc[...]), q_ref[...], k_ref[...],
                            v_ref[...], vis, scale=scale, dot_dtype=dot_dtype)
    m_sc[...] = m
    l_sc[...] = l
    acc_sc[...] = acc

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    o_ref[...] = _finish(l_sc[...], acc_sc[...]).astype(o_ref.dtype)


def _tpu_call(qg, k_pool, v_pool, page_table, row_index, row_seg, kv_seg, tile_last, *,
              scale, dot_dtype, interpret):
  b, hkv, mp, d = qg.shape
  num_pages, page_size = k_pool.shape[:2]
  nb = page_table.shape[1]
  r = ROW_TILE
  nt = mp // r
  segments = row_seg is not None
  # [num_pages, P, Hkv * D]: a block (P, D) at lane block h is head h of one page
  k3, v3 = (x.reshape(num_pages, page_size, hkv * d) for x in (k_pool, v_pool))

  def block(bi, i, j, tl):  # the key block step j reads: j, held at tile_last past it
    return jnp.maximum(jnp.minimum(j, tl[bi * nt + i]), 0)

  def kv_map(bi, h, i, j, pt, tl):
    return pt[bi * nb + block(bi, i, j, tl)], 0, h

  rows = pl.BlockSpec((None, r, 1), lambda bi, h, i, j, pt, tl: (bi, i, 0))
  in_specs = [pl.BlockSpec((None, None, r, d), lambda bi, h, i, j, pt, tl: (bi, h, i, 0)),
              pl.BlockSpec((None, page_size, d), kv_map),
              pl.BlockSpec((None, page_size, d), kv_map),
              rows]
  args = [qg, k3, v3, row_index[..., None]]
  if segments:
    in_specs += [rows, pl.BlockSpec((None, None, 1, page_size),
                                    lambda bi, h, i, j, pt, tl: (bi, block(bi, i, j, tl), 0, 0))]
    args += [row_seg[..., None], kv_seg.reshape(b, nb, 1, page_size)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, hkv, nt, nb),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, r, d), lambda bi, h, i, j, pt, tl: (bi, h, i, 0)),
      scratch_shapes=[pltpu.VMEM((r, 1), jnp.float32), pltpu.VMEM((r, 1), jnp.float32),
                      pltpu.VMEM((r, d), jnp.float32)],
  )
  return pl.pallas_call(
      functools.partial(_tpu_kernel, scale=scale, dot_dtype=dot_dtype, segments=segments),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, hkv, mp, d), qg.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="det_attention_tpu",
      cost_estimate=_cost(b, hkv, nt, nb, r, page_size, d, qg.dtype.itemsize,
                          k_pool.dtype.itemsize),
  )(page_table.reshape(-1), tile_last.reshape(-1), *args)


def _cost(b, hkv, nt, nb, r, page_size, d, q_bytes, kv_bytes) -> pl.CostEstimate:
  """What the compiler's cost model (and `rljax.hlo_flops`) is told: at most, every tile
  over every key block (tiles skip the blocks past their last visible one, which a static
  count cannot know): two (r x D) x (D x P) dots and r x P exponentials a block, the
  block's keys and values read for each tile, the queries read and the output written."""
  blocks = b * hkv * nt * nb
  return pl.CostEstimate(
      flops=4 * blocks * r * page_size * d, transcendentals=blocks * r * page_size,
      bytes_accessed=2 * blocks * page_size * d * kv_bytes + 2 * b * hkv * nt * r * d * q_bytes)


# ------------------------------------------------------------------------------------ GPU


def _gpu_kernel(page_table_ref, tile_last_ref, q_ref, k_ref, v_ref, ri_ref, *rest,
                scale: float, dot_dtype, segments: bool):
  """One (b, h, i) program. q_ref, o_ref [R, D] and ri_ref (rs_ref) [R] blocked; page
  table [B, NB], tile_last [B, tiles], pools [num_pages, P, Hkv, D], kv segments [B, N]
  whole refs."""
  if segments:
    rs_ref, ks_ref, o_ref = rest
  else:
    (o_ref,) = rest
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, d = q_ref.shape
  page_size = k_ref.shape[1]
  q = q_ref[...]
  row_index = ri_ref[...][:, None]
  row_seg = rs_ref[...][:, None] if segments else None

  def body(j, carry):
    page = page_table_ref[b, j]
    kv_seg = ks_ref[b, pl.ds(j * page_size, page_size)][None, :] if segments else None
    vis = _visible(j, page_size, row_index, row_seg, kv_seg)
    return _block_step(carry, q, k_ref[page, :, h, :], v_ref[page, :, h, :], vis,
                       scale=scale, dot_dtype=dot_dtype)

  init = (jnp.full((rows, 1), NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))
  _, l, acc = lax.fori_loop(0, tile_last_ref[b, i] + 1, body, init)
  o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def _gpu_call(qg, k_pool, v_pool, page_table, row_index, row_seg, kv_seg, tile_last, *,
              scale, dot_dtype, interpret, num_warps, num_stages):
  b, hkv, mp, d = qg.shape
  r = GPU_ROW_TILE
  segments = row_seg is not None
  whole = pl.BlockSpec(memory_space=pl.ANY)
  rows = pl.BlockSpec((None, r), lambda bi, h, i: (bi, i))
  in_specs = [whole, whole, pl.BlockSpec((None, None, r, d), lambda bi, h, i: (bi, h, i, 0)),
              whole, whole, rows]
  args = [page_table, tile_last, qg, k_pool, v_pool, row_index]
  if segments:
    in_specs += [rows, whole]
    args += [row_seg, kv_seg]
  compiler_params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                                num_stages=num_stages)
  return pl.pallas_call(
      functools.partial(_gpu_kernel, scale=scale, dot_dtype=dot_dtype, segments=segments),
      grid=(b, hkv, mp // r),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, r, d), lambda bi, h, i: (bi, h, i, 0)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, mp, d), qg.dtype),
      interpret=interpret,
      compiler_params=compiler_params,
      name="det_attention_gpu",
  )(*args)


# ------------------------------------------------------------------------------ wrappers


def _check_common(q, k, v, backend, page_size, what):
  """Shapes / dtypes / block rules shared by both entry points -> (B, T, H, D, Hkv)."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}")
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must both be {what}")
  b, t, h, d = q.shape
  hkv = k.shape[2]
  if k.shape[3] != d:
    raise ValueError(f"q {q.shape} and k {k.shape} disagree on head_dim ({d} vs {k.shape[3]})")
  if h % hkv:
    raise ValueError(f"query heads {h} are not a multiple of kv heads {hkv}")
  for name, a in (("q", q), ("k", k), ("v", v)):
    if jnp.dtype(a.dtype) not in DTYPES:
      raise ValueError(f"{name} dtype must be bfloat16 or float32, got {a.dtype}")
  if k.dtype != v.dtype:
    raise ValueError(f"k and v dtypes differ: {k.dtype} vs {v.dtype}")
  if min(b, t, h, d) == 0:
    raise ValueError(f"empty operand: q {q.shape}")
  if not _is_pow2(page_size):
    raise ValueError(f"page_size={page_size} must be a power of two (the lane tree sum)")
  if backend == "tpu":
    error = tpu_block_error(page_size, d, hkv)
    if error:
      raise ValueError(error)
  else:
    for name, x in (("page_size", page_size), ("head_dim D", d)):
      if x < GPU_MIN_TILE or not _is_pow2(x):
        raise ValueError(f"gpu: {name}={x} must be a power of two >= {GPU_MIN_TILE} "
                         "(Triton tl.dot tiles)")
  return b, t, h, d, hkv


def tpu_block_error(page_size: int, head_dim: int, kv_heads: int) -> str | None:
  """Why Mosaic refuses the TPU kernel's blocks at these shapes, or None."""
  if page_size % 8:
    return f"tpu: page_size={page_size} must be a multiple of 8 (Mosaic block rule)"
  if head_dim % 128 and kv_heads != 1:
    return (f"tpu: head_dim D={head_dim} must be a multiple of 128 (Mosaic block rule: "
            "a head's [P, D] lane block of the [P, Hkv * D] page)")
  return None


def _check_index(name, x, shape):
  if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer {list(shape)}, got {x.dtype} {x.shape}")


def _resolve_dot_dtype(dot_dtype, dtype, interpret):
  if dot_dtype is None:
    return jnp.dtype(jnp.float32) if interpret else jnp.dtype(dtype)
  if jnp.dtype(dot_dtype) not in DTYPES:
    raise ValueError(f"dot_dtype must be bfloat16 or float32, got {dot_dtype}")
  return jnp.dtype(dot_dtype)


def _run(q, k_pool, v_pool, page_table, q_index, q_segments, kv_segments, *, scale, backend,
         interpret, dot_dtype, num_warps, num_stages):
  """Rows and tiles, then the kernel. q [B, T, H, D]; pools [num_pages, P, Hkv, D];
  page_table [B, NB]; q_index [B, T]; segments [B, T] / [B, NB * P] or None."""
  b, t, h, d = q.shape
  hkv, page_size = k_pool.shape[2], k_pool.shape[1]
  nb = page_table.shape[1]
  g = h // hkv
  r = row_tile(backend)
  m = t * g
  mp = -(-m // r) * r
  # rows of a KV head: (query, group member), HF repeat_kv order (as `attend`)
  qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, m, d)
  row_index = jnp.repeat(q_index.astype(jnp.int32), g, axis=1)  # [B, M]
  row_seg = None if q_segments is None else jnp.repeat(q_segments.astype(jnp.int32), g, axis=1)
  if mp != m:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
    row_index = jnp.pad(row_index, ((0, 0), (0, mp - m)), constant_values=-1)
    if row_seg is not None:
      row_seg = jnp.pad(row_seg, ((0, 0), (0, mp - m)))
  # the last block any row of a tile sees (-1: none); blocks past it are skipped. The max
  # over a tile's rows is taken elementwise over its r strided slices, not as a reduce:
  # libtpu 0.0.42 aborts splitting that reduce (a constant iota in training) across a v5p's
  # two cores ("Check failed: new_window.base_bounds[...] (2 vs. 16)", fixed in 0.0.51).
  tile_max = functools.reduce(jnp.maximum, [row_index[:, k::r] for k in range(r)])
  tile_last = jnp.minimum(tile_max // page_size, nb - 1)
  page_table = jnp.clip(page_table.astype(jnp.int32), 0, k_pool.shape[0] - 1)
  kv_seg = None if kv_segments is None else kv_segments.astype(jnp.int32)
  dot_dtype = _resolve_dot_dtype(dot_dtype, q.dtype, interpret)
  if backend == "tpu":
    out = _tpu_call(qg, k_pool, v_pool, page_table, row_index, row_seg, kv_seg, tile_last,
                    scale=scale, dot_dtype=dot_dtype, interpret=interpret)
  else:
    out = _gpu_call(qg, k_pool, v_pool, page_table, row_index, row_seg, kv_seg, tile_last,
                    scale=scale, dot_dtype=dot_dtype, interpret=interpret,
                    num_warps=num_warps, num_stages=num_stages)
  return out[:, :, :m].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


_STATIC = ("page_size", "scale", "backend", "interpret", "dot_dtype", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def det_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_index: jax.Array, *,
                  page_size: int, scale: float, backend: str,
                  q_segments: jax.Array | None = None, kv_segments: jax.Array | None = None,
                  interpret: bool = False, dot_dtype=None, num_warps: int = 4,
                  num_stages: int = 2) -> jax.Array:
  """Deterministic causal GQA attention over a packed row (Pallas): `attend`'s contract.

  q: [B, T, H, D]; k, v: [B, N, Hkv, D] with N a multiple of `page_size`; q_index: [B, T]
  int, the index of each query in its row (its position; -1 sees nothing); key n is
  visible when n <= q_index and, given q_segments [B, T] / kv_segments [B, N], in the same
  segment. Returns [B, T, H, D] in q's dtype. backend: "tpu" (Mosaic) or "gpu" (Triton);
  dot_dtype: the dots' operand dtype (default: f32 in interpret mode, the input dtype
  compiled; module docstring). num_warps / num_stages: Triton launch parameters.
  """
  b, t, _, d, hkv = _check_common(q, k, v, backend, page_size, "[B, N, Hkv, D]")
  n = k.shape[1]
  if k.shape[0] != b:
    raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch")
  if n == 0 or n % page_size:
    raise ValueError(f"key count {n} is not a positive multiple of page_size {page_size}")
  _check_index("q_index", q_index, (b, t))
  if (q_segments is None) != (kv_segments is None):
    raise ValueError("pass both q_segments and kv_segments, or neither")
  if q_segments is not None:
    _check_index("q_segments", q_segments, (b, t))
    _check_index("kv_segments", kv_segments, (b, n))
  nb = n // page_size
  # the row's blocks as pages of an identity page table
  k_pool, v_pool = (x.reshape(b * nb, page_size, hkv, d) for x in (k, v))
  page_table = jnp.arange(b * nb, dtype=jnp.int32).reshape(b, nb)
  return _run(q, k_pool, v_pool, page_table, q_index, q_segments, kv_segments, scale=scale,
              backend=backend, interpret=interpret, dot_dtype=dot_dtype,
              num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=_STATIC[1:] + ("dtype",))
def det_paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                        page_table: jax.Array, positions: jax.Array, *, scale: float,
                        backend: str, dtype=None, interpret: bool = False, dot_dtype=None,
                        num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """Deterministic attention of queries over their paged KV (Pallas): `attend_paged`'s
  contract, one layer.

  q: [B, T, H, D]; k_pool, v_pool: [num_pages, P, Hkv, D] values, or their raw bits (an
  unsigned integer pool, as the engine keeps it: pass `dtype`); page_table: [B, NB] int
  (block j of row b, positions [j * P, (j + 1) * P), is page page_table[b, j]; entries are
  clipped to the pool); positions: [B, T] int absolute positions (-1 = padding: sees
  nothing). A query sees the keys at positions <= its own. Each tile reads only the pages
  of blocks 0 .. max(position of its rows) // P. Returns [B, T, H, D] in q's dtype.
  Other arguments: `det_attention`.
  """
  if k_pool.ndim == 4 and k_pool.dtype == v_pool.dtype and jnp.issubdtype(
      k_pool.dtype, jnp.unsignedinteger):
    if dtype is None:
      raise ValueError(f"pools of raw bits ({k_pool.dtype}) need `dtype`")
    k_pool, v_pool = as_values(k_pool, dtype), as_values(v_pool, dtype)
  page_size = k_pool.shape[1] if k_pool.ndim == 4 else 0
  b, t, _, _, _ = _check_common(q, k_pool, v_pool, backend, page_size,
                                "[num_pages, P, Hkv, D]")
  if page_table.ndim != 2 or page_table.shape[0] != b or page_table.shape[1] == 0 \
      or not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise ValueError(f"page_table must be integer [B, NB] = [{b}, NB >= 1], got "
                     f"{page_table.dtype} {page_table.shape}")
  _check_index("positions", positions, (b, t))
  return _run(q, k_pool, v_pool, page_table, positions, None, None, scale=scale,
              backend=backend, interpret=interpret, dot_dtype=dot_dtype,
              num_warps=num_warps, num_stages=num_stages)
