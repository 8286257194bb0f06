"""The weight stream's format: key layout, manifests, checksums, params <-> named tensors.

Keys under a store's root (versions zero-padded so keys sort like numbers):

  latest                                  {"version": N}, rewritten after each manifest
  manifests/{version:012d}.json           written last: a version exists iff this does
  set_aside/{version:012d}.json           a corrupt manifest a restarted publisher moved
  objects/{version:012d}/{tensor}/{region}  one object per tensor shard
  objects/{version:012d}/{tensor}/{region}.delta  a keyframe's delta against its parent
  objects/{version:012d}/_index/{process}.json  a process's shard entries (multi-process)

A tensor is named by its path in the params (nested dicts): "layers/layer_000/attn/q". A
region is the part of the tensor a shard holds, [[start, stop], ...] per dimension.
Checksums are xxh3-64 of the C-order bits ("xxh3:<16 hex digits>"): `checksum` of a
region's new bits, `object_checksum` of the stored object, `manifest_checksum` of the
manifest itself (its JSON without that field, keys sorted, no spaces).

Everything read from a store is untrusted: `Manifest.from_bytes` and `parse_latest` check
every field's type and range and raise `StreamError` on anything else.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from flax import traverse_util
import numpy as np
import xxhash

from rljax.sync import codecs

FORMAT = "rljax.weights/2"  # /2: manifests carry `manifest_checksum`
LATEST_KEY = "latest"
MANIFESTS = "manifests/"
OBJECTS = "objects/"
SET_ASIDE = "set_aside/"
MAX_VERSION = 10**12
# dtypes the stream carries (itemsize 1, 2 or 4: see codecs.bits_view)
DTYPES = frozenset({"bfloat16", "float16", "float32", "int8", "uint8", "int16", "uint16",
                    "int32", "uint32", "float8_e4m3fn", "float8_e5m2"})
_MAX_DIM = 2**40

Region = tuple[tuple[int, int], ...]


class StreamError(Exception):
  """A version cannot be read or verified (missing, corrupt, or not in the chain)."""


def version_name(version: int) -> str:
  if not 0 <= version < MAX_VERSION:
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


def set_aside_key(version: int) -> str:
  return f"{SET_ASIDE}{version_name(version)}.json"


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


# ---- untrusted JSON ----


def _obj(x: Any, what: str) -> dict:
  if not isinstance(x, dict):
    raise StreamError(f"{what} is {type(x).__name__}, not an object")
  return x


def _get(d: dict, key: str, what: str) -> Any:
  if key not in d:
    raise StreamError(f"{what} has no {key!r}")
  return d[key]


def _int(x: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
  if type(x) is not int or not lo <= x < hi:  # not bool, float or str
    raise StreamError(f"{what} must be an integer in [{lo}, {hi}), got {x!r:.80}")
  return x


def _str(x: Any, what: str) -> str:
  if not isinstance(x, str):
    raise StreamError(f"{what} must be a string, got {x!r:.80}")
  return x


def _list(x: Any, what: str) -> list:
  if not isinstance(x, list):
    raise StreamError(f"{what} must be a list, got {x!r:.80}")
  return x


def _checksum_str(x: Any, what: str) -> str:
  x = _str(x, what)
  if len(x) != 21 or not x.startswith("xxh3:") or x[5:].strip("0123456789abcdef"):
    raise StreamError(f"{what} is not an xxh3 checksum: {x!r:.80}")
  return x


def _json(data: Any, what: str) -> Any:
  if not isinstance(data, (bytes, bytearray, str)):
    raise StreamError(f"{what} is {type(data).__name__}, not bytes")
  try:
    return json.loads(data)
  except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
    raise StreamError(f"{what} is not JSON: {e}") from e


def parse_latest(data: bytes) -> int:
  """`latest`'s bytes -> the version it names; StreamError unless {"version": int}."""
  d = _obj(_json(data, repr(LATEST_KEY)), repr(LATEST_KEY))
  return _int(_get(d, "version", repr(LATEST_KEY)), f"{LATEST_KEY!r} version", 0, MAX_VERSION)


