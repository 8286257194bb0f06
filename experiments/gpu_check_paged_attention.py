"""GPU check of the decode paged-attention kernel: correctness, time, HBM bandwidth.

One command on a GPU machine:

    .venv/bin/python experiments/gpu_check_paged_attention.py

builds a decode workload (default B=64, Hkv=8, G=4, D=128, P=16, lengths ~2048, bf16,
pages scrambled over the pool), runs the Pallas kernel natively (Triton), checks it
against the jnp reference (`attend`, deterministic mode: the same bf16 rounding points
for p) and the fast-mode reference, both reading only live pages (dead table entries ->
the null page, table cut to the longest row), times kernel and references (warmup,
median of N; the speed-up is against the fast reference),
and prints achieved HBM bandwidth = bytes the kernel must read and write (the K and V
pages of the valid blocks, q, out, lengths and the page-table entries used) / median
time. Last line: one JSON object. Exit status 1 if the check fails.

Without a GPU it prints {"skipped": "no GPU"}; `--interpret` runs a tiny smoke version
in Pallas interpret mode on CPU instead (its times are meaningless).
"""

import rljax  # noqa: F401  (XLA flags first)

import json
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import machine_info
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

_B = flags.DEFINE_integer("batch", 64, "sequences (one query token each)")
_HKV = flags.DEFINE_integer("kv_heads", 8, "KV heads")
_G = flags.DEFINE_integer("group", 4, "query heads per KV head")
_D = flags.DEFINE_integer("head_dim", 128, "head dim (power of two for Triton)")
_P = flags.DEFINE_integer("page_size", 16, "keys per page = KV block")
_LEN = flags.DEFINE_integer("length", 2048, "max keys per sequence")
_SPREAD = flags.DEFINE_integer("spread", 128, "lengths uniform in [length - spread, length]")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q/K/V dtype")
_WARMUP = flags.DEFINE_integer("warmup", 5, "untimed calls")
_ITERS = flags.DEFINE_integer("iters", 50, "timed calls (median reported)")
_NUM_WARPS = flags.DEFINE_integer("num_warps", 4, "Triton num_warps")
_NUM_STAGES = flags.DEFINE_integer("num_stages", 2, "Triton num_stages")
_INTERPRET = flags.DEFINE_bool("interpret", False, "tiny smoke run in interpret mode (CPU)")
_SEED = flags.DEFINE_integer("seed", 0, "data seed")

# Nominal HBM bandwidth, GB/s, to report a fraction of peak when the device is known.
_PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}


def _emit(result: dict) -> None:
  print(json.dumps({**result, "machine": machine_info.machine()}, sort_keys=True))


def _time(fn, warmup: int, iters: int) -> float:
  """Median seconds per call (each call synchronised)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _workload(b, hkv, g, d, p, length, spread, dtype, seed):
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


def _bytes_moved(q, k, lengths, p) -> int:
  """HBM bytes the kernel needs: valid blocks' K and V pages, q, out, scalars."""
  itemsize = jnp.dtype(k.dtype).itemsize
  blocks = int(np.sum(-(-np.asarray(lengths) // p)))
  hkv, d = k.shape[2], k.shape[3]
  kv_bytes = 2 * blocks * p * hkv * d * itemsize
  q_out_bytes = 2 * q.size * jnp.dtype(q.dtype).itemsize
  scalar_bytes = 4 * (lengths.size + blocks * hkv)  # each (b, h) program reads its table
  return kv_bytes + q_out_bytes + scalar_bytes


def main(argv):
  del argv
  backend = jax.default_backend()
  interpret = _INTERPRET.value
  if backend != "gpu" and not interpret:
    _emit({"skipped": "no GPU", "backend": backend,
           "hint": "run on a GPU machine, or pass --interpret for a tiny CPU smoke run"})
    return 0
  if interpret:  # tiny grid: interpret mode is ~600x slower than jnp
    b, hkv, g, d, p, length, spread = 3, 2, 2, 16, 16, 40, 24
    warmup, iters = 1, 3
  else:
    b, hkv, g, d, p = _B.value, _HKV.value, _G.value, _D.value, _P.value
    length, spread, warmup, iters = _LEN.value, _SPREAD.value, _WARMUP.value, _ITERS.value
  dtype = jnp.dtype(_DTYPE.value)
  scale = d ** -0.5
  q, k, v, table, lengths = _workload(b, hkv, g, d, p, length, spread, dtype, _SEED.value)

  def kernel():
    return paged_attention(q, k, v, table, lengths, scale=scale, interpret=interpret,
                           num_warps=_NUM_WARPS.value, num_stages=_NUM_STAGES.value)

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

  t_kernel = _time(kernel, warmup, iters)
  t_ref_fast = _time(reference("fast"), warmup, iters)
  t_ref_det = _time(reference("deterministic"), warmup, iters)
  moved = _bytes_moved(q, k, lengths, p)
  gbps = moved / t_kernel / 1e9
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", str(device))
  peak = next((v for name, v in _PEAK_GBPS.items() if name in kind), None)
  result = {
      "device": kind, "backend": backend, "interpret": interpret, "ok": ok,
      "shape": {"batch": b, "kv_heads": hkv, "group": g, "head_dim": d, "page_size": p,
                "max_length": length, "mean_length": float(np.mean(np.asarray(lengths))),
                "dtype": dtype.name},
      "triton": {"num_warps": _NUM_WARPS.value, "num_stages": _NUM_STAGES.value},
      "max_abs_err_vs_ref_det": err_det, "max_abs_err_vs_ref_fast": err_fast,
      "tolerance": {"atol": atol, "rtol": rtol},
      "kernel_ms": t_kernel * 1e3, "ref_fast_ms": t_ref_fast * 1e3,
      "ref_det_ms": t_ref_det * 1e3, "speedup_vs_ref_fast": t_ref_fast / t_kernel,
      "bytes_moved": moved, "hbm_gbps": gbps,
      "hbm_peak_fraction": gbps / peak if peak else None,
  }
  _emit(result)
  return 0 if ok else 1


if __name__ == "__main__":
  app.run(main)
