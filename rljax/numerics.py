"""Numerics modes: `fast` (whatever XLA does) and `deterministic` (batch-invariant).

In deterministic mode every reduction on the forward path has a fixed order that does
not depend on batch size, sequence packing, page layout or position in the batch, so a
token's logits are the same bits in a training forward, a prefill and a decode step:

* matmuls take bf16 operands, accumulate in f32 and run as one 2-D dot whose row count
  is padded to a multiple of `row_tile` (XLA:CPU's bf16 dot computes each output element
  with a K-order that is independent of N and of M >= 8; below 8 rows some CPUs take
  other kernels: 1 row on an AMD EPYC, 2-7 rows on a Xeon with AVX512-BF16 / AMX.
  Measured, and re-checked by tests/test_numerics.py; on a mesh each device's rows count,
  see `rljax.engine.engine.check_slots`). f32 dots are *not* row-invariant on XLA:CPU (Eigen changes
  blocking with M), so the bitwise guarantee is for bf16 compute.
* sums are pairwise trees of elementwise adds (`tree_sum`), never XLA reductions
  (XLA:CPU's reduction order depends on the sizes of the other axes).
* exp and log are polynomials built from + - * / and bit operations (XLA:CPU's
  vectorised exp/log give different bits in loop tails); they carry custom JVPs.
* FMA contraction, excess precision and dot fusion are switched off by process-wide XLA
  flags (`DETERMINISTIC_XLA_FLAGS`), installed by the first `Numerics("deterministic")`
  made before JAX starts its backend (or by `install_deterministic_xla_flags()`). A
  process that only runs fast numerics never gets them: XLA reads its flags once, when the
  backend starts, so they cannot be set per program (`jax.jit(compiler_options=...)`
  accepts `xla_cpu_max_isa` but XLA:CPU still contracts FMAs: measured).

Backward passes are not covered: gradients need not be invariant, only the forward
log-probs that the trainer and the engine both compute.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from typing import Any, Literal

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

Mode = Literal["fast", "deterministic"]

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln2 split so that n * _LN2_HI is exact for |n| < 2**9
_LN2_LO = -2.12194440e-4
_EXP_MAX = 88.0
_EXP_MIN = -87.0  # below this exp() returns 0: 2**-126 is the smallest normal f32
_SQRT_HALF = 0.70710678118654752

# --xla_cpu_max_isa=AVX: LLVM contracts a*b+c into an FMA inside XLA:CPU fusions, so the
#   bits of an elementwise chain depend on where fusion boundaries fall (they differ
#   between a training graph and a decode graph). AVX has no FMA instructions. The bf16
#   dots (YNNPACK) are library calls and keep their kernels.
# --xla_allow_excess_precision=false: keep every explicit bf16 rounding point.
# --xla_cpu_experimental_ynn_fusion_type=individual_dot: XLA:CPU otherwise fuses a dot's
#   elementwise producers/consumers into one YNNPACK fusion whose bf16 handling differs
#   from the unfused ops (seen: the LM head fused with the final RMSNorm when only target
#   log-probs are returned moved log-probs by 1e-2). Dots stay single library calls.
# The xla_cpu_* flags are ignored on GPU and TPU.
DETERMINISTIC_XLA_FLAGS = ("--xla_cpu_max_isa=AVX", "--xla_allow_excess_precision=false",
                           "--xla_cpu_experimental_ynn_fusion_type=individual_dot")


def set_up_process(mode: str) -> None:
  """First thing in an entry point's main, with the run's numerics mode: a deterministic
  run installs its XLA flags before anything starts JAX's backend; a fast one keeps XLA's
  defaults (the platform's best settings)."""
  skip_absent_accelerators()
  Numerics(mode)  # checks the mode; a deterministic one installs the flags


def skip_absent_accelerators() -> None:
  """On a host with no TPU chip and no GPU, runs JAX on CPU without probing the others.

  With libtpu installed (the `tpu` and `test` extras: the TPU compiler that
  `experiments/aot_check.py --topology` runs from CPU) JAX would start libtpu's runtime
  first in every process, which prints warnings about a missing TPU and then falls back to
  CPU. Sets JAX_PLATFORMS=cpu for this process and the processes it starts; a JAX_PLATFORMS
  already set wins, and hosts with a TPU chip or a GPU device file are left as they are.
  TPU topologies for ahead-of-time compiles still work."""
  if os.environ.get("JAX_PLATFORMS"):
    return
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    return
  if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"):
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  if not _backend_started():
    jax.config.update("jax_platforms", "cpu")


def _backend_started() -> bool:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.backends_are_initialized()


def deterministic_xla_flags_set() -> bool:
  """Whether XLA_FLAGS holds every deterministic flag."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  return all(flag in flags for flag in DETERMINISTIC_XLA_FLAGS)


def install_deterministic_xla_flags() -> None:
  """Adds DETERMINISTIC_XLA_FLAGS to XLA_FLAGS for this process (and the processes it
  starts). Call it before the first JAX computation; afterwards it can only check them.

  Raises RuntimeError if the backend already started without them: deterministic
  programs would then compile with FMA contraction and excess precision.
  """
  if deterministic_xla_flags_set():
    return
  if _backend_started():
    raise RuntimeError(
        "deterministic numerics needs the XLA flags "
        f"{' '.join(DETERMINISTIC_XLA_FLAGS)}, but the JAX backend started without them. "
        "Make Numerics('deterministic') or call "
        "rljax.numerics.install_deterministic_xla_flags() before the first JAX "
        "computation, or put the flags in XLA_FLAGS.")
  os.environ["XLA_FLAGS"] = with_xla_flags(os.environ.get("XLA_FLAGS", ""),
                                           DETERMINISTIC_XLA_FLAGS)


def with_xla_flags(xla_flags: str, flags: tuple[str, ...] = (),
                   without: tuple[str, ...] = ()) -> str:
  """An XLA_FLAGS string: `xla_flags` with `flags` appended and the flags named in
  `without` dropped; any other value of a flag in either is dropped too."""
  names = {f.split("=")[0] for f in (*flags, *without)}
  return " ".join([f for f in xla_flags.split() if f.split("=")[0] not in names] + list(flags))


@jax.custom_jvp
def det_exp(x: jax.Array) -> jax.Array:
  """exp(x) in f32 from + - * / and bit operations (Cephes expf, <= 2 ulp)."""
  x = x.astype(jnp.float32)
  xc = jnp.clip(x, _EXP_MIN, _EXP_MAX)
  n = jnp.floor(xc * _LOG2E + 0.5)
  r = xc - n * _LN2_HI
  r = r - n * _LN2_LO
  p = jnp.float32(1.9875691500e-4)
  for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
            5.0000001201e-1):
    p = p * r + c
  y = p * (r * r) + r + 1.0
  scale = lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
  return jnp.where(x < _EXP_MIN, 0.0, y * scale).astype(jnp.float32)


@det_exp.defjvp
def _det_exp_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  y = det_exp(x)
  return y, y * t.astype(jnp.float32)


@jax.custom_jvp
def det_log(x: jax.Array) -> jax.Array:
  """log(x) in f32 for x >= 0 from + - * / and bit operations (Cephes logf)."""
  x = x.astype(jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.int32)
  e = ((bits >> 23) & 0xFF) - 126
  m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F000000, jnp.float32)
  small = m < _SQRT_HALF
  e = jnp.where(small, e - 1, e).astype(jnp.float32)
  m = jnp.where(small, m + m - 1.0, m - 1.0)
  z = m * m
  p = jnp.float32(7.0376836292e-2)
  for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
            -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
    p = p * m + c
  y = p * m * z
  y = y + e * _LN2_LO
  y = y - 0.5 * z
  y = m + y + e * _LN2_HI
  y = jnp.where(x == jnp.inf, jnp.inf, y)
  y = jnp.where(x == 0.0, -jnp.inf, y)
  return jnp.where(x < 0.0, jnp.nan, y)


@det_log.defjvp
def _det_log_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return det_log(x), t.astype(jnp.float32) / x.astype(jnp.float32)


def tree_sum(x: jax.Array) -> jax.Array:
  """Sums the last axis as a pairwise tree of elementwise adds (fixed order)."""
  n = x.shape[-1]
  width = 1 << max(n - 1, 0).bit_length()
  if width != n:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


@dataclasses.dataclass(frozen=True)
class Numerics:
  """The primitives whose order of reduction the model depends on.

  Hashable, so it is passed to jitted functions as a static argument.
  """

  mode: Mode = "fast"
  row_tile: int = 8

  def __post_init__(self):
    if self.mode not in ("fast", "deterministic"):
      raise ValueError(f"numerics mode must be 'fast' or 'deterministic', got {self.mode!r}")
    if self.deterministic:
      install_deterministic_xla_flags()

  @property
  def deterministic(self) -> bool:
    return self.mode == "deterministic"

  def pad_rows(self, n: int) -> int:
    """Row count that the deterministic matmul pads `n` rows to."""
    if not self.deterministic:
      return n
    return max(self.row_tile, -(-n // self.row_tile) * self.row_tile)

  def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., K] @ w[K, N] -> f32[..., N], operands in the dtype of `x`.

    `w` may be an f32 master weight: it is cast at use, and its gradient is computed in
    f32 from the f32 output cotangent (a bf16 cotangent would round every weight
    gradient to 8 bits before the optimizer sees it).
    """
    return _matmul(x, w, self.pad_rows(int(np.prod(x.shape[:-1]))))

  def sum(self, x: jax.Array) -> jax.Array:
    """Sum over the last axis."""
    return tree_sum(x) if self.deterministic else jnp.sum(x, axis=-1)

  def silu(self, x: jax.Array) -> jax.Array:
    """x * sigmoid(x) in f32 (deterministic: x / (1 + det_exp(-x)))."""
    x = x.astype(jnp.float32)
    return x / (1.0 + det_exp(-x)) if self.deterministic else jax.nn.silu(x)

  def exp(self, x: jax.Array) -> jax.Array:
    return det_exp(x) if self.deterministic else jnp.exp(x)

  def log(self, x: jax.Array) -> jax.Array:
    return det_log(x) if self.deterministic else jnp.log(x)

  def softmax(self, x: jax.Array) -> jax.Array:
    """Softmax over the last axis, in f32."""
    x = x.astype(jnp.float32)
    if not self.deterministic:
      return jax.nn.softmax(x, axis=-1)
    e = det_exp(x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / tree_sum(e)[..., None]

  def log_softmax(self, x: jax.Array) -> jax.Array:
    """Log-softmax over the last axis, in f32, one row at a time."""
    x = x.astype(jnp.float32)
    if not self.deterministic:
      return jax.nn.log_softmax(x, axis=-1)
    shifted = x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - det_log(tree_sum(det_exp(shifted)))[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, padded_rows: int) -> jax.Array:
  lead, k = x.shape[:-1], x.shape[-1]
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  if padded_rows != m:  # deterministic mode: a fixed row tile (see the module docstring)
    x2 = jnp.pad(x2, ((0, padded_rows - m), (0, 0)))
  y = jnp.dot(x2, w.astype(x.dtype), preferred_element_type=jnp.float32)
  return y[:m].reshape(*lead, w.shape[-1])


def _matmul_fwd(x, w, padded_rows):
  return _matmul(x, w, padded_rows), (x, w)


def _matmul_bwd(padded_rows, residuals, g):
  del padded_rows
  x, w = residuals
  g2 = g.reshape(-1, g.shape[-1]).astype(jnp.float32)
  x2 = x.reshape(-1, x.shape[-1])
  dx = jnp.dot(g2, w.astype(jnp.float32).T).astype(x.dtype).reshape(x.shape)
  dw = jnp.dot(x2.astype(jnp.float32).T, g2).astype(w.dtype)
  return dx, dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_to(x: jax.Array, dtype: Any) -> jax.Array:
  """x rounded to `dtype` and back, with a straight-through (identity) derivative.

  For f32 master weights used outside a matmul (norm scales): the forward sees exactly
  the bits of the serving cast, the gradient stays f32.
  """
  return x.astype(dtype).astype(x.dtype)


@round_to.defjvp
def _round_to_jvp(dtype, primals, tangents):
  (x,), (t,) = primals, tangents
  return round_to(x, dtype), t


FAST = Numerics("fast")


def get(mode: Mode | Numerics) -> Numerics:
  return mode if isinstance(mode, Numerics) else Numerics(mode)