def manifest_checksum(d: Mapping[str, Any]) -> str:
  """The checksum of a manifest's JSON object (without `manifest_checksum`)."""
  return checksum(json.dumps(d, sort_keys=True, separators=(",", ":")).encode())


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
  def from_json(cls, d: Any, what: str = "shard") -> "ShardEntry":
    d = _obj(d, what)
    region = []
    for i, pair in enumerate(_list(_get(d, "region", what), f"{what} region")):
      pair = _list(pair, f"{what} region[{i}]")
      if len(pair) != 2:
        raise StreamError(f"{what} region[{i}] must be [start, stop], got {pair!r:.80}")
      region.append(tuple(_int(a, f"{what} region[{i}]", 0, _MAX_DIM) for a in pair))
    codec = _str(_get(d, "codec", what), f"{what} codec")
    if codec not in codecs.names():
      raise StreamError(f"{what}: unknown codec {codec!r:.80}")
    return cls(region=tuple(region), key=_str(_get(d, "key", what), f"{what} key"),
               codec=codec, checksum=_checksum_str(_get(d, "checksum", what),
                                                   f"{what} checksum"),
               object_checksum=_checksum_str(_get(d, "object_checksum", what),
                                             f"{what} object_checksum"),
               nbytes=_int(_get(d, "nbytes", what), f"{what} nbytes"))


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  shape: tuple[int, ...]
  dtype: str
  shards: tuple[ShardEntry, ...]

  def to_json(self) -> dict[str, Any]:
    return {"shape": list(self.shape), "dtype": self.dtype,
            "shards": [s.to_json() for s in self.shards]}

  @classmethod
  def from_json(cls, d: Any, what: str = "tensor") -> "TensorEntry":
    d = _obj(d, what)
    shape = tuple(_int(x, f"{what} shape", 0, _MAX_DIM)
                  for x in _list(_get(d, "shape", what), f"{what} shape"))
    dtype = _str(_get(d, "dtype", what), f"{what} dtype")
    if dtype not in DTYPES:
      raise StreamError(f"{what}: the stream carries no dtype {dtype!r:.80}")
    shards = _list(_get(d, "shards", what), f"{what} shards")
    entry = cls(shape=shape, dtype=dtype, shards=tuple(
        ShardEntry.from_json(s, f"{what} shard {i}") for i, s in enumerate(shards)))
    entry.validate()
    return entry

  def validate(self) -> None:
    """Shards lie inside the shape and cover it exactly once."""
    if math.prod(self.shape) >= _MAX_DIM:
      raise StreamError(f"shape {self.shape} has 2**40 elements or more")
    covered = 0
    for s in self.shards:
      if len(s.region) != len(self.shape) or any(
          not 0 <= a <= b <= d for (a, b), d in zip(s.region, self.shape)):
        raise StreamError(f"shard region {s.region} outside shape {self.shape}")
      covered += math.prod(region_shape(s.region))
    if covered != math.prod(self.shape):
      raise StreamError(f"shards cover {covered} of {math.prod(self.shape)} elements")
    for i, s in enumerate(self.shards):  # same count + no overlap = an exact cover
      for t in self.shards[i + 1:]:
        if all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(s.region, t.region)) and (
            math.prod(region_shape(s.region)) and math.prod(region_shape(t.region))):
          raise StreamError(f"shard regions {s.region} and {t.region} overlap")


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
    d = json.loads(json.dumps(d))  # tuples -> lists: the checksum is of what readers see
    d["manifest_checksum"] = manifest_checksum(d)
    return json.dumps(d, indent=1, sort_keys=True).encode()

  @classmethod
  def from_bytes(cls, data: bytes) -> "Manifest":
    """Parses and checks a stored manifest; StreamError on anything malformed."""
    d = dict(_obj(_json(data, "manifest"), "manifest"))
    if d.get("format") != FORMAT:
      raise StreamError(f"unknown manifest format {d.get('format')!r:.80}")
    want = d.pop("manifest_checksum", None)
    if want != manifest_checksum(d):
      raise StreamError("manifest checksum mismatch (corrupt manifest)")
    version = _int(_get(d, "version", "manifest"), "manifest version", 0, MAX_VERSION)
    what = f"manifest {version}"
    parent = _get(d, "parent", what)
    keyframe = _get(d, "keyframe", what)
    if type(keyframe) is not bool:
      raise StreamError(f"{what}: keyframe must be true or false, got {keyframe!r:.80}")
    created = _get(d, "created_unix", what)
    if type(created) is int:
      created = float(_int(created, f"{what} created_unix", -2**62))
    if type(created) is not float or not math.isfinite(created):
      raise StreamError(f"{what}: created_unix must be a finite number, got {created!r:.80}")

    def entries(group: Any, name: str) -> dict[str, TensorEntry]:
      out = {_tensor_path(k, what): TensorEntry.from_json(v, f"{what} {name} {k!r:.80}")
             for k, v in _obj(group, f"{what} {name}").items()}
      _check_paths(out, what)
      for path, t in out.items():
        for s in t.shards:
          if not s.key.startswith(objects_prefix(version)):
            raise StreamError(f"{what}: {path} names object {s.key!r:.80} of another version")
          if codecs.get(s.codec).keyframe != (name == "tensors" and keyframe):
            raise StreamError(f"{what}: {path} {name} cannot use codec {s.codec!r}")
      return out

    deltas = _get(d, "deltas", what)
    m = cls(version=version,
            parent=None if parent is None else _int(parent, f"{what} parent", 0, MAX_VERSION),
            keyframe=keyframe,
            keyframe_version=_int(_get(d, "keyframe_version", what),
                                  f"{what} keyframe_version", 0, MAX_VERSION),
            tensors=entries(_get(d, "tensors", what), "tensors"),
            deltas=None if deltas is None else entries(deltas, "deltas"),
            bytes_written=_int(_get(d, "bytes_written", what), f"{what} bytes_written"),
            full_bytes=_int(_get(d, "full_bytes", what), f"{what} full_bytes"),
            created_unix=created)
    if m.keyframe:
      consistent = m.keyframe_version == m.version and (m.parent is None) == (
          m.deltas is None) and (m.deltas is None or all(
              k in m.tensors and (t.shape, t.dtype) == (m.tensors[k].shape, m.tensors[k].dtype)
              for k, t in m.deltas.items()) and len(m.deltas) == len(m.tensors))
    else:
      consistent = m.parent is not None and m.deltas is None and m.keyframe_version <= m.parent
    if not consistent or (m.parent is not None and m.parent >= m.version):
      raise StreamError(f"inconsistent manifest for version {m.version}")
    return m


