"""One command on a GPU or TPU machine (and a smoke run on CPU): the Pallas kernels, engine
= trainer, and the cost of deterministic numerics. Prints progress lines (each section's
elapsed seconds), then, as its last line, one JSON object; exit status 1 unless "ok".

    PYTHONPATH=. .venv/bin/python experiments/device_check.py    # GPU / TPU: all sections
    .venv/bin/python experiments/device_check.py --quick         # CPU smoke run (the test's)

Each section is wrapped: one that raises is {"error": "..."} in the JSON and the others
still run; "ok" is true only if no section failed (a skipped one is listed in "skipped").
`--sections` picks some of them.

1. platform: backend, device kind and count, jax and jaxlib versions,
   `machine_info.machine()`.
2. grouped_matmul: `pallas_kernels.grouped_matmul` natively (Triton on a GPU, Mosaic on a
   TPU; on CPU the GPU path in interpret mode) vs `grouped_matmul_reference`; bf16
   standard-normal values, tiles sorted by expert, every expert used.
   * small (r 16, D 64, E 4, F 256, N 40 tiles): max |kernel - reference| against the
     summation bound 2 D 2^-24 (|xs| @ |w|) per element (the kernel's tests' bound: both
     sum the same D exact bf16 products in f32), reported as the largest diff / bound (<= 1
     passes: a tensor-core or MXU accumulation outside it shows here); batch invariance,
     bitwise: the first tile with N = 1, the first 5 with N = 5, and all 40 in a permuted
     order give the N = 40 call's bits.
   * qwen3_30b_a3b (not on CPU): one MoE layer of Qwen3-30B-A3B, D 2048, F 768, E 128,
     r 32, 4096 tokens x top-8 -> N = 4096 * 8 / 32 + 128 = 1152 tiles: the same bound (the
     reference in chunks of 128 tiles), the permuted order bitwise, the median of 10
     calls (--quick: 3) after 2 warm-ups, TFLOP/s = 2 N r D F / time and weight GB/s =
     E D F x 2 bytes (every expert's weights read once) / time. On a GPU the whole-K
     block (an [r, D] and a [D, 128] tile at once) overflows shared memory at D 2048, so
     it runs with the kernel's K loop: the first `block_k` of 256, 128, 64 that compiles.
3. paged_attention: `pallas_kernels.gpu_check.check` (the decode kernel vs both jnp
   references reading live pages, kernel and reference times, achieved HBM GB/s): on a GPU
   at B 64, Hkv 8, G 4, D 128, P 16, lengths 1920..2048, bf16, 50 timed calls (--quick:
   10) after 5; on CPU in interpret mode at a tiny shape; on a TPU "not available" (the
   kernel is Triton-only).
4. engine_vs_trainer: configs/tiny_moe.py, `bench_numerics._decode_vs_train` (its params:
   bf16, matrices x10): 8 sequences of 9..70 tokens (--quick: 4 of 9..33) decoded one
   token at a time over scrambled pages vs the packed training forward; the max |log-prob
   diff| must be 0.0 in deterministic mode; the fast-mode figure is for reference.
5. det_fast_cost: `--config` (default configs/sparse_moe_tiny.py), bench_numerics'
   `_train_step` (value_and_grad over 8 x 128 packed tokens) and `_decode_step` (32 slots x
   1 token, 40 cached): median of 10 calls (--quick: 3) after a compile call, det over
   fast. Each mode runs with its own backend choices (`resolved`, reported).

Sections 4 and 5 run first, in two child processes of this script (`sys.executable`), one
per numerics mode, one after the other: the deterministic XLA flags are process-wide and
read when the backend starts, so each child calls `rljax.numerics.set_up_process(mode)`
first and the fast one starts without them. This process starts its own backend only
after them (a TPU is one process's at a time; a GPU's memory is preallocated by the
process holding it) and takes the deterministic flags (the paged-attention check runs the
deterministic reference, as `gpu_check_paged_attention.py` does); off CPU only
`--xla_allow_excess_precision=false` of them applies.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback

import jax
from jax import lax
import jax.numpy as jnp
import jaxlib
import numpy as np

from configs import tiny_moe
from experiments import bench_numerics as bench
from experiments import machine_info
from pallas_kernels import gpu_check
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from rljax import numerics as numerics_lib
from rljax.model import ModelConfig

SECTIONS = ("platform", "grouped_matmul", "paged_attention", "engine_vs_trainer",
            "det_fast_cost")
CHILD_SECTIONS = ("engine_vs_trainer", "det_fast_cost")
MODES = ("deterministic", "fast")
DECODE_LENGTHS = {False: (9, 16, 17, 33, 40, 51, 64, 70), True: (9, 16, 17, 33)}
STEP_CALLS = {False: 10, True: 3}
CHILD_TIMEOUT_S = 300

GMM_SMALL = dict(n=40, r=16, d=64, e=4, f=256)
GMM_QWEN3 = dict(n=4096 * 8 // 32 + 128, r=32, d=2048, e=128, f=768)
GMM_CHUNK = 128  # tiles per reference chunk at the big shape (f32 gathered weights: 0.8 GB)
GPU_BLOCK_K = (256, 128, 64)
PAGED_GPU = dict(b=64, hkv=8, g=4, d=128, p=16, length=2048, spread=128, warmup=5, iters=50)
PAGED_TINY = dict(b=3, hkv=2, g=2, d=16, p=16, length=40, spread=24, warmup=1, iters=3)


def _log(msg: str) -> None:
  print(f"[device_check] {msg}", flush=True)


def _guarded(fn) -> dict:
  """fn() -> dict; an exception becomes {"error": ...} (its traceback on stderr)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    return {"error": f"{type(e).__name__}: {e}"}


