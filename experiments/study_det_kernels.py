"""The deterministic Pallas kernels (TPU's default, opt-in on GPU) on a GPU or TPU: engine =
trainer with them, and what they cost against the jnp paths they follow. One JSON object as
the last line.

    PYTHONPATH=. python experiments/study_det_kernels.py            # on the device
    .venv/bin/python experiments/study_det_kernels.py --quick       # CPU: interpret mode

Deterministic numerics (its XLA flags set before the backend starts), one process. For
each combination of `det_attention` (attention in the training forward, prefill and
decode) and `expert_kernel` (the routed tiles' matmul), "jnp" or the device's kernel
("pallas_gpu" / "pallas_tpu"; on CPU "pallas_interpret"):
  * engine = trainer: configs/tiny_moe.py (bench_numerics' params: bf16, matrices x10),
    sequences of 9..70 tokens decoded one token at a time over scrambled pages against
    the packed training forward: the max |log-prob diff|, which must be 0.0;
  * the trainer's log-probs against the all-jnp combination's (the kernels follow the jnp
    tiling; on a device their dot operands are the device's bf16, so bits may differ);
  * `--config` (default configs/sparse_moe_tiny.py): bench_numerics' train step (value and
    grad over 8 x 128 packed tokens) and decode step (32 slots x 1 token, 40 cached),
    medians of `calls` after a compile call, and their ratio to the all-jnp combination.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback

from rljax import numerics as numerics_lib


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="CPU smoke: short sequences")
  parser.add_argument("--config", default="configs/sparse_moe_tiny.py")
  args = parser.parse_args(argv)
  numerics_lib.set_up_process("deterministic")
  import jax  # pylint: disable=import-outside-toplevel  (after the flags)
  import numpy as np  # pylint: disable=import-outside-toplevel
  from configs import tiny_moe  # pylint: disable=import-outside-toplevel
  from experiments import bench_numerics as bench  # pylint: disable=import-outside-toplevel
  from experiments import device_check, machine_info  # pylint: disable=import-outside-toplevel
  from pallas_kernels import gpu_check  # pylint: disable=import-outside-toplevel
  from rljax.model import ModelConfig, scoring  # pylint: disable=import-outside-toplevel

  backend = jax.default_backend()
  kernel = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "pallas_interpret")
  det = numerics_lib.Numerics("deterministic")
  tiny = ModelConfig.from_dict(tiny_moe.get_config().model.to_dict())
  cost_cfg = device_check._load_model_config(args.config)  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  lengths = (9, 16, 33) if args.quick else (9, 16, 17, 33, 40, 51, 64, 70)
  seqs = [rng.integers(1, tiny.vocab_size, size=n) for n in lengths]
  calls = 3 if args.quick else 10
  combos = [(a, e) for a in ("jnp", kernel) for e in ("jnp", kernel)]
  out, reference = {}, None
  for attention, experts in combos:
    name = f"attention={attention},experts={experts}"
    t0 = time.perf_counter()
    try:
      cfg = dataclasses.replace(tiny, det_attention=attention, expert_kernel=experts)
      params = bench._params(cfg)  # pylint: disable=protected-access
      cfg = cfg.resolved(backend, det)
      train = scoring.packed_logprobs(params, seqs, cfg=cfg, numerics=det, row_len=128)
      decode = scoring.paged_decode_logprobs(params, seqs, cfg=cfg, numerics=det,
                                             shuffle_pages_seed=1)
      reference = train if reference is None else reference
      row = {"engine_vs_trainer_max_abs": scoring.max_abs_diff(train, decode),
             "trainer_vs_all_jnp_max_abs": scoring.max_abs_diff(train, reference)}
      if not args.quick:
        ccfg = dataclasses.replace(cost_cfg, det_attention=attention, expert_kernel=experts)
        cparams = bench._params(ccfg.resolved(backend, det))  # pylint: disable=protected-access
        for key, make in (("train_ms", bench._train_step), ("decode_ms", bench._decode_step)):  # pylint: disable=protected-access
          step = make(ccfg, det)
          row[key] = round(1e3 * gpu_check.median_seconds(lambda s=step: s(cparams), warmup=1,
                                                         iters=calls), 3)
      row["ok"] = row["engine_vs_trainer_max_abs"] == 0.0
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      row = {"error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
    row["elapsed_s"] = round(time.perf_counter() - t0, 2)
    print(f"[study_det_kernels] {name}: {row}", flush=True)
    out[name] = row
  base = out["attention=jnp,experts=jnp"]
  for row in out.values():
    for key in ("train_ms", "decode_ms"):
      if key in row and key in base:
        row[f"{key}_over_all_jnp"] = round(row[key] / base[key], 3)
  report = {"study": "det_kernels", "backend": backend,
            "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
            "workload": {"engine_vs_trainer": f"configs/tiny_moe.py, lengths {list(lengths)}",
                         "cost": f"{args.config}: train fwd+bwd 8x128 packed; decode 32 slots "
                                 f"x 1 token, 40 cached; median of {calls}"},
            "machine": machine_info.machine(), "combos": out,
            "ok": all(r["ok"] for r in out.values())}
  print(json.dumps(report), flush=True)
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
