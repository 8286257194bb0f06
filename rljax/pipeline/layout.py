"""The storage root of an async run: the only thing trainer and rollout hosts share.

  <root>/stream/              the weight stream (rljax.sync Publisher / Subscriber): the
                              policy's params each version, or with config.lora its
                              adapters (f32)
  <root>/base/                config.lora only: the frozen base params, one keyframe
                              (version 0) published once before the stream's version 0
                              (rljax.pipeline.adapter_stream)
  <root>/queue/               the work queue (rljax.pipeline.work_queue)
  <root>/run/done             written by the trainer when the run is over (any bytes)
  <root>/run/probe/<id>       a start-up probe (written, read back, deleted: `probe_root`)
  <root>/run/fingerprint.json the trainer's model, numerics, tokenizer, env and sampling
                              config; a host whose own differs refuses to start
  <root>/run/hosts/<id>.json  each rollout host's status record, written by that host only
  <root>/trainer/             a multi-process trainer's orbax checkpoints

A root is a store URL: memory:// (one process), file:///abs/dir, gs://bucket/prefix.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any
import uuid

from absl import flags
import jax
import ml_collections
import tensorstore as ts

from rljax.sync.store import Store, kvstore_spec

DONE_KEY = "run/done"
FINGERPRINT_KEY = "run/fingerprint.json"
PROBE_PREFIX = "run/probe/"
HOSTS_PREFIX = "run/hosts/"
QUEUE_PREFIX = "queue/"
STREAM_DIR = "stream/"
BASE_DIR = "base/"


def check_root(root: str) -> str:
  if not isinstance(root, str) or "://" not in root:
    raise ValueError(f"root must be a store URL (memory://, file:///dir, gs://...), not {root!r}")
  return root


_ROOT_PROBE_S = flags.DEFINE_float(
    "root_probe_s", 30.0, "at start, a key is written under --root, read back and deleted; "
    "give up after this long")


class RootUnreachable(RuntimeError):
  """The storage root cannot be written, read back and cleaned within the probe's time."""


def probe_root(root: str, *, timeout_s: float = 30.0, attempts: int = 3, flag: str = "--root",
               context: ts.Context | None = None) -> None:
  """Writes one key under `root`, reads it back and deletes it, so that a root that is
  unreachable or lacks credentials fails at start, in `timeout_s`, and not at the first
  checkpoint or never (tensorstore's GCS driver keeps retrying its credential lookup).
  Up to `attempts` tries, each given an equal share of the time; raises RootUnreachable
  naming `flag` and the root."""
  check_root(root)
  deadline = time.monotonic() + timeout_s
  key = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  value = uuid.uuid4().bytes
  last = "no attempt"
  for attempt in range(attempts):
    try_until = time.monotonic() + (deadline - time.monotonic()) / (attempts - attempt)
    left = lambda: max(0.0, try_until - time.monotonic())  # pylint: disable=cell-var-from-loop
    try:
      kv = ts.KvStore.open(kvstore_spec(root), context=context).result(timeout=left())
      kv.write(key, value).result(timeout=left())
      read = kv.read(key).result(timeout=left())
      if read.state != "value" or bytes(read.value) != value:
        raise OSError(f"read back {read.state!r}, not the bytes written")
      kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result(timeout=left())
      return
    except TimeoutError:
      last = f"attempt {attempt + 1} got no answer in time"
    except Exception as e:  # pylint: disable=broad-except  (any store error: report it)
      last = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    time.sleep(min(left(), 0.5))
  hint = (" For gs://: are credentials set (GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth "
          "application-default login`), and does the bucket exist?"
          if root.startswith("gs://") else "")
  raise RootUnreachable(f"{flag} {root}: could not write, read back and delete a key within "
                        f"{timeout_s:g} s ({last}).{hint}")


def probe_root_from_flags(root: str) -> None:
  """`probe_root` with `--root_probe_s`, for entry points (after absl parsed the flags): an
  unreachable root exits with the probe's one-line error."""
  try:
    probe_root(root, timeout_s=_ROOT_PROBE_S.value)
  except RootUnreachable as e:
    raise SystemExit(f"error: {e}") from None


def stream_url(root: str) -> str:
  """The weight stream under `root`: f"{root.rstrip('/')}/stream/" (for "memory://" that is
  "memory:/stream/", which names the same kvstore path as "memory://stream/")."""
  return f"{check_root(root).rstrip('/')}/{STREAM_DIR}"


def base_url(root: str) -> str:
  """The frozen base of a config.lora run under `root` (a stream of one version)."""
  return f"{check_root(root).rstrip('/')}/{BASE_DIR}"


# The config a rollout host must share with the trainer for its samples to be the trainer's
# policy's: the model and its numerics, the tokens (tokenizer, env, sampling) and the seed
# of the sampling keys; with config.lora its adapters (a host merges the stream's
# adapters into the base with the trainer's rank, alpha and targets). Model fields only
# the trainer uses are left out (the expert row tile is not one: the engine's routed tiles
# have its shape, and their bits depend on it).
FINGERPRINTED = ("seed", "numerics", "init_from", "model", "tokenizer", "env",
                 "engine.max_seq_len", "rl.max_new_tokens", "rl.temperature", "rl.top_k",
                 "rl.top_p", "lora")
TRAINER_ONLY_MODEL_FIELDS = ("train_experts", "remat", "scan_layers")


def fingerprint(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The FINGERPRINTED part of a config, flat ("model.hidden_size": 128), as JSON values;
  a block the config does not have is absent."""
  out: dict[str, Any] = {}

  def add(name: str, value: Any) -> None:
    if isinstance(value, ml_collections.ConfigDict):
      value = value.to_dict()
    if isinstance(value, dict):
      for k, v in value.items():
        if not (name == "model" and k in TRAINER_ONLY_MODEL_FIELDS):
          add(f"{name}.{k}", v)
    else:
      out[name] = json.loads(json.dumps(value, default=repr))

  for path in FINGERPRINTED:
    node: Any = config
    for part in path.split("."):
      node = node.get(part) if isinstance(node, (ml_collections.ConfigDict, dict)) else None
    if node is not None:
      add(path, node)
  return out


def publish_fingerprint(store: Store, config: ml_collections.ConfigDict) -> None:
  store.write(FINGERPRINT_KEY, json.dumps(fingerprint(config), sort_keys=True).encode())


def check_fingerprint(store: Store, config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming every field where `config` differs from the trainer's."""
  raw = store.read(FINGERPRINT_KEY)
  if raw is None:
    raise ValueError(f"no {FINGERPRINT_KEY} under {store}: the trainer writes it before "
                     "its first weights; is this root a run of this version of rljax?")
  theirs, mine = json.loads(raw), fingerprint(config)
  missing = object()
  diff = [k for k in sorted(set(theirs) | set(mine))
          if theirs.get(k, missing) != mine.get(k, missing)]
  if diff:
    shown = "; ".join(f"config.{k}: trainer {theirs.get(k, '(unset)')!r}, this host "
                      f"{mine.get(k, '(unset)')!r}" for k in diff[:6])
    more = f" (and {len(diff) - 6} more)" if len(diff) > 6 else ""
    raise ValueError(f"this rollout host's config differs from the trainer's "
                     f"({FINGERPRINT_KEY}) in {len(diff)} field(s): {shown}{more}. Start it "
                     "with the trainer's config file and --config overrides")


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
