"""The suite's XLA flags: on CPU compiling is most of what the suite costs and its programs
are tiny, so this process and every process it starts compile for speed of compiling.

* --xla_llvm_disable_expensive_passes: cold cache, test_engine 122 -> 109 s, the learning
  tests 81 -> 77 s.
* --xla_backend_optimization_level=0 (LLVM -O0): the TINY deterministic GRPO step compiles
  in 2.6 s instead of 4.9 and runs in 37 ms instead of 12 (medians of 3 and 5, AMD EPYC
  2 cores); the clean-clone suite's summed test time went 2468 -> 1842 s. -O1 was no
  use: one function compiled into two programs (plain jax.nn.log_softmax, fast numerics)
  gave different bits there, and notebook 02's exact staleness-0 check failed.
* --xla_cpu_use_fusion_emitters=false (XLA:CPU's elemental emitters instead of the MLIR
  fusion emitters): at -O0 the same step compiles in 1.2 s instead of 2.7, and runs in
  the same time (medians of 5).

What the product compiles is XLA's default (-O3, every LLVM pass). Tests whose subject is
that code generation (the FMA contraction of a fast process, the bitwise engine = trainer
check of experiments/device_check.py), and the learning runs from external starts (30
steps each: run-bound, and their bounds were measured at -O3), start their processes with
`production_env()`.
"""

import os

from rljax.numerics import with_xla_flags

COMPILE_FAST = ("--xla_llvm_disable_expensive_passes=true", "--xla_backend_optimization_level=0",
                "--xla_cpu_use_fusion_emitters=false")


def install() -> None:
  """This process and the processes it starts compile with COMPILE_FAST (before JAX's
  backend starts: XLA reads its flags once)."""
  os.environ["XLA_FLAGS"] = with_xla_flags(os.environ.get("XLA_FLAGS", ""), COMPILE_FAST)


def production_env(**overrides: str) -> dict[str, str]:
  """This process's environment for a child that compiles as the product does."""
  env = {**os.environ, **overrides}
  env["XLA_FLAGS"] = with_xla_flags(env.get("XLA_FLAGS", ""), without=COMPILE_FAST)
  return env