def _status(result: dict) -> str:
  for key in ("error", "skipped"):
    if key in result:
      return key
  return f"ok={result['ok']}" if "ok" in result else "done"


def _run_section(name: str, fn) -> dict:
  """_guarded(fn), timed (elapsed_s), with a progress line before and after."""
  _log(f"{name} ...")
  t0 = time.perf_counter()
  result = _guarded(fn)
  result["elapsed_s"] = round(time.perf_counter() - t0, 2)
  _log(f"{name}: {_status(result)} ({result['elapsed_s']} s)")
  return result


def _failed(result: dict) -> bool:
  return "error" in result or result.get("ok") is False


# -- 1. platform -------------------------------------------------------------------------


def _platform() -> dict:
  devices = jax.devices()
  return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind,
          "device_count": len(devices), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "machine": machine_info.machine(), "ok": True}


# -- 2. grouped matmul -------------------------------------------------------------------


def _gmm_case(n, r, d, e, f, seed=0):
  """xs [n, r, d], w [e, d, f] bf16 standard normal; tile_expert [n] sorted, all e used."""
  rng = np.random.default_rng(seed)
  tile_expert = np.sort(np.concatenate([np.arange(e), rng.integers(0, e, n - e)]))
  kx, kw = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(kx, (n, r, d), jnp.bfloat16),
          jax.random.normal(kw, (e, d, f), jnp.bfloat16),
          jnp.asarray(tile_expert, jnp.int32))


def _gmm_call(**kernel_kw):
  """The kernel on this platform: native on GPU / TPU, the GPU path interpreted on CPU."""
  platform = jax.default_backend()
  kw = {"gpu": dict(backend="gpu"), "tpu": dict(backend="tpu")}.get(
      platform, dict(backend="gpu", interpret=True))
  return lambda xs, w, te: grouped_matmul(xs, w, te, **kw, **kernel_kw)


@jax.jit
def _diff_over_bound(xs, w, te, out):
  """(max |out - ref|, max of |out - ref| / (2 D 2^-24 (|xs| @ |w|))) over the tiles."""
  with jax.default_matmul_precision("highest"):  # f32 reference dots: no TF32, no bf16 passes
    diff = jnp.abs(out - grouped_matmul_reference(xs, w, te))
    bound = 2 * xs.shape[2] * 2.0**-24 * grouped_matmul_reference(jnp.abs(xs), jnp.abs(w), te)
  ratio = jnp.where(diff == 0, 0.0, diff / bound)  # bound 0 with diff > 0: inf
  return jnp.max(diff), jnp.max(ratio)


