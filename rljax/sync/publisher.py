"""The trainer side of the weight stream: publish(params, version).

Each version is written as one object per tensor shard, coded against the same shard of
the parent version (a delta) or on its own (a keyframe, every `keyframe_every` versions
and whenever there is no parent; a keyframe with a parent also gets deltas, so followers
never download full weights), then `manifests/{version}.json`, then `latest`. A
version whose manifest is absent does not exist for readers, so a publisher killed
midway leaves nothing visible; its orphan objects are deleted when a publisher next opens
the store (so a store has one publisher at a time). A manifest that does not parse (see
`Manifest.from_bytes`) is moved to `set_aside/` then, with a warning, and listed in
`set_aside`; the publisher continues after the newest intact version, and after `resume`
publishes a keyframe first when the resumed version's chain runs through a set-aside one.

Under multi-process JAX every process codes and writes only the shards it holds (replica
0 of each), plus an index of its shard entries; process 0 merges the indexes into the
manifest after a barrier. Process 0 also garbage-collects: it keeps the newest `retain`
versions and, for the oldest of them, the keyframe and the deltas it needs.

The parent's bits are kept on the host (one copy of the addressable shards in the stream
dtype, bf16 by default: 2 bytes per parameter).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sync import codecs
from rljax.sync import manifest as fmt
from rljax.sync.store import Store

log = logging.getLogger(__name__)


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _all_processes_agree(flag: bool) -> bool:
  """True iff `flag` is true on every process."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.array([flag]))))


def local_shards(x: Any, dtype: Any) -> list[tuple[fmt.Region, np.ndarray]]:
  """The (region, host bits [n] uint) of each shard this process writes: replica 0 of the
  shards it holds. `x` is a jax.Array (cast to `dtype` on device) or a numpy array."""
  if isinstance(x, jax.Array):
    x = x.astype(dtype)
    out = []
    for shard in x.addressable_shards:
      if shard.replica_id == 0:
        host = np.array(shard.data, copy=True)
        out.append((fmt.region_of(shard.index, x.shape), codecs.bits_view(host)))
    return out
  x = np.asarray(x).astype(dtype)  # a copy, ours to keep as the parent
  return [(fmt.full_region(x.shape), codecs.bits_view(x))]


