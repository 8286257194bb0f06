"""The routed-only MoE grouped-matmul Pallas kernel, in interpret mode on small grids.

Both paths of `grouped_matmul`: TPU (Mosaic, scalar-prefetched `tile_expert`) under
`pltpu.force_tpu_interpret_mode()`, GPU (Triton) in the generic interpreter. Case: r = 16
rows a tile, D = 64, E = 4 experts, F = 256, tiles sorted by expert (as tile_plan makes
them), bf16 and f32, standard-normal values.

What interpret mode computes: each program's block dot is an XLA:CPU dot of shape
(r x D) @ (D x block_f), operands in the input dtype, f32 accumulation.

* f32: bitwise equal to `grouped_matmul_reference` (the batched f32 einsum the MoE runs on
  CPU), for block_f = F and block_f < F alike (measured).
* bf16: NOT bitwise equal to the reference. The kernel dots bf16 operands, which XLA:CPU
  hands to its YNNPACK bf16 fusion; the reference dots the same values as f32, another
  GEMM with another summation order. The kernel is bitwise equal to a per-tile jnp bf16
  dot (the same arithmetic; also `Numerics("deterministic").matmul`, the deterministic
  routed-only path's dot, in both dtypes), and within the summation bound of the
  reference:
  |kernel - ref| <= 2 * D * 2^-24 * (|xs| @ |w|) elementwise (the products of bf16 values
  are exact in f32, so each of the two results is a sum of the same D exact terms with at
  most D - 1 roundings of relative size 2^-24: each is within (D - 1) 2^-24 sum|terms| of
  the exact sum). Measured: max |diff| 3.8e-6, 0.014 of that bound.
* GPU path with block_k < D (a fixed K loop): a different summation order, held to the
  same bound (measured 0.02 (bf16) and 0.03 (f32) of it); still batch invariant.

Oracle nobody here wrote: JAX's megablox `gmm` (TPU kernel) runs in TPU interpret mode
on CPU. Fed the real rows sorted by expert (no padding between experts: its tiles cross
expert boundaries and it masks them) with group_sizes = rows per expert and tiling
(tm, tk, tn) = (r, D, F), i.e. no K split, it gives the kernel's bits exactly (both
dtypes). With tk = D / 4 (its split-K: K steps accumulated in a VMEM scratch) it is
held to the bound above (measured: both dtypes differ, 0.02-0.04 of the bound; with
tk = D / 2, bf16 happens to match bitwise and f32 does not).

Batch invariance, measured bitwise: a tile's output is the same bits with N = 1, 5 or 40
tiles in the call, with the tiles permuted, and (in interpret mode) whatever row of its
tile a row sits at.

Lowering at Qwen3-30B-A3B shapes (D = 2048, F = 768, E = 128, r = 32, N = 4096 * 8 / 32
+ 128 = 1152, bf16): the Mosaic lowering runs on this CPU-only jaxlib (a `tpu_custom_call`
whose serialized Mosaic body is decoded and checked: grid, scalar prefetch, the weight
block's index map reading tile_expert from SMEM), and libtpu's compiler (Mosaic) compiles
it for one v5p chip from this CPU (tests/mosaic.py); the Triton lowering produces the
`__gpu$xla.gpu.triton` call (not compiled). Neither is run on a device here.
"""

import functools
import re

import chex
import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (_default_block_f, expert_weight_grads, grouped_matmul,
                                          grouped_matmul_reference)
from tests.mosaic import compile_for_tpu, mosaic_body

R, D, E, F = 16, 64, 4, 256
N_MAX = 40
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@functools.lru_cache(maxsize=None)
def _case(dtype_name: str, n: int = N_MAX, seed: int = 0):
  """xs [n, R, D], w [E, D, F] in the dtype, tile_expert [n] sorted, every expert used."""
  rng = np.random.default_rng(seed)
  tile_expert = np.sort(np.concatenate([np.arange(E), rng.integers(0, E, n - E)]))
  dtype = DTYPES[dtype_name]
  return (jnp.asarray(rng.standard_normal((n, R, D)), dtype),
          jnp.asarray(rng.standard_normal((E, D, F)), dtype),
          jnp.asarray(tile_expert.astype(np.int32)))


