"""Reading a lowered Pallas TPU kernel in tests: the Mosaic module a tpu_custom_call carries."""

import base64
import re


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