def _tensor_path(path: str, what: str) -> str:
  if not path or any(not part for part in path.split("/")):
    raise StreamError(f"{what}: bad tensor name {path!r:.80}")
  return path


def _check_paths(entries: Mapping[str, Any], what: str) -> None:
  """No tensor name is a folder of another ("a" beside "a/b" cannot be nested dicts)."""
  folders = {path[:i] for path in entries for i, c in enumerate(path) if c == "/"}
  clash = folders & set(entries)
  if clash:
    raise StreamError(f"{what}: {sorted(clash)[0]!r:.80} is both a tensor and a folder")


# ---- params <-> named tensors ----


def flatten(params: Mapping[str, Any]) -> dict[str, Any]:
  """Nested dicts -> {"a/b/c": leaf} (flax.traverse_util). Keys must be non-empty strings
  without '/'."""
  if not isinstance(params, Mapping):
    raise TypeError(f"the weight stream takes nested dicts of arrays, got {type(params)}")
  flat = traverse_util.flatten_dict(dict(params))
  for path in flat:
    for k in path:
      if not isinstance(k, str) or not k or "/" in k:
        raise ValueError(f"param key {k!r} must be a non-empty string without '/'")
  return {"/".join(path): v for path, v in flat.items()}


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  return traverse_util.unflatten_dict(dict(flat), sep="/")