def _run(backend: str, xs, w, tile_expert, **kw) -> np.ndarray:
  if backend == "tpu":
    with pltpu.force_tpu_interpret_mode():
      out = grouped_matmul(xs, w, tile_expert, backend="tpu", **kw)
  else:
    out = grouped_matmul(xs, w, tile_expert, backend="gpu", interpret=True, **kw)
  assert out.shape == (xs.shape[0], xs.shape[1], w.shape[2]) and out.dtype == jnp.float32
  return np.asarray(out)


def _per_tile_dot(xs, w, tile_expert) -> np.ndarray:
  """One jnp dot per tile, operands in xs's dtype, f32 accumulation: the kernel's arithmetic."""
  dot = jax.jit(lambda x, m: jnp.dot(x, m.astype(x.dtype), preferred_element_type=jnp.float32,
                                     precision=jax.lax.Precision.HIGHEST))
  return np.stack([np.asarray(dot(xs[i], w[int(e)])) for i, e in enumerate(tile_expert)])


def _assert_within_sum_bound(out, ref, xs, w, tile_expert):
  """|out - ref| <= 2 * K * 2^-24 * (|x| @ |w|): two f32 sums of the same K exact products."""
  x64 = np.abs(np.asarray(xs.astype(jnp.float32), np.float64))
  w64 = np.abs(np.asarray(w.astype(xs.dtype).astype(jnp.float32), np.float64))
  mag = np.einsum("...rd,...df->...rf", x64, w64[np.asarray(tile_expert)])
  bound = 2 * x64.shape[-1] * 2.0**-24 * mag
  excess = np.abs(np.asarray(out, np.float64) - np.asarray(ref, np.float64)) - bound
  assert np.all(excess <= 0), f"max excess over the bound: {excess.max()}"


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("backend,kw", [("tpu", {}), ("tpu", dict(block_f=128)),
                                        ("gpu", {}), ("gpu", dict(block_f=F))])
def test_matches_reference(backend, kw, dtype_name):
  xs, w, te = _case(dtype_name, 6)
  out = _run(backend, xs, w, te, **kw)
  ref = np.asarray(grouped_matmul_reference(xs, w, te))
  if dtype_name == "f32":
    chex.assert_trees_all_equal(out, ref)  # measured: bitwise
  else:
    chex.assert_trees_all_equal(out, _per_tile_dot(xs, w, te))  # same arithmetic: bitwise
    assert not np.array_equal(out, ref)  # bf16 vs f32 GEMM on XLA:CPU: other sum order
    _assert_within_sum_bound(out, ref, xs, w, te)


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_matches_deterministic_numerics_matmul(dtype_name):
  """Per tile, the bits of `Numerics("deterministic").matmul` (the deterministic routed-only
  path's (r x D) @ (D x F) dot; r = 16 needs no row padding), in both dtypes."""
  from rljax.numerics import Numerics  # pylint: disable=g-import-not-at-top
  matmul = jax.jit(Numerics("deterministic").matmul)
  xs, w, te = _case(dtype_name, 6)
  det = np.stack([np.asarray(matmul(xs[i], w[int(e)])) for i, e in enumerate(te)])
  for backend in ("tpu", "gpu"):
    chex.assert_trees_all_equal(_run(backend, xs, w, te), det)