def _accuracy(xs, w, te, out, chunk) -> dict:
  maxima = [_diff_over_bound(xs[s:s + chunk], w, te[s:s + chunk], out[s:s + chunk])
            for s in range(0, xs.shape[0], chunk)]
  diff, ratio = (max(float(m[i]) for m in maxima) for i in (0, 1))
  return {"max_abs_diff": diff, "max_diff_over_bound": ratio,
          "bound": "2 * D * 2^-24 * (|xs| @ |w|) per element", "within_bound": ratio <= 1.0}


def _same_bits(a, b) -> bool:
  return bool(jnp.array_equal(lax.bitcast_convert_type(a, jnp.uint32),
                              lax.bitcast_convert_type(b, jnp.uint32)))


def _gmm_small() -> dict:
  xs, w, te = _gmm_case(**GMM_SMALL)
  run = _gmm_call()
  out = run(xs, w, te)
  perm = jnp.asarray(np.random.default_rng(1).permutation(xs.shape[0]))
  invariance = {
      "n1": _same_bits(run(xs[:1], w, te[:1]), out[:1]),
      "n5": _same_bits(run(xs[:5], w, te[:5]), out[:5]),
      "permuted": _same_bits(run(xs[perm], w, te[perm]), out[perm]),
  }
  accuracy = _accuracy(xs, w, te, out, xs.shape[0])
  bitwise = all(invariance.values())
  return {"shape": GMM_SMALL, **accuracy, "batch_invariance": invariance,
          "batch_invariant_bitwise": bitwise, "ok": bitwise and accuracy["within_bound"]}


def _gmm_kernel_for_big(xs, w, te) -> tuple:
  """(kernel, its block_k or None, errors of the block_k that did not compile)."""
  if jax.default_backend() != "gpu":
    return _gmm_call(), None, {}
  errors = {}
  for block_k in GPU_BLOCK_K:
    run = _gmm_call(block_k=block_k)
    try:
      jax.block_until_ready(run(xs, w, te))
      return run, block_k, errors
    except Exception as e:  # pylint: disable=broad-except
      errors[block_k] = f"{type(e).__name__}: {str(e)[:300]}"
  raise RuntimeError(f"no block_k of {GPU_BLOCK_K} compiled: {errors}")


def _gmm_big(iters: int) -> dict:
  s = GMM_QWEN3
  xs, w, te = _gmm_case(**s)
  run, block_k, failed = _gmm_kernel_for_big(xs, w, te)
  out = run(xs, w, te)
  perm = jnp.asarray(np.random.default_rng(1).permutation(s["n"]))
  permuted = _same_bits(run(xs[perm], w, te[perm]), out[perm])
  accuracy = _accuracy(xs, w, te, out, GMM_CHUNK)
  t = gpu_check.median_seconds(lambda: run(xs, w, te), warmup=2, iters=iters)
  weight_bytes = s["e"] * s["d"] * s["f"] * 2
  return {"shape": s, "dtype": "bfloat16", "block_k": block_k, "block_k_failed": failed,
          **accuracy, "permuted_bitwise": permuted, "ms": round(1e3 * t, 3),
          "tflops": round(2 * s["n"] * s["r"] * s["d"] * s["f"] / t / 1e12, 2),
          "weight_bytes": weight_bytes, "weight_gbps": round(weight_bytes / t / 1e9, 1),
          "ok": permuted and accuracy["within_bound"]}


def _grouped_matmul(quick: bool) -> dict:
  small = _run_section("grouped_matmul.small", _gmm_small)
  if jax.default_backend() == "cpu":
    big = {"skipped": "CPU (interpret mode): device only"}
  else:
    big = _run_section("grouped_matmul.qwen3_30b_a3b", lambda: _gmm_big(3 if quick else 10))
  return {"small": small, "qwen3_30b_a3b": big,
          "batch_invariant_bitwise": small.get("batch_invariant_bitwise", False),
          "ok": not (_failed(small) or _failed(big))}


# -- 3. paged attention ------------------------------------------------------------------


