"""The storage root of an async run: the only thing trainer and rollout hosts share.

  <root>/stream/              the weight stream (rljax.sync Publisher / Subscriber)
  <root>/queue/               the work queue (rljax.pipeline.work_queue)
  <root>/run/done             written by the trainer when the run is over (any bytes)
  <root>/run/hosts/<id>.json  each rollout host's status record, written by that host only
  <root>/trainer/             a multi-process trainer's orbax checkpoints

A root is a store URL: memory:// (one process), file:///abs/dir, gs://bucket/prefix.
"""

from __future__ import annotations

import json
import os

import jax

from rljax.sync.store import Store

DONE_KEY = "run/done"
HOSTS_PREFIX = "run/hosts/"
QUEUE_PREFIX = "queue/"
STREAM_DIR = "stream/"


def check_root(root: str) -> str:
  if not isinstance(root, str) or "://" not in root:
    raise ValueError(f"root must be a store URL (memory://, file:///dir, gs://...), not {root!r}")
  return root


def stream_url(root: str) -> str:
  """The weight stream under `root`: f"{root.rstrip('/')}/stream/" (for "memory://" that is
  "memory:/stream/", which names the same kvstore path as "memory://stream/")."""
  return f"{check_root(root).rstrip('/')}/{STREAM_DIR}"


def status_key(host_id: str) -> str:
  return f"{HOSTS_PREFIX}{host_id}.json"


def read_host_status(store: Store) -> dict[str, dict]:
  """Every host's latest status record, by host id."""
  keys = [k for k in store.list(HOSTS_PREFIX) if k.endswith(".json")]
  out = {}
  for key, raw in zip(keys, store.read_many(keys)):
    if raw is not None:
      try:
        status = json.loads(raw)
      except ValueError:
        continue  # a torn write on a store without atomic objects: read it next time
      if isinstance(status, dict):
        out[status.get("host_id", key)] = status
  return out


def trainer_dir(root: str, workdir: str) -> str:
  """Where the trainer's orbax checkpoints (`checkpoints/`, `sft_checkpoint/`) go: its
  workdir for one process; for several, `<root>/trainer`, which all of them reach."""
  if jax.process_count() == 1:
    return os.path.abspath(workdir)
  root = check_root(root).rstrip("/")
  if root.startswith("gs://"):
    return f"{root}/trainer"
  if root.startswith("file://"):
    return os.path.join(root[len("file://"):], "trainer")
  raise ValueError(f"a trainer of {jax.process_count()} processes needs a root they all "
                   f"reach (gs:// or a shared file://), not {root}")
