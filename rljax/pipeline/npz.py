"""Numeric arrays plus a JSON header as one .npz object: how groups cross storage (the work
queue's results) and processes (a multi-process trainer's batch broadcast). Lossless: the
arrays' dtypes and bits are kept; strings and objects are refused (token in, token out)."""

from __future__ import annotations

import io
import json
from typing import Any, Mapping

import numpy as np

HEADER = "__header__"  # the .npz member holding the JSON header


def encode(header: Mapping[str, Any], arrays: Mapping[str, Any]) -> bytes:
  members = {}
  for name, x in arrays.items():
    if not isinstance(name, str) or not name or name == HEADER:
      raise ValueError(f"bad array name {name!r}")
    x = np.asarray(x)
    if x.dtype.kind not in "biuf":
      raise ValueError(f"array {name!r} has dtype {x.dtype}: only numeric arrays cross "
                       "(token ids, log-probs), never strings or objects")
    members[name] = x
  members[HEADER] = np.frombuffer(
      json.dumps(dict(header), sort_keys=True, allow_nan=False).encode(), np.uint8)
  buf = io.BytesIO()
  np.savez(buf, **members)
  return buf.getvalue()


def decode(raw: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(header, arrays) of `encode`'s bytes; ValueError on anything else."""
  try:
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
      header = json.loads(z[HEADER].tobytes())
      arrays = {k: z[k] for k in z.files if k != HEADER}
  except (OSError, KeyError, EOFError, UnicodeDecodeError) as e:
    raise ValueError(f"not an rljax .npz object: {type(e).__name__}: {e}") from None
  if not isinstance(header, dict):
    raise ValueError("the .npz header is not a JSON object")
  return header, arrays
