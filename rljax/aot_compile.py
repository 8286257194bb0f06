"""Compiling a program ahead of time, for `rljax.aot`: meshes (abstract, or a TPU slice's
chips from libtpu's compile-only client, no TPU needed), lowering and compiling on abstract
arguments, and what the compiler reports (memory and cost analysis per device, and the
optimized HLO's matmul FLOPs and bytes with loops counted as they run)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
import traceback
from typing import Any

from absl import logging
import jax
from jax.sharding import AbstractMesh, AxisType

from rljax import hlo_flops
from rljax import sharding as sharding_lib


def abstract_mesh(shape: dict[str, int]) -> AbstractMesh:
  unknown = set(shape) - set(sharding_lib.MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}")
  sizes = tuple(int(shape.get(a, 1)) for a in sharding_lib.MESH_AXES)
  return AbstractMesh(sizes, sharding_lib.MESH_AXES,
                      axis_types=(AxisType.Auto,) * len(sizes))


def topology_chips(topology: str) -> list:
  """The chips of a TPU slice ("v5p:4x4x4", "v5e:2x2", "v6e:2x2"), described by libtpu's
  ahead-of-time compiler: no TPU needed, only libtpu (`pip install -e '.[tpu]'`)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) for its runtime; a compile-only
  # client needs none, and two of them (two checks, two test workers) must not collide
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"TPU topology {topology!r}: {type(e).__name__}: {str(e)[:300]} (a name "
                     "like v5p:4x4x4, v5e:2x2, v6e:2x2; needs libtpu: pip install -e "
                     "'.[tpu]')") from e


@contextlib.contextmanager
def uncached():
  """Compiles inside write nothing to JAX's persistent compilation cache: a TPU program
  compiled here could not be loaded back (no TPU client; every read would warn). The floor
  is read when an entry would be written."""
  floor = "jax_persistent_cache_min_compile_time_secs"
  before = getattr(jax.config, floor)
  jax.config.update(floor, 1e9)
  try:
    yield
  finally:
    jax.config.update(floor, before)


def topology_mesh(shape: dict[str, int], chips: list, topology: str) -> jax.sharding.Mesh:
  """A concrete mesh of the slice's first chips (the TPU compiler needs real device
  assignments: an AbstractMesh lowered for tpu compiles on XLA:CPU)."""
  abstract_mesh(shape)  # the axis names' check
  need = math.prod(int(v) for v in shape.values())
  if need > len(chips):
    raise ValueError(f"mesh {shape} needs {need} chips; topology {topology} has "
                     f"{len(chips)}")
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  sizes = tuple(int(shape.get(a, 1)) for a in sharding_lib.MESH_AXES)
  # laid out on the slice's torus as a real job's mesh would be (an axis of 8 on a 4x4x4
  # slice spans two physical axes)
  devices = mesh_utils.create_device_mesh(sizes, chips[:need], allow_split_physical_axes=True)
  return jax.sharding.Mesh(devices, sharding_lib.MESH_AXES,
                           axis_types=(AxisType.Auto,) * len(sizes))


def running_platform() -> str:
  """The running backend as a lowering platform name (gpu -> cuda or rocm)."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.canonicalize_platform(jax.default_backend())


def memory_stats(compiled) -> dict[str, int] | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")
  out = {k.removesuffix("_size_in_bytes"): int(getattr(m, k)) for k in keys}
  # what the program holds at its peak: arguments, outputs not aliased to them, temps
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def cost_stats(compiled) -> dict[str, float] | None:
  """The compiler's cost analysis per device: flops, transcendentals, bytes accessed.
  XLA counts a while loop's body once (a scan over layers: one layer), whatever its trip
  count, so these are not a step's totals (`hlo_stats` counts them)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost:
    return None
  return {k.replace(" ", "_"): float(cost.get(k, 0.0))
          for k in ("flops", "transcendentals", "bytes accessed")}


def hlo_stats(compiled) -> dict | None:
  """Matmul FLOPs and HBM bytes per device from the optimized HLO, every loop body times
  its trip count (`rljax.hlo_flops`)."""
  try:
    text = compiled.as_text()
    count = hlo_flops.count(text)
  except Exception:  # pylint: disable=broad-except
    logging.error("counting the HLO failed:\n%s", traceback.format_exc())
    return None
  return {"matmul_flops_per_chip": count.flops,
          "matmul_flops_per_chip_loops_once": count.flops_loops_once,
          "kernel_flops_per_chip": count.kernel_flops,
          "bytes_per_chip": count.bytes, "bytes_per_chip_loops_once": count.bytes_loops_once,
          "loops": [[loop["op"] or loop["while"], loop["trip_count"]] for loop in count.loops],
          "bounded_loops": count.bounded_loops, "unknown_loops": count.unknown_loops,
          "conditionals": count.conditionals,
          "opaque_custom_calls": count.opaque_custom_calls,
          "mosaic_kernels": mosaic_kernels(text)}


def mosaic_kernels(text: str) -> dict[str, int]:
  """Call sites of Mosaic kernels in an optimized TPU program, by kernel (the instruction
  is named after the Pallas kernel: grouped_matmul_tpu, det_attention_tpu; the TPU's own
  ragged_dot kernels show up too)."""
  calls: dict[str, int] = {}
  for name in re.findall(r'%([\w\-]+?)(?:\.\d+)* = [^\n]*custom_call_target="tpu_custom_call"',
                         text):
    calls[name] = calls.get(name, 0) + 1
  return calls


def lower_and_compile(jitted, args: tuple, *, platform: str, mesh_size: int,
                      compile_: bool, concrete: bool = False) -> tuple[dict, Any]:
  """Lowers `jitted` on abstract args; compiles on the first mesh_size devices if it can.
  `concrete`: the args' mesh is real devices (a TPU topology's chips): lowered for them
  and compiled by their compiler, with its memory and cost analysis. Returns (report,
  the compiled program, or the lowered one where it did not compile)."""
  out: dict[str, Any] = {"lowered": False, "compiled": False}
  t0 = time.perf_counter()
  try:
    traced = jitted.trace(*args)
    lowered = traced.lower() if concrete else traced.lower(lowering_platforms=(platform,))
  except Exception as e:  # pylint: disable=broad-except
    logging.error("lowering failed:\n%s", traceback.format_exc())
    return out | {"error": f"{type(e).__name__}: {str(e)[:500]}"}, None
  out.update(lowered=True, lower_s=round(time.perf_counter() - t0, 2))
  if not compile_:
    return out | {"compile_skipped": "--nocompile"}, lowered
  if not concrete and platform != running_platform():
    return out | {"compile_skipped": f"lowered for {platform} on a "
                  f"{running_platform()} backend (--topology compiles for TPU)"}, lowered
  if not concrete and jax.device_count() < mesh_size:
    return out | {"compile_skipped": f"needs {mesh_size} devices, have "
                  f"{jax.device_count()} (--host_devices={mesh_size})"}, lowered
  t0 = time.perf_counter()
  try:
    if concrete:
      with uncached():
        compiled = lowered.compile()
    else:
      compiled = lowered.compile(device_assignment=tuple(jax.devices()[:mesh_size]))
  except Exception as e:  # pylint: disable=broad-except
    logging.error("compile failed:\n%s", traceback.format_exc())
    return out | {"compile_error": f"{type(e).__name__}: {str(e)[:500]}"}, lowered
  out.update(compiled=True, compile_s=round(time.perf_counter() - t0, 2),
             memory=memory_stats(compiled), cost=cost_stats(compiled),
             hlo=hlo_stats(compiled))
  return out, compiled