def _paged_attention(quick: bool) -> dict:
  platform = jax.default_backend()
  if platform == "tpu":
    return {"skipped": "not available on tpu: the repo's decode kernel is Triton-only"}
  if platform == "gpu":
    return gpu_check.check(**{**PAGED_GPU, **(dict(iters=10) if quick else {})})
  return gpu_check.check(**PAGED_TINY, interpret=True)


# -- 4 and 5: per-mode children ----------------------------------------------------------


def _load_model_config(spec: str) -> ModelConfig:
  """"path.py[:arg]" -> its get_config([arg]).model as a ModelConfig (not resolved)."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("device_check_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg) if arg else module.get_config()
  return ModelConfig.from_dict(config.model.to_dict())


def _resolved(cfg: ModelConfig, mode: str):
  """cfg with this backend's and mode's choices, and those choices."""
  cfg = cfg.resolved(jax.default_backend(), mode)
  paths = {f: getattr(cfg, f) for f in ("train_experts", "engine_experts", "expert_kernel",
                                         "decode_attention", "det_attention", "dtype")}
  return cfg, paths


def _engine_vs_trainer(mode: str, quick: bool) -> dict:
  cfg, paths = _resolved(ModelConfig.from_dict(tiny_moe.get_config().model.to_dict()), mode)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(1, cfg.vocab_size, size=n) for n in DECODE_LENGTHS[quick]]
  diff = bench._decode_vs_train(cfg, bench._params(cfg), numerics_lib.Numerics(mode), seqs)
  return {"max_abs_logprob_diff": diff, "paths": paths}


def _step_ms(make, cfg, params, mode: str, calls: int) -> float:
  step = make(cfg, numerics_lib.Numerics(mode))
  return 1e3 * gpu_check.median_seconds(lambda: step(params), warmup=1, iters=calls)


def _step_costs(mode: str, spec: str, quick: bool) -> dict:
  cfg, paths = _resolved(_load_model_config(spec), mode)
  params = bench._params(cfg)
  calls = STEP_CALLS[quick]
  return {"train_ms": _step_ms(bench._train_step, cfg, params, mode, calls),
          "decode_ms": _step_ms(bench._decode_step, cfg, params, mode, calls),
          "calls": calls, "paths": paths}


def _child_main(mode: str, args) -> None:
  """In a child process: this mode's parts of sections 4 and 5, then one JSON line."""
  parts = {"engine_vs_trainer": lambda: _engine_vs_trainer(mode, args.quick),
           "det_fast_cost": lambda: _step_costs(mode, args.config, args.quick)}
  out = {name: _run_section(f"{name} [{mode} child]", parts[name])
         for name in args.sections if name in parts}
  out["det_xla_flags"] = numerics_lib.deterministic_xla_flags_set()
  print(json.dumps(out), flush=True)


def _child_env(mode: str) -> dict:
  env = dict(os.environ)
  if mode == "fast":  # this process installed the deterministic flags: not for the child
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if f not in numerics_lib.DETERMINISTIC_XLA_FLAGS)
  return env


def _run_child(mode: str, args, sections) -> dict:
  """This script as a `mode` child; its last stdout line as JSON (its progress re-logged)."""
  cmd = [sys.executable, os.path.abspath(__file__), f"--child={mode}",
         f"--config={args.config}", f"--sections={','.join(sections)}"]
  cmd += ["--quick"] if args.quick else []
  proc = subprocess.run(cmd, env=_child_env(mode), capture_output=True, text=True,
                        timeout=CHILD_TIMEOUT_S, check=False)
  lines = proc.stdout.strip().splitlines()
  for line in lines[:-1]:
    print(f"  {line}", flush=True)
  if proc.returncode or not lines:
    raise RuntimeError(f"{mode} child exited {proc.returncode}: {proc.stderr[-1500:]}")
  out = json.loads(lines[-1])
  if out.pop("det_xla_flags") != (mode == "deterministic"):
    raise RuntimeError(f"{mode} child ran with the wrong XLA flags")
  return out


def _children(args, sections) -> dict:
  """{mode: the child's JSON, or {section: {"error": ...}} if the child failed}."""
  out = {}
  for mode in MODES:
    result = _run_section(f"{mode} child", lambda m=mode: _run_child(m, args, sections))
    if "error" in result:
      result = {name: {"error": result["error"]} for name in sections}
    out[mode] = result
  return out


