"""XLA's persistent compilation cache for the entry points.

A program compiled once on this machine (the same jax, XLA flags, shapes and shardings)
is loaded from disk the next time instead of compiled again: a rerun of an experiment, a
rollout host restarted by a kill drill, the second seed of a study. The entry points call
`enable_from_flags()` first in `main`:

  --compile_cache_dir=DIR   where (default ~/.cache/rljax/xla; a gs:// path works too, for
                            hosts that share it); empty: off

An environment that already names a cache (`JAX_COMPILATION_CACHE_DIR`, e.g. the test
suite's) keeps it. Deterministic and fast processes never share entries: XLA_FLAGS are
part of the key.
"""

from __future__ import annotations

import os

from absl import flags
import jax

_DIR = flags.DEFINE_string(
    "compile_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "rljax", "xla"),
    "XLA's persistent compilation cache (empty: off)")


def enable(directory: str | None) -> str | None:
  """Turns the cache on at `directory` (None or empty: off) unless the environment names
  one; returns the directory in use."""
  env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if env:
    return env
  if not directory:
    return None
  jax.config.update("jax_compilation_cache_dir", directory)
  return directory


def enable_from_flags() -> str | None:
  """`enable(--compile_cache_dir)` (call after absl parsed the flags, in `main`)."""
  return enable(_DIR.value)
