"""Orbax checkpoints of the train state, with the weight-stream version they match.

The train state is any pytree of arrays, e.g. {params (f32), opt_state (optax), step}.
Each checkpoint also records `stream_version`: the weight-stream version published from
these params, so a restarted trainer restores the state, calls
`Publisher.resume(params, stream_version)` (which checks the bits against the stream) and
goes on publishing deltas exactly where the stream left off.

Saves are asynchronous (the arrays are copied off the device, then written in the
background; `wait()` blocks until the last save is durable) and only the newest
`keep_last` checkpoints are kept. `restore` takes a target tree of arrays or
`jax.ShapeDtypeStruct`s whose shardings say where each leaf goes, so a checkpoint saved on
one mesh restores onto another.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_STATE, _META = "state", "meta"


@dataclasses.dataclass(frozen=True)
class Restored:
  state: Any
  step: int
  stream_version: int | None
  extra: dict = dataclasses.field(default_factory=dict)  # `save`'s, JSON


def abstract_like(tree: Any, shardings: Any = None) -> Any:
  """Arrays (or ShapeDtypeStructs) -> ShapeDtypeStructs with `shardings` (a matching tree
  of jax.sharding.Sharding), or with each leaf's own sharding when None."""
  def one(x, sharding=None):
    if not hasattr(x, "dtype"):
      raise TypeError(f"train-state leaves must be arrays, got {type(x)}")
    if sharding is None:
      sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

  if shardings is None:
    return jax.tree.map(one, tree)
  return jax.tree.map(one, tree, shardings)


class Checkpointer:
  """Numbered checkpoints of a train state under one directory (local path or gs://)."""

  def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3,
               async_save: bool = True):
    if keep_last < 1:
      raise ValueError("keep_last must be >= 1")
    self.directory = directory if str(directory).startswith("gs://") else os.path.abspath(
        directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep_last, create=True,
                                             enable_async_checkpointing=async_save),
        item_names=(_STATE, _META))

  def save(self, step: int, state: Any, *, stream_version: int | None,
           extra: dict | None = None) -> None:
    """Starts saving `state` as checkpoint `step` (returns once the arrays are copied);
    `extra`: what else a restart needs, JSON (e.g. a loop's counters)."""
    meta = {"step": int(step), "stream_version": stream_version, "extra": extra or {}}
    saved = self._manager.save(int(step), args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)}))
    if not saved:
      raise ValueError(f"checkpoint {step} was not saved (an older or equal step exists?)")

  def wait(self) -> None:
    """Blocks until every save started so far is on disk."""
    self._manager.wait_until_finished()

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore(self, target: Any, step: int | None = None) -> Restored:
    """Restores checkpoint `step` (the latest if None) into the structure, dtypes and
    shardings of `target` (arrays or ShapeDtypeStructs)."""
    self.wait()
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    out = self._manager.restore(step, args=ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(abstract_like(target)), _META: ocp.args.JsonRestore()}))
    meta = out[_META]
    return Restored(state=out[_STATE], step=int(meta["step"]),
                    stream_version=meta["stream_version"], extra=meta.get("extra") or {})

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
