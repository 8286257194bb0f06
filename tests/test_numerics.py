"""The deterministic primitives: accuracy, and invariance to the shapes around them."""

import inspect
import json
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import numerics
from rljax.numerics import Numerics, det_exp, det_log, tree_sum
from tests.xla_flags import production_env

DET, FAST = Numerics("deterministic"), Numerics("fast")
REPO = pathlib.Path(__file__).resolve().parent.parent


def _contracts_fma() -> bool:
  """Whether XLA computes a*b+c in one rounding (an FMA) in this process."""
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
  fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
  return not np.array_equal(fused, (a * b).astype(np.float32) + c)  # two roundings


def test_this_process_has_the_deterministic_flags_and_no_fma_contraction():
  assert numerics.deterministic_xla_flags_set()  # conftest installed them
  assert not _contracts_fma()


_PROBE = """
import json, sys
import jax
import numpy as np
from rljax import numerics
""" + inspect.getsource(_contracts_fma) + """
mode, compute_first = sys.argv[1], sys.argv[2] == "1"
if compute_first:
  jax.block_until_ready(jax.numpy.zeros(1) + 1)  # starts the backend
try:
  numerics.set_up_process(mode)
  numerics.Numerics(mode)
  error = None
except RuntimeError as e:
  error = str(e)
print(json.dumps({"flags": numerics.deterministic_xla_flags_set(), "fma": _contracts_fma(),
                  "error": error}))
"""


def _probe(mode: str, compute_first: bool = False) -> dict:
  """A fresh process that sets itself up for `mode`, without this process's flags."""
  env = production_env()  # XLA's own optimization level: at -O0 it contracts no FMA either
  env["XLA_FLAGS"] = numerics.with_xla_flags(env["XLA_FLAGS"],
                                             without=numerics.DETERMINISTIC_XLA_FLAGS)
  out = subprocess.run([sys.executable, "-c", _PROBE, mode, str(int(compute_first))], env=env,
                       cwd=REPO, capture_output=True, text=True, check=True, timeout=300)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_fast_process_keeps_fma_and_a_deterministic_one_gets_its_flags_first():
  with open("/proc/cpuinfo") as f:
    assert " fma " in f.read()  # every CPU this suite runs on (AVX2 or AVX-512) has FMA
  fast = _probe("fast")
  assert fast == {"flags": False, "fma": True, "error": None}  # XLA's defaults
  assert _probe("deterministic") == {"flags": True, "fma": False, "error": None}
  late = _probe("deterministic", compute_first=True)  # too late to install: a clear error
  assert not late["flags"] and "started without them" in late["error"]


def test_det_exp_accuracy():
  x = np.linspace(-87.0, 88.0, 200_001, dtype=np.float32)
  got = np.asarray(jax.jit(det_exp)(x), np.float64)
  want = np.exp(x.astype(np.float64))
  # Cephes expf is accurate to ~1 ulp; allow 2 ulp of f32 (2 * 2**-23 relative)
  assert np.max(np.abs(got - want) / want) < 2.4e-7
  assert float(det_exp(jnp.float32(-100.0))) == 0.0
  assert float(det_exp(jnp.float32(0.0))) == 1.0  # masked blocks rely on exp(0) == 1 exactly


def test_det_log_accuracy():
  x = np.concatenate([np.geomspace(1e-30, 1e30, 100_001), np.linspace(0.5, 2.0, 10_001)])
  x = x.astype(np.float32)
  got = np.asarray(jax.jit(det_log)(x), np.float64)
  want = np.log(x.astype(np.float64))
  assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1.0)) < 2.4e-7
  assert float(det_log(jnp.float32(0.0))) == -np.inf
  assert np.isnan(float(det_log(jnp.float32(-1.0))))


def test_det_exp_log_gradients():
  x = jnp.linspace(-3.0, 3.0, 11)
  np.testing.assert_allclose(jax.grad(lambda v: det_exp(v).sum())(x), jnp.exp(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda v: det_log(v).sum())(jnp.exp(x)), jnp.exp(-x),
                             rtol=1e-6)


