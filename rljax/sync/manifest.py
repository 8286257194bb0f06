"""The weight stream's format: key layout, manifests, checksums, params <-> named tensors.

Keys under a store's root (versions zero-padded so keys sort like numbers):

  latest                                  {"version": N}, rewritten after each manifest
  manifests/{version:012d}.json           written last: a version exists iff this does
  objects/{version:012d}/{tensor}/{region}  one object per tensor shard
  objects/{version:012d}/{tensor}/{region}.delta  a keyframe's delta against its parent
  objects/{version:012d}/_index/{process}.json  a process's shard entries (multi-process)

A tensor is named by its path in the params (nested dicts): "layers/layer_000/attn/q". A
region is the part of the tensor a shard holds, [[start, stop], ...] per dimension.
Checksums are xxh3-64 of the C-order bits ("xxh3:<16 hex digits>"): `checksum` of a
region's new bits, `object_checksum` of the stored object.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

import numpy as np
import xxhash

FORMAT = "rljax.weights/1"
LATEST_KEY = "latest"
MANIFESTS = "manifests/"
OBJECTS = "objects/"

Region = tuple[tuple[int, int], ...]


class StreamError(Exception):
  """A version cannot be read or verified (missing, corrupt, or not in the chain)."""


def version_name(version: int) -> str:
  if not 0 <= version < 10**12:
    raise ValueError(f"versions are integers in [0, 1e12), got {version}")
  return f"{version:012d}"


def manifest_key(version: int) -> str:
  return f"{MANIFESTS}{version_name(version)}.json"


def objects_prefix(version: int) -> str:
  return f"{OBJECTS}{version_name(version)}/"


def object_key(version: int, tensor: str, region: Region, kind: str = "") -> str:
  """kind: "" for a version's own objects, "delta" for a keyframe's deltas."""
  name = ".".join(f"{a}-{b}" for a, b in region) or "scalar"
  return f"{objects_prefix(version)}{tensor}/{name}{'.' + kind if kind else ''}"


def index_key(version: int, process: int) -> str:
  return f"{objects_prefix(version)}_index/{process}.json"


def parse_manifest_key(key: str) -> int | None:
  if key.startswith(MANIFESTS) and key.endswith(".json"):
    stem = key[len(MANIFESTS):-len(".json")]
    if stem.isdigit():
      return int(stem)
  return None


def checksum(data: Any) -> str:
  """xxh3-64 of a bytes-like object or of a C-contiguous array's bits."""
  if isinstance(data, np.ndarray):
    data = np.ascontiguousarray(data)
  return f"xxh3:{xxhash.xxh3_64_hexdigest(data)}"


# ---- regions ----


def full_region(shape: tuple[int, ...]) -> Region:
  return tuple((0, int(d)) for d in shape)


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
  """A shard's `index` (slices, as jax gives them) -> Region."""
  out = []
  for sl, d in zip(index, shape):
    start, stop, step = sl.indices(d)
    if step != 1:
      raise ValueError(f"strided shard index {index}")
    out.append((start, stop))
  return tuple(out)


def region_shape(region: Region) -> tuple[int, ...]:
  return tuple(b - a for a, b in region)


def region_slices(region: Region) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in region)


def global_positions(local: np.ndarray, region: Region, shape: tuple[int, ...]) -> np.ndarray:
  """Flat indices within `region` ([m], C order) -> flat indices within the tensor."""
  if region == full_region(shape):
    return local
  if len(shape) and all(r == (0, d) for r, d in zip(region[1:], shape[1:])):
    return local + region[0][0] * math.prod(shape[1:])  # split along the first axis only
  idx = np.unravel_index(local, region_shape(region))
  return np.ravel_multi_index(tuple(i + a for i, (a, _) in zip(idx, region)), shape)


# ---- manifest ----


