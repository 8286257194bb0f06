"""Complete groups taken from an `Endpoint` written as files a trainer reads: one
`group_<n>.npz` per group (`pipeline/npz.py`: the header names the group, its index and
its episodes; the arrays are `pipeline/wire.py`'s, bit for bit)."""

from __future__ import annotations

import os
import time

from absl import logging

from rljax.pipeline import npz, wire
from rljax.pipeline.rollout import Group


def write_group(directory: str, group: Group) -> str:
  """`group` as `<directory>/group_<request_id>.npz` (written whole, then renamed into
  place: a reader never sees a partial file); its path."""
  header = {"group_id": group.task.task_id, "index": group.request_id,
            "episode_ids": list(group.task.data["episode_ids"])}
  path = os.path.join(directory, f"group_{group.request_id}.npz")
  with open(path + ".tmp", "wb") as f:
    f.write(npz.encode(header, wire.group_to_arrays(group.trajectories)))
  os.replace(path + ".tmp", path)
  return path


def write_groups(endpoint, directory: str | None, max_seconds: float | None = None) -> int:
  """Takes the endpoint's complete groups as they finish and writes each to `directory`
  (None or "": taken and dropped) until `max_seconds` (None: until Ctrl-C, which ends it
  cleanly); returns how many were written."""
  if directory:
    os.makedirs(directory, exist_ok=True)
  written, t0 = 0, time.monotonic()
  try:
    while max_seconds is None or time.monotonic() - t0 < max_seconds:
      for group in endpoint.take_groups(wait_for=1, timeout_s=1.0):
        if directory:
          write_group(directory, group)
          written += 1
  except KeyboardInterrupt:
    logging.info("interrupted")
  return written