@pytest.mark.parametrize("w_dtype", ["f32", "bf16"])
def test_weights_cast_to_the_activation_dtype(w_dtype):
  """w in another dtype than xs is cast to xs's dtype in the kernel, as in the reference."""
  xs_name = "bf16" if w_dtype == "f32" else "f32"
  xs, _, te = _case(xs_name, 6)
  _, w, _ = _case(w_dtype, 6)
  for backend in ("tpu", "gpu"):
    out = _run(backend, xs, w, te)
    same = _run(backend, xs, w.astype(xs.dtype), te)
    chex.assert_trees_all_equal(out, same)
    ref = np.asarray(grouped_matmul_reference(xs, w, te))
    if xs_name == "f32":
      chex.assert_trees_all_equal(out, ref)
    else:
      _assert_within_sum_bound(out, ref, xs, w, te)


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_gpu_k_loop_is_bounded(dtype_name):
  """block_k < D: a fixed in-program K loop, another summation order, the same bound."""
  xs, w, te = _case(dtype_name, 6)
  out = _run("gpu", xs, w, te, block_k=16)
  ref = np.asarray(grouped_matmul_reference(xs, w, te))
  _assert_within_sum_bound(out, ref, xs, w, te)


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("backend,kw", [("tpu", {}), ("gpu", {}), ("gpu", dict(block_k=16))])
def test_batch_invariance(backend, kw, dtype_name):
  """A tile's bits do not depend on the other tiles in the call, their order, or the row of
  its tile a row sits at."""
  xs, w, te = _case(dtype_name)
  full = _run(backend, xs, w, te, **kw)
  for lo, hi in ((7, 8), (3, 8)):  # N = 1, N = 5
    chex.assert_trees_all_equal(_run(backend, xs[lo:hi], w, te[lo:hi], **kw), full[lo:hi])
  rng = np.random.default_rng(1)
  perm = rng.permutation(N_MAX)
  chex.assert_trees_all_equal(_run(backend, xs[perm], w, te[perm], **kw), full[perm])
  rows = rng.permutation(R)
  chex.assert_trees_all_equal(_run(backend, xs[:, rows], w, te, **kw), full[:, rows])


@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
def test_matches_megablox_gmm(dtype_name):
  """JAX's megablox gmm (TPU interpret mode) on the real rows sorted by expert.

  Slots routed as the MoE would (S = 50 slots), tiled by `tile_plan`; gmm gets the rows
  sorted by expert with no padding between experts, zero rows appended to a multiple of
  its row tile (it requires one; they belong to no group), group_sizes = rows per expert.
  """
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # pylint: disable=g-import-not-at-top
  from rljax.model.moe_tiles import tile_plan  # pylint: disable=g-import-not-at-top
  s, m = 50, 64
  rng = np.random.default_rng(2)
  slot_expert = rng.integers(0, E, s).astype(np.int32)
  x = jnp.asarray(rng.standard_normal((s, D)), DTYPES[dtype_name])
  w = _case(dtype_name)[1]
  src, dest, te = tile_plan(jnp.asarray(slot_expert), E, R)
  xs = x.at[src].get(mode="fill", fill_value=0).reshape(-1, R, D)
  order = np.argsort(slot_expert, kind="stable")
  sizes = jnp.asarray(np.bincount(slot_expert, minlength=E).astype(np.int32))
  lhs = jnp.pad(x[order], ((0, m - s), (0, 0)))

  def megablox(tiling):
    with pltpu.force_tpu_interpret_mode():
      g = np.asarray(gmm(lhs, w, sizes, preferred_element_type=jnp.float32, tiling=tiling))
    out = np.empty((s, F), np.float32)
    out[order] = g[:s]
    return out

  whole_k, split_k = megablox((R, D, F)), megablox((R, D // 4, F))
  for backend in ("tpu", "gpu"):
    out = _run(backend, xs, w, te).reshape(-1, F)[np.asarray(dest)]
    chex.assert_trees_all_equal(out, whole_k)  # measured: bitwise, both dtypes
    _assert_within_sum_bound(out, split_k, x, w, jnp.asarray(slot_expert))


QWEN_R = 32
QWEN_N = 4096 * 8 // QWEN_R + 128  # 4096 tokens x top-8 slots, + one tile per expert
QWEN_ARGS = (jax.ShapeDtypeStruct((QWEN_N, QWEN_R, 2048), jnp.bfloat16),
             jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16),
             jax.ShapeDtypeStruct((QWEN_N,), jnp.int32))


def test_expert_weight_grads_match_the_per_tile_sums():
  """The TPU path's weight gradient (megablox tgmm, interpreted) against the jnp backward
  (`moe_tiles._tile_weight_grads`: one f32 product per tile, summed tile by tile) on routed tiles
  whose padding rows are zero, an expert without rows included: zero there, elsewhere equal
  within two f32 sums of the same exact products (each row's x * dy is exact in f64)."""
  from rljax.model.moe_tiles import _tile_weight_grads, tile_plan  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  slot_expert = rng.integers(0, E - 1, 70).astype(np.int32)  # expert E - 1 gets no rows
  src, _, te = tile_plan(jnp.asarray(slot_expert), E, R)
  x = jnp.asarray(rng.standard_normal((70, D)), jnp.float32)
  dy_rows = jnp.asarray(rng.standard_normal((70, F)), jnp.float32)
  xs = x.at[src].get(mode="fill", fill_value=0).reshape(-1, R, D)
  dy = dy_rows.at[src].get(mode="fill", fill_value=0).reshape(-1, R, F)
  with pltpu.force_tpu_interpret_mode():
    got = np.asarray(expert_weight_grads(xs, dy, te, E))
  want = np.asarray(_tile_weight_grads(xs, dy, te, E, 0))
  assert got.shape == (E, D, F) and got.dtype == np.float32
  assert np.all(got[E - 1] == 0) and np.all(want[E - 1] == 0)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy_rows, np.float64)
  exact = np.stack([x64[slot_expert == e].T @ dy64[slot_expert == e] for e in range(E)])
  mag = np.stack([np.abs(x64[slot_expert == e]).T @ np.abs(dy64[slot_expert == e])
                  for e in range(E)])
  bound = 70 * 2.0**-24 * mag  # a sum of n_e <= 70 terms, each rounding once
  assert np.all(np.abs(got - exact) <= bound) and np.all(np.abs(want - exact) <= bound)


