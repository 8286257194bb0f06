"""rljax.hlo_flops: the matmul FLOPs (and HBM bytes) of a compiled program with loop bodies
counted as many times as they run, checked against exact counts of small programs compiled
on this CPU, and of one compiled by the TPU compiler for a v5p slice (libtpu, no TPU)."""

import re

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import pytest

from rljax import hlo_flops
from rljax.aot_compile import topology_chips, topology_mesh, uncached

M, K, N = 8, 32, 16  # x [M, K] @ w [K, N]; a layer's square w is [K, K]


def compile_(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def sds(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def scanned(x, ws):
  return lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]


@pytest.mark.parametrize("layers", [1, 5, 12])
def test_a_scan_of_matmuls_counts_each_step(layers):
  compiled = compile_(scanned, sds(M, K), sds(layers, K, K))
  count = hlo_flops.count(compiled.as_text())
  one = 2 * M * K * K
  assert count.flops == layers * one
  assert count.flops_loops_once == one
  assert [l["trip_count"] for l in count.loops] == ([layers] if layers > 1 else [])
  assert not count.unknown_loops and count.conditionals == 0
  # XLA's own count: the body once, plus elementwise ops (the counter's add, tanh's none)
  assert one <= compiled.cost_analysis()["flops"] <= one + 16


def test_trip_counts_are_proved_from_the_condition_without_the_compilers_note():
  """The TPU compiler writes no known_trip_count: the count comes from the induction
  variable's start, step and limit, here on XLA:CPU's text with the note removed."""
  text = compile_(scanned, sds(M, K), sds(7, K, K)).as_text()
  assert '"known_trip_count":{"n":"7"}' in text
  bare = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", text)
  assert "known_trip_count" not in bare
  assert hlo_flops.count(bare).flops == 7 * 2 * M * K * K


def test_nested_scans_multiply():
  def fn(x, ws):
    def outer(c, w):
      return lax.scan(lambda c2, _: (jnp.tanh(c2 @ w), None), c, None, length=3)[0], None
    return lax.scan(outer, x, ws)[0]
  count = hlo_flops.count(compile_(fn, sds(M, K), sds(4, K, K)).as_text())
  assert count.flops == 4 * 3 * 2 * M * K * K
  assert sorted(l["trip_count"] for l in count.loops) == [3, 4]


def test_a_batched_dot_counts_its_batch():
  fn = lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b)  # noqa: E731
  count = hlo_flops.count(compile_(fn, sds(6, M, K), sds(6, K, N)).as_text())
  assert count.flops == 2 * 6 * M * K * N


def test_a_conditional_counts_its_largest_branch():
  def fn(p, x, w):
    return lax.cond(p, lambda x: (x @ w) @ w.T @ w, lambda x: x @ w, x)
  count = hlo_flops.count(compile_(fn, sds(dtype=jnp.bool_), sds(M, K), sds(K, N)).as_text())
  assert count.conditionals == 1
  assert count.flops == 2 * M * K * N + 2 * M * N * K + 2 * M * K * N  # the 3-matmul branch


def test_a_loop_without_a_provable_count_is_reported_and_counted_once():
  def fn(x, w, n):
    return lax.while_loop(lambda c: c[1] < n, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1),
                          (x, 0))[0]
  count = hlo_flops.count(compile_(fn, sds(M, K), sds(K, K), sds(dtype=jnp.int32)).as_text())
  assert len(count.unknown_loops) == 1 and count.loops[0]["trip_count"] is None
  assert count.flops == count.flops_loops_once == 2 * M * K * K


def test_equals_xla_on_the_unrolled_program():
  """The same 6 layers as a Python loop (no while: XLA counts every layer) against the
  scan: XLA's flops add the elementwise ops to the matmuls, here the bias add (M x K per
  layer, tanh is a transcendental), so the bound is exact: matmuls <= XLA <= matmuls +
  6 M K."""
  def unrolled(x, ws):
    for i in range(6):
      x = jnp.tanh(x @ ws[i] + 1.0)
    return x
  compiled = compile_(unrolled, sds(M, K), sds(6, K, K))
  xla = compiled.cost_analysis()["flops"]
  unrolled_count = hlo_flops.count(compiled.as_text())
  scan = hlo_flops.count(compile_(
      lambda x, ws: lax.scan(lambda c, w: (jnp.tanh(c @ w + 1.0), None), x, ws)[0],
      sds(M, K), sds(6, K, K)).as_text())
  assert not unrolled_count.loops
  assert unrolled_count.flops == scan.flops == 6 * 2 * M * K * K
  assert scan.flops <= xla <= scan.flops + 6 * M * K


def test_bytes_count_each_layers_slice_not_the_stack():
  """A scan over L layers' [K, K] f32 weights reads each layer's slice: L K K 4 bytes at
  least, and a few times that (XLA:CPU copies the slice out, then the dot reads it; the
  activations are M K 4 = 1/4 of a slice), not the whole stack every step (L times)."""
  layers = 16
  compiled = compile_(scanned, sds(M, K), sds(layers, K, K))
  count = hlo_flops.count(compiled.as_text())
  weights = layers * K * K * 4
  assert weights <= count.bytes < 5 * weights
  # with each body once it is XLA's own bytes accessed (measured 18,473 vs 18,521 B)
  xla = compiled.cost_analysis()["bytes accessed"]
  assert 0.95 * xla <= count.bytes_loops_once <= 1.05 * xla
  assert count.bytes_loops_once < count.bytes / 4