@dataclasses.dataclass(frozen=True)
class ShardEntry:
  region: Region
  key: str
  codec: str
  checksum: str  # of the region's new bits
  object_checksum: str  # of the stored object
  nbytes: int  # stored object size

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["region"] = [list(r) for r in self.region]
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "ShardEntry":
    return cls(region=tuple((int(a), int(b)) for a, b in d["region"]), key=str(d["key"]),
               codec=str(d["codec"]), checksum=str(d["checksum"]),
               object_checksum=str(d["object_checksum"]), nbytes=int(d["nbytes"]))


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  shape: tuple[int, ...]
  dtype: str
  shards: tuple[ShardEntry, ...]

  def to_json(self) -> dict[str, Any]:
    return {"shape": list(self.shape), "dtype": self.dtype,
            "shards": [s.to_json() for s in self.shards]}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "TensorEntry":
    entry = cls(shape=tuple(int(x) for x in d["shape"]), dtype=str(d["dtype"]),
                shards=tuple(ShardEntry.from_json(s) for s in d["shards"]))
    entry.validate()
    return entry

  def validate(self) -> None:
    covered = 0
    for s in self.shards:
      if len(s.region) != len(self.shape) or any(
          not 0 <= a <= b <= d for (a, b), d in zip(s.region, self.shape)):
        raise StreamError(f"shard region {s.region} outside shape {self.shape}")
      covered += math.prod(region_shape(s.region))
    if covered != math.prod(self.shape):
      raise StreamError(f"shards cover {covered} of {math.prod(self.shape)} elements")


@dataclasses.dataclass(frozen=True)
class Manifest:
  """One version. `tensors` are its own objects: deltas against `parent`, or, for a
  keyframe, the full bits. A keyframe with a parent also carries `deltas` against it, so
  a subscriber that follows the stream never needs the full bits."""

  version: int
  parent: int | None  # None only for a keyframe that starts the stream (or a new layout)
  keyframe: bool
  keyframe_version: int  # the keyframe this version's chain starts from
  tensors: dict[str, TensorEntry]
  deltas: dict[str, TensorEntry] | None  # keyframes only: deltas against `parent`
  bytes_written: int  # sum of the objects' sizes
  full_bytes: int  # the raw size of every tensor
  created_unix: float

  @property
  def delta_tensors(self) -> dict[str, TensorEntry] | None:
    """The entries that take `parent` to this version, if there are any."""
    return self.deltas if self.keyframe else self.tensors

  @property
  def delta_bytes(self) -> int | None:
    d = self.delta_tensors
    return None if d is None else sum(s.nbytes for t in d.values() for s in t.shards)

  def to_bytes(self) -> bytes:
    d = {"format": FORMAT, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
    d["tensors"] = {k: v.to_json() for k, v in self.tensors.items()}
    d["deltas"] = None if self.deltas is None else {
        k: v.to_json() for k, v in self.deltas.items()}
    return json.dumps(d, indent=1, sort_keys=True).encode()

  @classmethod
  def from_bytes(cls, data: bytes) -> "Manifest":
    try:
      d = json.loads(data)
      if d.get("format") != FORMAT:
        raise StreamError(f"unknown manifest format {d.get('format')!r}")
      m = cls(version=int(d["version"]),
              parent=None if d["parent"] is None else int(d["parent"]),
              keyframe=bool(d["keyframe"]), keyframe_version=int(d["keyframe_version"]),
              tensors={k: TensorEntry.from_json(v) for k, v in d["tensors"].items()},
              deltas=None if d.get("deltas") is None else {
                  k: TensorEntry.from_json(v) for k, v in d["deltas"].items()},
              bytes_written=int(d["bytes_written"]), full_bytes=int(d["full_bytes"]),
              created_unix=float(d["created_unix"]))
    except (ValueError, KeyError, TypeError) as e:
      raise StreamError(f"corrupt manifest: {e}") from e
    if m.keyframe:
      consistent = m.keyframe_version == m.version and (m.parent is None) == (
          m.deltas is None) and (m.deltas is None or set(m.deltas) == set(m.tensors))
    else:
      consistent = m.parent is not None and m.deltas is None and m.keyframe_version <= m.parent
    if not consistent or (m.parent is not None and m.parent >= m.version):
      raise StreamError(f"inconsistent manifest for version {m.version}")
    return m


# ---- params <-> named tensors ----


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {"a/b/c": leaf}. Keys must be non-empty strings without '/'."""
  if not isinstance(params, Mapping):
    raise TypeError(f"the weight stream takes nested dicts of arrays, got {type(params)}")
  out = {}
  for k, v in params.items():
    if not isinstance(k, str) or not k or "/" in k:
      raise ValueError(f"param key {k!r} must be a non-empty string without '/'")
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for path, v in flat.items():
    *parents, leaf = path.split("/")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out