def test_ragged_dot_tgmm_has_ragged_dots_gradients():
  """The ragged path's dot with megablox's weight gradient (interpreted) against autodiff of
  `lax.ragged_dot`, f32, rows past the groups and an empty group included: the same values
  and gradients (measured bitwise here; asserted within f32 sums of <= 70 terms)."""
  from pallas_kernels.grouped_matmul import ragged_dot_tgmm  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(6)
  sizes = jnp.asarray([20, 0, 33, 11], jnp.int32)  # 64 of 72 rows: 8 belong to no group
  x = jnp.asarray(rng.standard_normal((72, D)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((72, F)), jnp.float32)
  ours = jax.value_and_grad(lambda x, w: jnp.sum(ragged_dot_tgmm(x, w, sizes, True) * ct),
                            argnums=(0, 1))(x, w)
  xla = jax.value_and_grad(lambda x, w: jnp.sum(jax.lax.ragged_dot(
      x, w, sizes, preferred_element_type=jnp.float32) * ct), argnums=(0, 1))(x, w)
  chex.assert_trees_all_close(ours, xla, rtol=1e-5, atol=1e-4)
  assert np.all(np.asarray(ours[1][1])[1] == 0)  # the empty group's weights get nothing


def test_expert_weight_grads_compile_for_tpu_at_qwen3_shapes():
  """Mosaic compiles megablox's tgmm at a Qwen3-30B-A3B layer's gate (f32 operands, as the
  backward gives them), and the program holds no per-tile [N, D, F] buffer."""
  args = (jax.ShapeDtypeStruct((QWEN_N, QWEN_R, 2048), jnp.float32),
          jax.ShapeDtypeStruct((QWEN_N, QWEN_R, 768), jnp.float32),
          jax.ShapeDtypeStruct((QWEN_N,), jnp.int32))
  compiled = compile_for_tpu(functools.partial(expert_weight_grads, num_experts=128), *args)
  assert "tpu_custom_call" in compiled.as_text()
  assert compiled.memory_analysis().temp_size_in_bytes < 2 * 2**30  # [N, D, F] f32: 36 GiB


def test_tpu_default_block_f():
  """F when the double-buffered [D, F] weight block fits 8 MiB, else a multiple of 128."""
  assert _default_block_f(2048, 768, 2, "tpu") == 768  # Qwen3-30B-A3B bf16: 2 x 3 MiB
  assert _default_block_f(2048, 768, 4, "tpu") == 384  # f32 weights
  assert _default_block_f(4096, 1536, 2, "tpu") == 512  # Qwen3-235B-A22B bf16
  assert _default_block_f(2048, 768, 2, "gpu") == 128


def _lower(platform: str, **kw) -> str:
  fn = functools.partial(grouped_matmul, backend="tpu" if platform == "tpu" else "gpu", **kw)
  return jax.jit(fn).trace(*QWEN_ARGS).lower(lowering_platforms=(platform,)).as_text()


def test_lowers_for_tpu_at_qwen3_shapes():
  text = _lower("tpu")
  assert "tpu_custom_call" in text and 'kernel_name = "grouped_matmul_tpu"' in text
  # the stacked weights go in whole: no [N, D, F] per-tile weight copy anywhere
  assert "tensor<128x2048x768xbf16>) -> tensor<1152x32x768xf32>" in text
  assert "1152x2048x768" not in text
  body = mosaic_body(text)
  assert "iteration_bounds = array<i64: 1, 1152>" in body  # (F // block_f, N), block_f = F
  assert "scalar_prefetch = 1" in body and "memref<1152xi32, #tpu.memory_space<smem>>" in body
  assert "window_bounds = array<i64: 1, 2048, 768>" in body  # one expert's [D, F] block
  weight_map = re.search(r"\^bb0.*?sym_name = \"transform_1\"", body.split("transform_0")[-1],
                         re.S).group(0)
  assert "memref.load" in weight_map  # its block index is read from tile_expert (SMEM)
  assert "tpu.matmul" in body


def test_compiles_for_tpu_at_qwen3_shapes():
  """Mosaic compiles the kernel (its block shapes are legal), for one chip."""
  compiled = compile_for_tpu(functools.partial(grouped_matmul, backend="tpu"), *QWEN_ARGS)
  assert "grouped_matmul_tpu" in compiled.as_text()


def test_the_tpu_compile_refuses_what_lowering_lets_through():
  """What only compiling checks (tests/mosaic.py's compile is the TPU compiler's): a copy
  kernel's (2048, 8192) f32 blocks, 64 MiB each, lower and do not fit VMEM."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  def copy(x):
    spec = pl.BlockSpec((2048, 8192), lambda i: (i, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                          in_specs=[spec], out_specs=spec)(x)

  x = jax.ShapeDtypeStruct((4096, 8192), jnp.float32)
  assert "tpu_custom_call" in jax.jit(copy).trace(x).lower(lowering_platforms=("tpu",)).as_text()
  with pytest.raises(Exception, match="vmem"):
    compile_for_tpu(copy, x)


@pytest.mark.parametrize("kw", [{}, dict(block_k=64)])
def test_lowers_for_triton_at_qwen3_shapes(kw):
  """Triton IR is produced (not compiled: see the kernel module on shared memory)."""
  text = _lower("cuda", **kw)
  assert "__gpu$xla.gpu.triton" in text
  assert f"grid_x = {QWEN_N} : i32" in text and "grid_y = 6 : i32" in text  # block_f 128
  assert "1152x2048x768" not in text


def test_bad_inputs_raise_clear_errors():
  xs, w, te = _case("f32", 6)
  cases = [
      (dict(xs=xs[:, :, :32]), "disagree on D"),
      (dict(tile_expert=te[:5]), "tile_expert must be integer"),
      (dict(tile_expert=te.astype(jnp.float32)), "tile_expert must be integer"),
      (dict(xs=xs[0]), r"xs must be \[N, r, D\]"),
      (dict(w=w[0]), r"w must be \[E, D, F\]"),
      (dict(xs=xs.astype(jnp.float16)), "xs dtype must be bfloat16 or float32"),
      (dict(block_f=100), "block_f=100 must divide F=256"),
      (dict(backend="cpu"), "backend must be one of"),
      (dict(block_k=16), "block_k is for the gpu backend only"),
      (dict(backend="gpu", xs=xs[:, :8]), r"gpu: row tile r=8 must be a power of two >= 16"),
      (dict(backend="gpu", block_f=8), "gpu: block_f=8 must be a power of two >= 16"),
      (dict(xs=xs[:, :12]), "tpu: the row tile r=12 must be a multiple of 8"),
      (dict(block_f=64), "tpu: block_f=64 must be a multiple of 128"),
  ]
  for change, message in cases:
    args = dict(xs=xs, w=w, tile_expert=te, backend="tpu") | change
    with pytest.raises(ValueError, match=message):
      grouped_matmul(args.pop("xs"), args.pop("w"), args.pop("tile_expert"), **args)