class Publisher:
  """Writes versions of a params tree (nested dicts of arrays) to a store."""

  def __init__(self, store: "Store | str", *, keyframe_every: int = 10, retain: int = 4,
               delta_codec: str = codecs.DEFAULT_DELTA,
               keyframe_codec: str = codecs.DEFAULT_KEYFRAME, dtype: Any = jnp.bfloat16):
    if keyframe_every < 1 or retain < 1:
      raise ValueError("keyframe_every and retain must be >= 1")
    for name, want_keyframe in ((delta_codec, False), (keyframe_codec, True)):
      if codecs.get(name).keyframe != want_keyframe:
        raise ValueError(f"codec {name!r} is {'not ' if want_keyframe else ''}a keyframe codec")
    self.store = Store.open(store)
    if self.store.read_only or not self.store.can_list:
      raise ValueError(f"a publisher needs a writable, listable store, not {self.store}")
    self.keyframe_every = keyframe_every
    self.retain = retain
    self.delta_codec = delta_codec
    self.keyframe_codec = keyframe_codec
    self.dtype = jnp.dtype(dtype)
    self._parent: dict[tuple[str, fmt.Region], np.ndarray] = {}
    self._parent_version: int | None = None  # the version `_parent` holds the bits of
    self._since_keyframe = 0
    self._history: dict[int, int] = {}  # version -> the keyframe its chain starts from
    self.set_aside: list[int] = []  # versions whose corrupt manifests `_recover` moved
    self._recover()

  # ---- state ----

  @property
  def version(self) -> int | None:
    """The newest complete version in the store."""
    return max(self._history) if self._history else None

  def _recover(self) -> None:
    """Reads the versions in the store, sets corrupt manifests aside and deletes orphans
    of an interrupted publish."""
    versions = [v for v in map(fmt.parse_manifest_key, self.store.list(fmt.MANIFESTS))
                if v is not None]
    raws = self.store.read_many(fmt.manifest_key(v) for v in versions)
    corrupt = {}
    for v, raw in zip(versions, raws):
      if raw is None:
        continue
      try:
        m = fmt.Manifest.from_bytes(raw)
        if m.version != v:
          raise fmt.StreamError(f"it says version {m.version}")
        self._history[v] = m.keyframe_version
      except fmt.StreamError as e:
        corrupt[v] = (raw, e)
    self.set_aside = sorted(corrupt)
    _barrier("rljax.sync.publisher.recover.read")
    if jax.process_index() == 0:
      for v, (raw, e) in corrupt.items():
        log.warning("weight stream %s: manifest of version %d is corrupt (%s); moved to %s",
                    self.store, v, e, fmt.set_aside_key(v))
        self.store.write(fmt.set_aside_key(v), raw)
        self.store.delete(fmt.manifest_key(v))
      newest = self.version
      start = fmt.OBJECTS if newest is None else fmt.objects_prefix(newest + 1)
      self.store.delete_range(start, fmt.OBJECTS[:-1] + chr(ord("/") + 1))
      if newest is None:
        self.store.delete(fmt.LATEST_KEY)
      elif self._read_latest() != newest:
        self._write_latest(newest)
    _barrier("rljax.sync.publisher.recover")

  def _read_latest(self) -> int | None:
    raw = self.store.read(fmt.LATEST_KEY)
    try:
      return None if raw is None else fmt.parse_latest(raw)
    except fmt.StreamError:
      return None  # rewritten

  def _write_latest(self, version: int) -> None:
    self.store.write(fmt.LATEST_KEY, json.dumps({"version": version}).encode())

  def resume(self, params: Mapping[str, Any], version: int) -> None:
    """Takes `params` as the bits of stream version `version` (e.g. after restoring a
    checkpoint), so the next publish can be a delta against it. Raises StreamError unless
    every shard this process holds has exactly the bits the manifest records.

    `version` may be older than the newest in the store (the trainer crashed after
    publishing past its last checkpoint): the next version then names `version` as its
    parent, and subscribers that took the abandoned versions find no chain and rejoin
    from a keyframe."""
    raw = self.store.read(fmt.manifest_key(version))
    if raw is None:
      raise fmt.StreamError(f"version {version} is not in {self.store}")
    m = fmt.Manifest.from_bytes(raw)
    parent = {}
    for path, x in fmt.flatten(params).items():
      entry = m.tensors.get(path)
      if entry is None:
        raise fmt.StreamError(f"tensor {path!r} is not in version {version}")
      by_region = {s.region: s for s in entry.shards}
      for region, bits in local_shards(x, self.dtype):
        if region not in by_region or fmt.checksum(bits) != by_region[region].checksum:
          raise fmt.StreamError(f"{path}{list(region)} does not match version {version}")
        parent[(path, region)] = bits
    if set(m.tensors) != set(fmt.flatten(params)):
      raise fmt.StreamError(f"params and version {version} name different tensors")
    self._parent, self._parent_version = parent, version
    self._since_keyframe = sum(1 for v in self._history if m.keyframe_version < v <= version)
    if any(m.keyframe_version <= v <= version for v in self.set_aside):
      self._since_keyframe = self.keyframe_every  # subscribers cannot follow that chain

  # ---- publish ----

  def publish(self, params: Mapping[str, Any], version: int) -> fmt.Manifest:
    """Writes `params` as `version` (> every version in the store); returns its manifest.

    params: nested dicts of jax.Array (any sharding; cast to the stream dtype on device)
    or numpy arrays. Call on every process.
    """
    if self.version is not None and version <= self.version:
      raise ValueError(f"version {version} is not newer than the store's {self.version}")
    flat = fmt.flatten(params)
    shards = {path: local_shards(x, self.dtype) for path, x in flat.items()}
    layout = {(path, region) for path, items in shards.items() for region, _ in items}
    has_parent = _all_processes_agree(self._parent_version is not None
                                      and layout == set(self._parent))
    keyframe = not has_parent or self._since_keyframe + 1 >= self.keyframe_every
    parts = []  # (entry group, codec, object kind)
    if keyframe:
      parts.append(("tensors", codecs.get(self.keyframe_codec), ""))
    if has_parent:
      parts.append(("deltas" if keyframe else "tensors", codecs.get(self.delta_codec),
                    "delta" if keyframe else ""))

    objects: dict[str, bytes] = {}
    entries: dict[str, dict[str, list[dict[str, Any]]]] = {group: {} for group, _, _ in parts}
    for path, items in shards.items():
      for region, bits in items:
        bits_checksum = fmt.checksum(bits)
        for group, codec, kind in parts:
          data = codec.encode(bits, None if codec.keyframe else self._parent[(path, region)])
          key = fmt.object_key(version, path, region, kind)
          objects[key] = data
          entries[group].setdefault(path, []).append(fmt.ShardEntry(
              region=region, key=key, codec=codec.name, checksum=bits_checksum,
              object_checksum=fmt.checksum(data), nbytes=len(data)).to_json())
    if jax.process_count() > 1:
      objects[fmt.index_key(version, jax.process_index())] = json.dumps(entries).encode()
    self.store.write_many(objects)
    _barrier(f"rljax.sync.publish.{version}.objects")

    if jax.process_index() == 0:
      if jax.process_count() > 1:
        entries = _merge_indexes(self.store, version, jax.process_count())
      m = self._manifest(flat, entries, version, self._parent_version if has_parent else None,
                         keyframe)
      self.store.write(fmt.manifest_key(version), m.to_bytes())
      self._write_latest(version)
    _barrier(f"rljax.sync.publish.{version}.manifest")
    if jax.process_index() != 0:
      m = fmt.Manifest.from_bytes(self.store.read(fmt.manifest_key(version)))

    self._parent = {(path, region): bits for path, items in shards.items()
                    for region, bits in items}
    self._parent_version = version
    self._since_keyframe = 0 if keyframe else self._since_keyframe + 1
    self._history[version] = m.keyframe_version
    if jax.process_index() == 0:
      self._collect_garbage()
    return m

  def _manifest(self, flat, entries, version, parent, keyframe) -> fmt.Manifest:
    def tensor_entries(group):
      out = {}
      for path, x in flat.items():
        shards = sorted((fmt.ShardEntry.from_json(e) for e in entries[group].get(path, [])),
                        key=lambda s: s.region)
        out[path] = fmt.TensorEntry(tuple(x.shape), self.dtype.name, tuple(shards))
        out[path].validate()
      return out

    tensors = tensor_entries("tensors")
    deltas = tensor_entries("deltas") if "deltas" in entries else None
    return fmt.Manifest(
        version=version, parent=parent, keyframe=keyframe,
        keyframe_version=version if keyframe else self._history[parent],
        tensors=tensors, deltas=deltas,
        bytes_written=sum(s.nbytes for group in (tensors, deltas or {})
                          for t in group.values() for s in t.shards),
        full_bytes=sum(int(np.prod(x.shape)) * self.dtype.itemsize for x in flat.values()),
        created_unix=time.time())

  def _collect_garbage(self) -> None:
    """Deletes every version older than the keyframes the newest `retain` versions start
    from. Manifests go first, so a reader never finds a manifest whose objects are gone."""
    versions = sorted(self._history)
    keep_from = min(self._history[v] for v in versions[-self.retain:])
    if keep_from <= versions[0]:
      return
    self.store.delete_range(fmt.MANIFESTS, fmt.manifest_key(keep_from))
    self.store.delete_range(fmt.OBJECTS, fmt.objects_prefix(keep_from))
    self._history = {v: k for v, k in self._history.items() if v >= keep_from}


def _merge_indexes(store: Store, version: int, n_processes: int) -> dict[str, dict]:
  raws = store.read_many(fmt.index_key(version, p) for p in range(n_processes))
  merged: dict[str, dict[str, list]] = {}
  for p, raw in enumerate(raws):
    if raw is None:
      raise fmt.StreamError(f"process {p} wrote no index for version {version}")
    for group, tensors in json.loads(raw).items():
      for path, items in tensors.items():
        merged.setdefault(group, {}).setdefault(path, []).extend(items)
  return merged