@pytest.mark.parametrize("fn", [det_exp, det_log, tree_sum], ids=["exp", "log", "tree_sum"])
def test_elementwise_results_do_not_depend_on_array_size(fn):
  """XLA:CPU's vectorised exp/log differ in loop tails; ours must not."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(np.abs(rng.standard_normal((67, 33))).astype(np.float32) + 0.01)
  run = jax.jit(fn)
  full = np.asarray(run(x))
  for rows in (1, 2, 3, 7, 8, 9, 31):
    np.testing.assert_array_equal(np.asarray(run(x[:rows])), full[:rows])
  if fn is not tree_sum:
    for cols in (1, 3, 7, 9, 17):
      np.testing.assert_array_equal(np.asarray(run(x[:, :cols])), full[:, :cols])


def test_tree_sum_matches_sum():
  x = np.random.default_rng(2).standard_normal((5, 37)).astype(np.float32)
  # pairwise summation of 37 terms (padded to 64, depth 6): each level's add rounds once,
  # so |error| <= 6 * 2^-24 * sum|x| against the exact (float64) sum
  exact = x.astype(np.float64).sum(-1)
  bound = 6 * 2.0**-24 * np.abs(x).astype(np.float64).sum(-1)
  assert np.all(np.abs(np.asarray(tree_sum(x), np.float64) - exact) <= bound)
  assert tree_sum(jnp.ones((3, 1))).shape == (3,)


@pytest.mark.parametrize("k,n", [(64, 96), (256, 512), (768, 2048)])
def test_det_matmul_rows_are_batch_invariant(k, n):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((300, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  mm = jax.jit(DET.matmul)
  full = np.asarray(mm(x, w))
  for lo, hi in ((0, 1), (5, 6), (0, 2), (7, 10), (100, 164), (13, 300)):
    np.testing.assert_array_equal(np.asarray(mm(x[lo:hi], w)), full[lo:hi])
  # columns too: an expert's slice of a fused weight computes the same bits
  np.testing.assert_array_equal(np.asarray(mm(x[:9], w[:, n // 4:n // 2])),
                                full[:9, n // 4:n // 2])


def test_fast_matmul_of_one_row_differs_only_by_f32_summation_order():
  """Why matmul rows are padded: on this jaxlib a 1-row bf16 dot takes another kernel, so
  its bits may differ from the same row in a 64-row dot (printed; equality is not required).
  What must hold on any CPU: both accumulate in f32. A bf16 x bf16 product has 16
  significant bits, exact in f32, so the two results are two orders of summing the same
  K exact terms, each within (K-1) * 2^-24 * sum|terms| of the exact sum (Higham's
  gamma_{K-1}, u = 2^-24). bf16 accumulation would miss this by ~2^15."""
  rng = np.random.default_rng(4)
  k = 256
  x = jnp.asarray(rng.standard_normal((64, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, 512)), jnp.bfloat16)
  mm = jax.jit(FAST.matmul)
  one, full = np.asarray(mm(x[:1], w), np.float64), np.asarray(mm(x, w), np.float64)[:1]
  xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
  exact, magnitude = xf[:1] @ wf, np.abs(xf[:1]) @ np.abs(wf)
  bound = (k - 1) * 2.0**-24 * magnitude
  assert np.all(np.abs(one - exact) <= bound) and np.all(np.abs(full - exact) <= bound)
  print(f"fast 1-row vs 64-row dot: max diff {np.max(np.abs(one - full)):.3g}")


def test_det_softmax_and_log_softmax():
  x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 151)) * 5, jnp.float32)
  np.testing.assert_allclose(DET.softmax(x), jax.nn.softmax(x), rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(DET.log_softmax(x), jax.nn.log_softmax(x), rtol=2e-6, atol=2e-6)
  chex.assert_trees_all_equal(jax.jit(DET.log_softmax)(x[:1]), jax.jit(DET.log_softmax)(x)[:1])


def test_det_matmul_pads_rows_and_gives_f32_weight_gradients():
  x = jnp.ones((3, 16), jnp.bfloat16)
  w = jnp.full((16, 5), 0.5, jnp.float32)  # an f32 master, cast at use
  out = DET.matmul(x, w)
  assert out.shape == (3, 5) and out.dtype == jnp.float32
  np.testing.assert_array_equal(out, 8.0)
  dw = jax.grad(lambda w: jnp.sum(DET.matmul(x, w) * 1e-3))(w)
  assert dw.dtype == jnp.float32
  np.testing.assert_array_equal(dw, np.float32(3e-3))  # 3 rows x 1e-3, not rounded to bf16


def test_bad_mode_is_rejected():
  with pytest.raises(ValueError, match="numerics mode"):
    Numerics("exact")


def test_with_xla_flags_sets_each_flag_once_and_drops_the_named_ones():
  got = numerics.with_xla_flags("--a=1 --b=2 --c --xla_cpu_max_isa=AVX512",
                                ("--xla_cpu_max_isa=AVX", "--d=4"), without=("--b", "--c=9"))
  assert got == "--a=1 --xla_cpu_max_isa=AVX --d=4"
  assert numerics.with_xla_flags("", without=("--a",)) == ""
