"""Pallas TPU kernels in tests: the Mosaic module a lowered tpu_custom_call carries, and
compiling for one TPU chip from this CPU (libtpu's ahead-of-time compiler, Mosaic for the
kernels: an illegal block shape is refused there, not at lowering)."""

import base64
import functools
import re

import jax
import numpy as np

from rljax import aot_compile

TOPOLOGY = "v5p:2x2x1"  # the smallest v5p slice; its first chip


def mosaic_body(text: str) -> str:
  """The Mosaic module a tpu_custom_call carries (base64 MLIR bytecode in its config),
  printed by jaxlib's MLIR with its TPU dialect registered (jax internals, pinned jax)."""
  from jax._src.lib import tpu  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  body = re.search(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22', text).group(1)
  ctx = ir.Context()
  tpu.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  with ctx:
    return str(ir.Module.parse(base64.b64decode(body)))


@functools.lru_cache(maxsize=None)
def tpu_chip():
  """A one-chip mesh of a TPU topology described by libtpu (no TPU needed). libtpu is in
  the test extras, so a missing or broken one fails the calling test (no skip)."""
  chips = aot_compile.topology_chips(TOPOLOGY)  # (without libtpu's host-wide lock)
  return jax.sharding.Mesh(np.array(chips[:1]).reshape(1), ("chip",))


def compile_for_tpu(fn, *args, **jit_kwargs):
  """`jax.jit(fn, **jit_kwargs)` compiled for one TPU chip by the TPU compiler. args:
  pytrees of arrays or ShapeDtypeStructs (only shapes and dtypes are used), placed on the
  chip. Returns the compiled program (`.as_text()`: its optimized HLO). The persistent
  compilation cache takes no TPU program: it could not load one back (no TPU client here)."""
  chip = jax.sharding.NamedSharding(tpu_chip(), jax.sharding.PartitionSpec())
  on_chip = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=chip), args)
  with aot_compile.uncached():
    return jax.jit(fn, **jit_kwargs).lower(*on_chip).compile()