def test_bytes_count_an_in_place_update_not_the_whole_buffer():
  """A scan stacking its L steps' [M, K] outputs writes one row of the stack a step
  (dynamic-update-slice in place): a few M K 4 bytes a step (measured 7: XLA:CPU copies
  the carry, sin reads and writes it), not the L M K 4 stack."""
  layers = 64
  fn = lambda x: lax.scan(lambda c, _: (jnp.sin(c), c), x, None, length=layers)[1]  # noqa: E731
  count = hlo_flops.count(compile_(fn, sds(M, K)).as_text())
  assert count.loops[0]["trip_count"] == layers
  assert layers * M * K * 4 <= count.bytes < 12 * layers * M * K * 4


@pytest.fixture(scope="module")
def v5p_mesh():
  return topology_mesh({"fsdp": 4}, topology_chips("v5p:2x2x1"), "v5p:2x2x1")


def test_a_tpu_compile_counts_the_exact_matmuls(v5p_mesh):
  """Compiled by the TPU compiler for 4 v5p chips (rows split 4 ways): its matmuls are
  convolutions, its loops carry no trip count (proved from their conditions), its HLO is
  one chip's. Per chip: 5 x 3 nested steps, a cond's larger branch and a batched einsum
  (its batch split over the chips: one pair a chip)."""
  rows, width, layers = 128, 256, 5

  def fn(x, ws):
    def body(c, w):
      return lax.scan(lambda c2, _: (jnp.tanh(c2 @ w), None), c, None, length=3)[0], None
    y = lax.scan(body, x, ws)[0]
    z = lax.cond(y.sum() > 0, lambda a: a @ ws[0], lambda a: a, y)
    return jnp.einsum("bmk,bkn->bmn", z.reshape(4, rows // 4, width), ws[:4])

  x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16,
                           sharding=NamedSharding(v5p_mesh, P("fsdp")))
  ws = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16,
                            sharding=NamedSharding(v5p_mesh, P()))
  with uncached():
    compiled = jax.jit(fn).trace(x, ws).lower().compile()
  text = compiled.as_text()
  assert "known_trip_count" not in text
  count = hlo_flops.count(text)
  one = 2 * (rows // 4) * width * width  # one chip's rows through one [width, width] matmul
  assert count.flops == (layers * 3 + 1 + 1) * one
  assert sorted(l["trip_count"] for l in count.loops) == [3, layers]
  assert count.conditionals == 1 and not count.unknown_loops
  assert count.flops_loops_once == 3 * one
  cost = compiled.cost_analysis()
  assert count.flops_loops_once <= cost["flops"] < 1.02 * count.flops_loops_once
  # the TPU compiler's bytes differ in kind (its memory-space copies; measured 5.6 vs 7.7
  # MB): the same order, not the same number
  assert 0.5 * cost["bytes accessed"] < count.bytes_loops_once < 2 * cost["bytes accessed"]


def test_a_tpu_batched_matmul_is_a_dilated_convolution(v5p_mesh):
  """A replicated batched matmul: the TPU compiler writes its batch as a spatial dim of a
  convolution whose input is dilated (lhs_dilate=4, window 4, stride 3, pad 0_-4): only
  the window positions on real input elements count (XLA's count too)."""
  ws = jax.ShapeDtypeStruct((5, 64, 128), jnp.bfloat16, sharding=NamedSharding(v5p_mesh, P()))
  fn = jax.jit(lambda ws: jnp.einsum("bmk,bnk->bmn", ws[:4], ws[1:]),
               out_shardings=NamedSharding(v5p_mesh, P()))
  with uncached():
    compiled = fn.trace(ws).lower().compile()
  assert "lhs_dilate=4" in compiled.as_text()
  exact = 4 * 2 * 64 * 64 * 128
  assert hlo_flops.count(compiled.as_text()).flops == exact
  assert compiled.cost_analysis()["flops"] == exact


@pytest.mark.parametrize("padding,dilation", [("SAME", 1), ("VALID", 1), ("SAME", 2)])
def test_a_convolution_counts_window_positions_on_its_input(padding, dilation):
  """A 1-D convolution (2 images of 10 positions, 8 -> 4 features, window 3): with SAME
  padding the edges' windows hang over the border; those positions are not counted (nor
  by XLA's own count, equal here)."""
  def fn(x, k):
    return lax.conv_general_dilated(x, k, (1,), padding, rhs_dilation=(dilation,))
  compiled = compile_(fn, sds(2, 8, 10), sds(4, 8, 3))
  assert "convolution(" in compiled.as_text()
  count = hlo_flops.count(compiled.as_text())
  width = {"SAME": 10, "VALID": 10 - 2 * dilation}[padding]
  hits = sum(0 <= o + (j - (padding == "SAME")) * dilation < 10 for o in range(width)
             for j in range(3))
  assert count.flops == 2 * 2 * 4 * 8 * hits == compiled.cost_analysis()["flops"]
