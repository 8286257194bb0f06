"""The paged-attention kernel checked and timed on a device (run by
`experiments/gpu_check_paged_attention.py`): correctness against the jnp reference in both
numerics modes, kernel and reference times, achieved HBM bandwidth.

The references read only live pages, as the kernel does, so the speed-up is against a
reference that reads what the kernel reads.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

# Nominal HBM bandwidth, GB/s, to report a fraction of peak when the device is known.
_PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}


def median_seconds(fn, warmup: int, iters: int) -> float:
  """Median seconds per call (each call synchronised)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def workload(b, hkv, g, d, p, length, spread, dtype, seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(1, length - spread), length + 1, size=b).astype(np.int32)
  max_blocks = -(-length // p)
  num_pages = 1 + b * max_blocks  # page 0: the null page
  table = (1 + rng.permutation(b * max_blocks)).reshape(b, max_blocks).astype(np.int32)
  key = jax.random.key(seed)
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (b, hkv * g, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (num_pages, p, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (num_pages, p, hkv, d), jnp.float32).astype(dtype)
  return q, k, v, jnp.asarray(table), jnp.asarray(lengths)


def bytes_moved(q, k, lengths, p) -> int:
  """HBM bytes the kernel needs: valid blocks' K and V pages, q, out, scalars."""
  itemsize = jnp.dtype(k.dtype).itemsize
  blocks = int(np.sum(-(-np.asarray(lengths) // p)))
  hkv, d = k.shape[2], k.shape[3]
  kv_bytes = 2 * blocks * p * hkv * d * itemsize
  q_out_bytes = 2 * q.size * jnp.dtype(q.dtype).itemsize
  scalar_bytes = 4 * (lengths.size + blocks * hkv)  # each (b, h) program reads its table
  return kv_bytes + q_out_bytes + scalar_bytes


def check(*, b: int, hkv: int, g: int, d: int, p: int, length: int, spread: int,
          dtype: str = "bfloat16", warmup: int = 5, iters: int = 50, num_warps: int = 4,
          num_stages: int = 2, seed: int = 0, interpret: bool = False) -> dict:
  """One decode workload (B sequences, Hkv x G query heads, head dim D, page size P,
  lengths uniform in [length - spread, length], pages scrambled over the pool): the
  kernel against both references, their median times, bytes moved / kernel time."""
  backend = jax.default_backend()
  dtype = jnp.dtype(dtype)
  scale = d ** -0.5
  q, k, v, table, lengths = workload(b, hkv, g, d, p, length, spread, dtype, seed)

  def kernel():
    return paged_attention(q, k, v, table, lengths, scale=scale, interpret=interpret,
                           num_warps=num_warps, num_stages=num_stages)

  # The references read only live pages, as the kernel does: each row's blocks past its
  # length point at the null page 0 (one page, cache-resident), and the table is cut to
  # the longest row's block count (what the engine's attend_paged gathers). Masked blocks
  # are exact no-ops, so the results are those over the whole table.
  live_blocks = -(-lengths // p)
  width = int(jnp.max(live_blocks))
  live_table = jnp.where(jnp.arange(table.shape[1])[None, :] < live_blocks[:, None], table,
                         0)[:, :width]

  def reference(mode):
    return lambda: paged_attention_reference(q, k, v, live_table, lengths, scale=scale,
                                             numerics=mode)

  out = np.asarray(kernel().astype(jnp.float32))
  ref_det = np.asarray(reference("deterministic")().astype(jnp.float32))
  ref_fast = np.asarray(reference("fast")().astype(jnp.float32))
  vmax = float(jnp.max(jnp.abs(v.astype(jnp.float32))))
  if dtype == jnp.bfloat16:
    # p is rounded to bf16 before p @ v (kernel and deterministic reference alike);
    # vs a reference whose p rounds differently: 2^-9 * max|v| + the two output roundings.
    atol, rtol = 2**-9 * vmax, 2**-7
  else:
    # f32 dots are IEEE in the kernel (precision=HIGHEST) but the reference's einsums run
    # at XLA's default GPU precision (TF32 on Ampere+), hence the loose f32 tolerance.
    atol, rtol = 1e-2, 1e-2
  err_det = float(np.max(np.abs(out - ref_det)))
  err_fast = float(np.max(np.abs(out - ref_fast)))
  ok = bool(np.all(np.isfinite(out))
            and np.all(np.abs(out - ref_det) <= atol + rtol * np.abs(ref_det))
            and np.all(np.abs(out - ref_fast) <= atol + rtol * np.abs(ref_fast)))

  t_kernel = median_seconds(kernel, warmup, iters)
  t_ref_fast = median_seconds(reference("fast"), warmup, iters)
  t_ref_det = median_seconds(reference("deterministic"), warmup, iters)
  moved = bytes_moved(q, k, lengths, p)
  gbps = moved / t_kernel / 1e9
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", str(device))
  peak = next((v for name, v in _PEAK_GBPS.items() if name in kind), None)
  result = {
      "device": kind, "backend": backend, "interpret": interpret, "ok": ok,
      "shape": {"batch": b, "kv_heads": hkv, "group": g, "head_dim": d, "page_size": p,
                "max_length": length, "mean_length": float(np.mean(np.asarray(lengths))),
                "dtype": dtype.name},
      "triton": {"num_warps": num_warps, "num_stages": num_stages},
      "max_abs_err_vs_ref_det": err_det, "max_abs_err_vs_ref_fast": err_fast,
      "tolerance": {"atol": atol, "rtol": rtol},
      "kernel_ms": t_kernel * 1e3, "ref_fast_ms": t_ref_fast * 1e3,
      "ref_det_ms": t_ref_det * 1e3, "speedup_vs_ref_fast": t_ref_fast / t_kernel,
      "bytes_moved": moved, "hbm_gbps": gbps,
      "hbm_peak_fraction": gbps / peak if peak else None,
  }
  return result
