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

import json

from absl import app, flags
import jax

from experiments import machine_info
from pallas_kernels import gpu_check
from rljax import numerics

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


def _emit(result: dict) -> None:
  print(json.dumps({**result, "machine": machine_info.machine()}, sort_keys=True))


def main(argv):
  del argv
  numerics.set_up_process("deterministic")  # the check runs both modes' references
  backend = jax.default_backend()
  if backend != "gpu" and not _INTERPRET.value:
    _emit({"skipped": "no GPU", "backend": backend,
           "hint": "run on a GPU machine, or pass --interpret for a tiny CPU smoke run"})
    return 0
  shape = dict(b=_B.value, hkv=_HKV.value, g=_G.value, d=_D.value, p=_P.value,
               length=_LEN.value, spread=_SPREAD.value, warmup=_WARMUP.value,
               iters=_ITERS.value)
  if _INTERPRET.value:  # tiny grid: interpret mode is ~600x slower than jnp
    shape = dict(b=3, hkv=2, g=2, d=16, p=16, length=40, spread=24, warmup=1, iters=3)
  result = gpu_check.check(**shape, dtype=_DTYPE.value, num_warps=_NUM_WARPS.value,
                           num_stages=_NUM_STAGES.value, seed=_SEED.value,
                           interpret=_INTERPRET.value)
  _emit(result)
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  app.run(main)
