"""rljax: RL post-training of Mixture-of-Experts language models in JAX.

Importing rljax installs the XLA flags that deterministic numerics needs (see
`rljax.numerics`). They must be in the environment before JAX creates its CPU
backend, so import rljax before the first JAX computation.
"""

import os as _os
import sys as _sys

# --xla_cpu_max_isa=AVX: LLVM contracts a*b+c into an FMA inside XLA:CPU fusions, so
#   the bits of an elementwise chain depend on where fusion boundaries fall (they differ
#   between a training graph and a decode graph). AVX has no FMA instructions. The bf16
#   dots (YNNPACK) are unaffected; measured cost on fast-mode code is within noise.
# --xla_allow_excess_precision=false: keep every explicit bf16 rounding point.
# --xla_cpu_experimental_ynn_fusion_type=individual_dot: XLA:CPU otherwise fuses a dot's
#   elementwise producers/consumers into one YNNPACK fusion whose bf16 handling differs
#   from the unfused ops (seen: the LM head fused with the final RMSNorm when only target
#   log-probs are returned moved log-probs by 1e-2). Dots stay single library calls.
REQUIRED_XLA_FLAGS = ("--xla_cpu_max_isa=AVX", "--xla_allow_excess_precision=false",
                      "--xla_cpu_experimental_ynn_fusion_type=individual_dot")


def _install_xla_flags() -> bool:
  """Adds REQUIRED_XLA_FLAGS to XLA_FLAGS; returns whether they can still take effect."""
  flags = _os.environ.get("XLA_FLAGS", "")
  for flag in REQUIRED_XLA_FLAGS:
    if flag.split("=")[0] not in flags:
      flags = f"{flags} {flag}".strip()
  _os.environ["XLA_FLAGS"] = flags
  if "jax" in _sys.modules:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return not xla_bridge.backends_are_initialized()
  return True


XLA_FLAGS_ACTIVE = _install_xla_flags()
