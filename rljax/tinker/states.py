"""Saved training states of Tinker clients (`save_state` / `load_state`): the adapters and
AdamW's state as orbax checkpoints (`rljax.checkpoint.Checkpointer`) under one root, named
by their tinker:// paths (`tinker://<model_id>/weights/<name>`)."""

from __future__ import annotations

import json
import os
import re
import shutil

from rljax.checkpoint import Checkpointer
from rljax.tinker.training import LoraTrainer, UserError

_META = "tinker_state.json"


def path_of(model_id: str, name: str) -> str:
  return f"tinker://{model_id}/weights/{name}"


def check_name(name) -> str:
  if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", name) or (
      name in (".", "..")):
    raise UserError(f"path must be a name of letters, digits, '_', '-' or '.', got {name!r}")
  return name


class States:
  def __init__(self, root: str):
    self.root = root

  def _directory(self, path: str) -> str:
    m = re.fullmatch(r"tinker://([^/]+)/weights/([^/]+)", path or "")
    if not m:
      raise UserError(f"{path!r} is not a training state path "
                      "(tinker://<model_id>/weights/<name>)")
    return os.path.join(self.root, m.group(1).replace(":", "_"), check_name(m.group(2)))

  def exists(self, path: str) -> bool:
    return os.path.exists(os.path.join(self._directory(path), _META))

  def rank(self, path: str) -> int:
    """The LoRA rank of a saved state (FileNotFoundError: none at `path`)."""
    with open(os.path.join(self._directory(path), _META)) as f:
      return int(json.load(f)["rank"])

  def save(self, trainer: LoraTrainer, path: str, *, overwrite: bool) -> None:
    directory = self._directory(path)
    if self.exists(path) and not overwrite:
      raise UserError(f"a state is saved at {path!r} already (overwrite=True replaces it)")
    shutil.rmtree(directory, ignore_errors=True)  # an overwrite replaces the old state
    with Checkpointer(os.path.join(directory, "orbax"), keep_last=1,
                      async_save=False) as ckpt:
      ckpt.save(0, trainer.state(), stream_version=None)
    with open(os.path.join(directory, _META), "w") as f:
      json.dump({"rank": trainer.lora.rank}, f)

  def load(self, trainer: LoraTrainer, path: str, *, optimizer: bool) -> None:
    if not self.exists(path):
      raise UserError(f"no training state at {path!r}")
    rank = self.rank(path)
    if rank != trainer.lora.rank:
      raise UserError(f"the state at {path!r} has LoRA rank {rank}, this client "
                      f"{trainer.lora.rank}")
    with Checkpointer(os.path.join(self._directory(path), "orbax"), keep_last=1,
                      async_save=False) as ckpt:
      trainer.load_state(ckpt.restore(trainer.state()).state, optimizer=optimizer)