def _child_sections(args, sections) -> dict:
  """Sections 4 and 5 from the two children's parts; elapsed_s: the children's, summed."""
  children = _children(args, sections)
  combine = {"engine_vs_trainer": _engine_section,
             "det_fast_cost": lambda c: _cost_section(c, args.config)}
  out = {}
  for name in sections:
    result = _guarded(lambda n=name: combine[n](children))
    result["elapsed_s"] = round(sum(children[m][name].get("elapsed_s", 0.0) for m in MODES), 2)
    _log(f"{name}: {_status(result)} ({result['elapsed_s']} s in the two children)")
    out[name] = result
  return out


def _engine_section(children: dict) -> dict:
  per_mode = {m: children[m]["engine_vs_trainer"] for m in MODES}
  bad = {m: r["error"] for m, r in per_mode.items() if "error" in r}
  det = per_mode["deterministic"].get("max_abs_logprob_diff")
  return {"workload": "configs/tiny_moe.py: paged one-token decode vs packed training forward",
          "deterministic_max_abs_logprob_diff": det,
          "fast_max_abs_logprob_diff": per_mode["fast"].get("max_abs_logprob_diff"),
          "paths": {m: r.get("paths") for m, r in per_mode.items()},
          **({"error": str(bad)} if bad else {}), "ok": det == 0.0}


def _cost_section(children: dict, config: str) -> dict:
  per_mode = {m: children[m]["det_fast_cost"] for m in MODES}
  bad = {m: r["error"] for m, r in per_mode.items() if "error" in r}
  if bad:
    return {"error": str(bad)}
  det, fast = per_mode["deterministic"], per_mode["fast"]
  ratio = lambda k: round(det[k] / fast[k], 3)  # noqa: E731
  return {"workload": f"{config}: train fwd+bwd 8x128 packed; decode 32 slots x 1 token, "
                      "40 cached; medians after a compile call",
          "separate_processes": True,
          "det_over_fast_train_step": ratio("train_ms"),
          "det_over_fast_decode_step": ratio("decode_ms"),
          "train_step_ms": {m: round(per_mode[m]["train_ms"], 3) for m in MODES},
          "decode_step_ms": {m: round(per_mode[m]["decode_ms"], 3) for m in MODES},
          "calls": det["calls"], "paths": {m: per_mode[m]["paths"] for m in MODES},
          "ok": True}


# -- main --------------------------------------------------------------------------------


def _parse(argv) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  parser.add_argument("--config", default="configs/sparse_moe_tiny.py",
                      help="config file (path[:arg]) of the det/fast cost section")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {','.join(SECTIONS)}")
  parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.sections = [s for s in args.sections.split(",") if s]
  unknown = set(args.sections) - set(SECTIONS)
  if unknown:
    parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
  return args


def main(argv=None) -> int:
  args = _parse(argv)
  if args.child:
    numerics_lib.set_up_process(args.child)
    _child_main(args.child, args)
    return 0
  numerics_lib.set_up_process("deterministic")  # before the backend starts: see docstring
  t0 = time.perf_counter()
  report = {}
  child_sections = [s for s in CHILD_SECTIONS if s in args.sections]
  if child_sections:  # first: this process starts its backend after them (a TPU is one
    report.update(_child_sections(args, child_sections))  # process's; GPU memory too)
  local = {"platform": _platform,
           "grouped_matmul": lambda: _grouped_matmul(args.quick),
           "paged_attention": lambda: _paged_attention(args.quick)}
  for name in args.sections:
    if name in local:
      report[name] = _run_section(name, local[name])
  report = {name: report[name] for name in SECTIONS if name in report}
  failed = [name for name, r in report.items() if _failed(r)]
  report.update(ok=not failed, failed=failed, quick=args.quick,
                skipped=[name for name, r in report.items() if "skipped" in r],
                elapsed_s=round(time.perf_counter() - t0, 2))
  print(json.dumps(report), flush=True)
  return 0 if not failed else 1


if __name__ == "__main__":
  sys.exit(main())
