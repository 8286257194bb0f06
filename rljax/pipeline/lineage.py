"""The lineage of an async run: which groups (hosts, tasks) each update trained on.

`<workdir>/trained_groups.jsonl`, one JSON line per update, in update order:
  {"update": n, "version": v, "groups": [group ids], "hosts": [...], "tasks": [payloads]}
A trainer restarted from its checkpoint after update n cuts the file back to n lines; the
groups of the updates it lost go back into the work queue (rljax.pipeline.async_loop).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence


class Lineage:
  """Appends and cuts back one run's lineage file (written by one process only)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "trained_groups.jsonl")

  def read(self) -> list[dict[str, Any]]:
    if not os.path.exists(self.path):
      return []
    with open(self.path, encoding="utf-8") as f:
      return [json.loads(line) for line in f if line.strip()]

  def append(self, update: int, version: int, group_ids: Sequence[int],
             host_ids: Sequence[str], tasks: Sequence[Any]) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"update": update, "version": version, "groups": list(group_ids),
                          "hosts": list(host_ids), "tasks": list(tasks)}) + "\n")

  def cut_back(self, updates: int) -> list[dict[str, Any]]:
    """Keeps the first `updates` records (which must be updates 1..updates) and returns
    the records it removed."""
    lines = self.read()
    if [l["update"] for l in lines[:updates]] != list(range(1, updates + 1)):
      raise ValueError(f"{self.path} does not hold updates 1..{updates} of the checkpoint")
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(l) + "\n" for l in lines[:updates])
    os.replace(tmp, self.path)
    return lines[updates:]
