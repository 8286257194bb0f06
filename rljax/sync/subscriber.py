"""The rollout-host side of the weight stream: follow the newest complete version.

`poll()` reads `latest`; if it is newer, the subscriber walks the manifests back along
`parent` to its own version and applies each version in turn:

  fetch    every object of the version, concurrently; each is checked against its
           `object_checksum`, and missing or corrupt objects are read again (`retries`);
  decode   into patches, on the host, while the current weights are still in use;
  apply    in place on device: one jitted scatter per tensor with the weights donated, so
           no second copy of the model exists (the pause is this step and the next);
  verify   the checksum of every shard's new bits; on a mismatch every tensor of the
           version is rolled back (delta patches are invertible), so the weights stay at
           the last verified version.

When the chain has a gap (a manifest was garbage-collected), an object stays corrupt
after the retries, or a version fails verification, the subscriber falls back to the
latest keyframe and the deltas after it, as far as they verify. A new subscriber joins
the same way. When `latest` itself cannot be reached (its manifest missing or corrupt,
its keyframe unreadable), the subscriber walks back to the newest older version it can
reach. Weights that failed verification are never handed out: `params` is always
a verified version. Nothing read from the store makes `poll()` raise: every problem is
recorded in `stats.errors` and the weights stay at the last verified version. A keyframe
is built on the host and verified before it replaces the weights (a join holds a second
copy until then; call `release()` first to avoid that), then placed by `shardings`: each
device receives only its block. A delta is patched block by block on a mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rljax.sync import codecs
from rljax.sync import manifest as fmt
from rljax.sync.store import Store

ShardingFn = Callable[[str, tuple[int, ...], Any], jax.sharding.Sharding]
_MIN_BUCKET = 1024


# ---- device apply ----


def _apply_block(kind: str, x, positions, values):
  """x with a sparse patch applied at its flat `positions` (padding: positions == x.size,
  dropped); the scatter works on x's bits."""
  u = jax.lax.bitcast_convert_type(x, values.dtype).reshape(-1)
  if kind == "set":
    new = values
  else:
    old = u.at[positions].get(mode="fill", fill_value=0)
    new = old ^ values if kind == "xor" else codecs.unordered(codecs.ordered(old) + values)
  u = u.at[positions].set(new, mode="drop", indices_are_sorted=True, unique_indices=True)
  return jax.lax.bitcast_convert_type(u.reshape(x.shape), x.dtype)


@functools.lru_cache(maxsize=None)
def _device_apply_fn(kind: str, sharding: jax.sharding.Sharding):
  """jit(x, positions [B] int32, values [B] uint) -> x with the patch applied, x donated."""
  return jax.jit(functools.partial(_apply_block, kind), donate_argnums=0,
                 out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _sharded_apply_fn(kind: str, sharding: NamedSharding):
  """jit(x, positions [devices, B], values [devices, B]) -> x patched, x donated: each
  device applies its own row (flat positions within its block) to its block of x, so no
  device ever holds more than its block and nothing crosses devices."""
  rows = PartitionSpec(tuple(sharding.mesh.axis_names))

  def local(x, positions, values):
    return _apply_block(kind, x, positions[0], values[0])

  apply = jax.shard_map(local, mesh=sharding.mesh, in_specs=(sharding.spec, rows, rows),
                        out_specs=sharding.spec, check_vma=False)
  return jax.jit(apply, donate_argnums=0, out_shardings=sharding)


def _bucket(m: int) -> int:
  return max(_MIN_BUCKET, 1 << max(m - 1, 0).bit_length())  # few shapes, few compiles


def apply_on_device(x: jax.Array, patch: codecs.Patch) -> jax.Array:
  """Applies a sparse patch (global flat positions) to `x` in place (x is donated).

  On a mesh each device patches its own block (`_sharded_apply_fn`); the limit of 2**31
  elements (int32 positions) is per block."""
  if patch.positions is None:
    raise ValueError("dense patches are applied by building a new array")
  sharding = x.sharding
  if block_elements(x) >= 2**31 - 1:
    raise ValueError(f"{x.shape}: blocks of {block_elements(x)} elements; positions are "
                     "int32, so a tensor's blocks must have fewer than 2**31 elements "
                     "(shard it further)")
  if _per_block(x):
    return _apply_sharded(x, patch, sharding)
  m = patch.positions.size
  positions = np.full(_bucket(m), x.size, np.int32)
  positions[:m] = patch.positions
  values = np.zeros(_bucket(m), patch.values.dtype)
  values[:m] = patch.values
  return _device_apply_fn(patch.kind, sharding)(x, positions, values)


def _per_block(x: jax.Array) -> bool:
  """Whether x is patched block by block: a mesh sharding that divides x evenly."""
  s = x.sharding
  return (isinstance(s, NamedSharding) and len(s.device_set) > 1
          and all(d % n == 0 for d, n in zip(x.shape, s.shard_shape(x.shape))))


def block_elements(x: jax.Array) -> int:
  """The elements one patch program scatters into: a device's block, or all of x."""
  return math.prod(x.sharding.shard_shape(x.shape)) if _per_block(x) else x.size


def _apply_sharded(x: jax.Array, patch: codecs.Patch, sharding: NamedSharding) -> jax.Array:
  block = sharding.shard_shape(x.shape)
  size = math.prod(block)
  index = np.unravel_index(np.asarray(patch.positions, np.int64), x.shape)
  region_of = {d: fmt.region_of(s, x.shape)
               for d, s in sharding.devices_indices_map(x.shape).items()}
  patches: dict[fmt.Region, tuple[np.ndarray, np.ndarray]] = {}  # block-flat positions, values
  for region in set(region_of.values()):
    inside = np.ones(patch.positions.size, bool)
    for i, (a, b) in zip(index, region):
      inside &= (i >= a) & (i < b)
    local = np.ravel_multi_index(tuple(i[inside] - a for i, (a, _) in zip(index, region)),
                                 block) if x.ndim else np.zeros(int(inside.sum()), np.int64)
    patches[region] = (local, patch.values[inside])
  width = _bucket(max(len(p) for p, _ in patches.values()))
  devices = list(sharding.mesh.devices.flat)  # row r of the inputs goes to devices[r]
  rows = NamedSharding(sharding.mesh, PartitionSpec(tuple(sharding.mesh.axis_names)))

  def per_device(part: int, fill, dtype) -> jax.Array:
    def rows_of(idx):
      out = np.full((len(devices[idx[0]]), width), fill, dtype)
      for r, device in enumerate(devices[idx[0]]):
        data = patches[region_of[device]][part]
        out[r, :len(data)] = data
      return out
    return jax.make_array_from_callback((len(devices), width), rows, rows_of)

  positions = per_device(0, size, np.int32)  # padding: == the block's size, dropped
  values = per_device(1, 0, patch.values.dtype)
  return _sharded_apply_fn(patch.kind, sharding)(x, positions, values)


def region_bits(x: jax.Array, region: fmt.Region) -> np.ndarray:
  """The bits of `region` of `x`, [n] uint, read from the shards that hold it (zero-copy
  when one shard is exactly the region, as on one device)."""
  pieces = []
  for shard in x.addressable_shards:
    if shard.replica_id != 0:
      continue
    have = fmt.region_of(shard.index, x.shape)
    if have == region:
      return codecs.bits_view(np.asarray(shard.data))
    overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(have, region))
    if all(a < b for a, b in overlap) or not region:
      pieces.append((have, overlap, shard))
  out = np.empty(fmt.region_shape(region), x.dtype)
  filled = 0
  for have, overlap, shard in pieces:
    src = tuple(slice(a - h, b - h) for (a, b), (h, _) in zip(overlap, have))
    dst = tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(overlap, region))
    out[dst] = np.asarray(shard.data)[src]
    filled += math.prod(fmt.region_shape(overlap))
  if filled != out.size:
    raise fmt.StreamError(f"region {region} is not addressable here")
  return codecs.bits_view(out)


# ---- the subscriber ----


@dataclasses.dataclass
class Stats:
  versions_applied: int = 0
  keyframes_loaded: int = 0
  fallbacks: int = 0
  refetches: int = 0
  bytes_fetched: int = 0
  last_apply_pause_s: float = 0.0  # weights unusable: scatter + verification
  last_decode_s: float = 0.0
  errors: list[str] = dataclasses.field(default_factory=list)  # the last 20
  error_count: int = 0

  def error(self, msg: str) -> None:
    self.errors = (self.errors + [msg])[-20:]
    self.error_count += 1


class Subscriber:
  """Holds verified weights of one stream version and moves them to the newest.

  Deltas are applied to the held arrays in place (donated): arrays taken from `params`
  before a `poll()` that moved are invalid after it; take `params` again.
  """

  def __init__(self, store: "Store | str", *,
               shardings: "Mapping[str, Any] | ShardingFn | None" = None, retries: int = 1,
               walk_back: int = 16):
    """walk_back: how many older version numbers to try when `latest` cannot be reached
    and the store cannot list (http); a listable store names the versions it holds."""
    self.store = Store.open(store)
    self.retries = retries
    self.walk_back = walk_back
    self._sharding_of = _sharding_fn(shardings)
    self._tensors: dict[str, jax.Array] | None = None
    self.version: int | None = None
    self.stats = Stats()
    self._manifests: dict[int, fmt.Manifest] = {}
    self._diverged = False  # a delta failed verification on our weights (rolled back)
    # ("manifest" | "delta" | "keyframe", version) found unreadable during this poll
    self._bad: set[tuple[str, int]] = set()

  @property
  def params(self) -> dict[str, Any]:
    """The weights at `self.version` (nested dicts of jax.Array), verified bit for bit."""
    if self._tensors is None:
      raise fmt.StreamError("no verified version yet: poll() first")
    return fmt.unflatten(self._tensors)

  def release(self) -> None:
    """Drops the weights (e.g. before a keyframe join, to avoid holding two copies)."""
    if self._tensors is not None:
      for x in self._tensors.values():
        x.delete()
    self._tensors, self.version = None, None

  # ---- polling ----

  def latest(self) -> int | None:
    """The newest complete version the store advertises (None if none or unreadable)."""
    raw = self.store.read(fmt.LATEST_KEY)
    if raw is None:
      return None
    try:
      return fmt.parse_latest(raw)
    except fmt.StreamError as e:
      self.stats.error(f"unreadable {fmt.LATEST_KEY!r}: {e}")
      return None

  def poll(self) -> int | None:
    """Moves to the newest complete version it can verify; returns it, or None if nothing
    changed."""
    start = self.version
    self._bad = set()
    target = self.latest()
    if target is None or (start is not None and target <= start):
      return None
    self._move_to(target)
    if self.version != target:
      for v in self._older_versions(target, self.version):
        before = self.version
        self._move_to(v)
        if self.version != before:
          break
      if self.version != start:
        self._move_to(target)  # from a version reached by walking back, deltas may lead on
    self._manifests = {v: m for v, m in self._manifests.items()
                       if self.version is not None and v > self.version}
    return self.version if self.version != start else None

  def _move_to(self, target: int) -> None:
    """Deltas from our version to `target`, or its keyframe and the deltas after it."""
    if self.version is not None and target <= self.version:
      return
    chain = None if self.version is None else self._chain(self.version, target)
    by_keyframe = chain is not None and self._keyframe_is_cheaper(chain, target)
    if chain is not None and not by_keyframe:
      self._advance(chain)
    if self.version != target:
      if self.version is not None and not by_keyframe:
        self.stats.fallbacks += 1  # a gap, or a version that did not verify
      self._join(target, chain_tried=chain is not None and not by_keyframe)

  def _older_versions(self, target: int, floor: int | None) -> list[int]:
    """Versions in (floor, target), newest first: those the store lists, or (a store
    that cannot list) the `walk_back` numbers below `target`."""
    lo = -1 if floor is None else floor
    if self.store.can_list:
      listed = (fmt.parse_manifest_key(k) for k in self.store.list(fmt.MANIFESTS))
      return sorted((v for v in listed if v is not None and lo < v < target), reverse=True)
    return list(range(target - 1, max(lo, target - 1 - self.walk_back), -1))

  def _manifest(self, version: int) -> fmt.Manifest | None:
    if ("manifest", version) in self._bad:
      raise fmt.StreamError(f"manifest {version} is corrupt")
    if version not in self._manifests:
      raw = self.store.read(fmt.manifest_key(version))
      if raw is None:
        return None
      try:
        m = fmt.Manifest.from_bytes(raw)
        if m.version != version:
          raise fmt.StreamError(f"manifest {version} says version {m.version}")
      except fmt.StreamError:
        self._bad.add(("manifest", version))
        raise
      self._manifests[version] = m
    return self._manifests[version]

  def _chain(self, base: int, target: int) -> list[fmt.Manifest] | None:
    """Manifests base+..target along `parent` (ascending), or None if there is a gap (a
    missing or corrupt manifest, or deltas found unreadable during this poll)."""
    chain = []
    v = target
    try:
      while v != base:
        m = self._manifest(v)
        if (m is None or m.delta_tensors is None or m.parent < base
            or ("delta", v) in self._bad):
          return None
        chain.append(m)
        v = m.parent
    except fmt.StreamError as e:
      self.stats.error(str(e))
      return None
    return chain[::-1]

  def _keyframe_is_cheaper(self, chain: list[fmt.Manifest], target: int) -> bool:
    kf = chain[-1].keyframe_version
    if kf <= self.version:
      return False
    via_deltas = sum(m.delta_bytes for m in chain)
    via_keyframe = sum(s.nbytes for m in chain if m.version == kf
                       for t in m.tensors.values() for s in t.shards)
    via_keyframe += sum(m.delta_bytes for m in chain if m.version > kf)
    return via_keyframe < via_deltas

  def _advance(self, chain: list[fmt.Manifest]) -> None:
    """Applies the deltas of `chain` in order, stopping at the first that fails."""
    for m in chain:
      try:
        try:
          patches = self._fetch_and_decode(m.delta_tensors)
        except fmt.StreamError:
          self._bad.add(("delta", m.version))  # the objects: no use trying them again
          raise
        self._apply_delta(m, self._tensors, patches)
        self.version = m.version
        self.stats.versions_applied += 1
      except fmt.StreamError as e:
        self.stats.error(f"version {m.version}: {e}")
        return

  def _join(self, target: int, chain_tried: bool) -> None:
    """Latest keyframe of `target`, then its deltas."""
    try:
      m = self._manifest(target)
      if m is None:
        raise fmt.StreamError(f"manifest {target} is missing")
      kf = self._manifest(m.keyframe_version)
      if kf is None:
        raise fmt.StreamError(f"keyframe {m.keyframe_version} is missing")
      if chain_tried and not self._diverged and kf.version <= self.version:
        return  # this path needs the very deltas that just failed on verified weights
      if ("keyframe", kf.version) in self._bad:
        raise fmt.StreamError(f"keyframe {kf.version} is unreadable")
      chain = self._chain(kf.version, target)
      if chain is None:
        raise fmt.StreamError(f"no chain from keyframe {kf.version} to {target}")
      try:
        tensors = self._load_keyframe(kf, self._fetch_and_decode(kf.tensors))
      except fmt.StreamError:
        self._bad.add(("keyframe", kf.version))
        raise
    except fmt.StreamError as e:
      self.stats.error(f"keyframe for {target}: {e}")
      return
    old = self._tensors
    self._tensors, self.version, self._diverged = tensors, kf.version, False
    self.stats.keyframes_loaded += 1
    if old is not None:
      for x in old.values():
        x.delete()
    self._advance(chain)

  # ---- fetch, decode, apply ----

  def _fetch_and_decode(self, entries: dict[str, fmt.TensorEntry]
                        ) -> dict[str, list[tuple[fmt.ShardEntry, codecs.Patch]]]:
    """Fetches (concurrently, with retries), verifies and decodes the objects of `entries`."""
    shards = [(path, s) for path, t in entries.items() for s in t.shards]
    data: list[bytes | None] = [None] * len(shards)
    todo = list(range(len(shards)))
    for attempt in range(self.retries + 1):
      if attempt:
        self.stats.refetches += len(todo)
      got = self.store.read_many(shards[i][1].key for i in todo)
      for i, raw in zip(todo, got):
        if raw is not None and fmt.checksum(raw) == shards[i][1].object_checksum:
          data[i] = raw
          self.stats.bytes_fetched += len(raw)
      todo = [i for i in todo if data[i] is None]
      if not todo:
        break
    if todo:
      path, s = shards[todo[0]]
      raise fmt.StreamError(f"{len(todo)} objects missing or corrupt, e.g. {s.key}")
    t0 = time.perf_counter()
    out: dict[str, list] = {}
    for (path, s), raw in zip(shards, data):
      t = entries[path]
      itemsize = np.dtype(jnp.dtype(t.dtype)).itemsize
      try:  # the bytes matched their checksum, but the writer may still have been wrong
        patch = codecs.get(s.codec).decode(raw, math.prod(fmt.region_shape(s.region)),
                                           itemsize)
      except (ValueError, KeyError) as e:
        raise fmt.StreamError(f"cannot decode {s.key}: {e}") from e
      out.setdefault(path, []).append((s, patch))
    self.stats.last_decode_s = time.perf_counter() - t0
    return out

  def _apply_delta(self, m: fmt.Manifest, tensors: dict[str, jax.Array] | None,
                   patches) -> None:
    """Applies version `m` to `tensors` in place, or leaves them as they were and raises."""
    entries = m.delta_tensors
    if entries is None or tensors is None:
      raise fmt.StreamError(f"version {m.version} is not a delta on held weights")
    if set(entries) != set(tensors):
      raise fmt.StreamError(f"version {m.version} names other tensors than the weights")
    merged = {}
    for path, items in patches.items():
      t = entries[path]
      x = tensors[path]
      if tuple(x.shape) != t.shape or x.dtype != jnp.dtype(t.dtype):
        raise fmt.StreamError(f"{path}: {t.shape} {t.dtype} vs held {x.shape} {x.dtype}")
      if block_elements(x) >= 2**31 - 1:
        raise fmt.StreamError(f"{path}: blocks of {block_elements(x)} elements; deltas need "
                              "blocks of fewer than 2**31 (shard the tensor further)")
      kinds = {p.kind for _, p in items}
      if len(kinds) != 1 or kinds & {"set"} or any(p.dense for _, p in items):
        raise fmt.StreamError(f"{path}: a delta must decode to sparse xor/add patches")
      positions = np.concatenate([fmt.global_positions(p.positions, s.region, t.shape)
                                  for s, p in items])
      values = np.concatenate([p.values for _, p in items])
      order = np.argsort(positions, kind="stable") if len(items) > 1 else None
      if order is not None:
        positions, values = positions[order], values[order]
      merged[path] = codecs.Patch(kinds.pop(), positions, values, x.size)

    t0 = time.perf_counter()
    applied = []  # `tensors` is updated in place, so it always holds live arrays
    try:
      for path, patch in merged.items():
        tensors[path] = apply_on_device(tensors[path], patch)
        applied.append(path)
      bad = [path for path in merged for s in entries[path].shards
             if fmt.checksum(region_bits(tensors[path], s.region)) != s.checksum]
      if bad:
        self._diverged = True
        raise fmt.StreamError(f"checksum mismatch after applying {bad[0]} (and "
                              f"{len(bad) - 1} more); rolled back")
    except Exception:
      for path in applied:  # back to the last verified version
        tensors[path] = apply_on_device(tensors[path], merged[path].inverse())
      raise
    finally:
      self.stats.last_apply_pause_s = time.perf_counter() - t0
    return tensors

  def _load_keyframe(self, m: fmt.Manifest, patches) -> dict[str, jax.Array]:
    if not m.keyframe:
      raise fmt.StreamError(f"version {m.version} is not a keyframe")
    hosts = {}
    for path, t in m.tensors.items():
      host = np.empty(t.shape, jnp.dtype(t.dtype))
      for s, patch in patches.get(path, []):  # none for a tensor of no elements
        if patch.kind != "set" or not patch.dense:
          raise fmt.StreamError(f"{s.key}: a keyframe must decode to dense bits")
        bits = patch.values
        if fmt.checksum(bits) != s.checksum:
          raise fmt.StreamError(f"checksum mismatch in keyframe object {s.key}")
        host[fmt.region_slices(s.region)] = bits.view(host.dtype).reshape(
            fmt.region_shape(s.region))
      hosts[path] = host
    return {path: jax.device_put(host, self._sharding_of(path, host.shape, host.dtype))
            for path, host in hosts.items()}


def _sharding_fn(shardings) -> ShardingFn:
  if shardings is None:
    device = jax.local_devices()[0]
    return lambda path, shape, dtype: jax.sharding.SingleDeviceSharding(device)
  if callable(shardings):
    return shardings
  flat = fmt.flatten(shardings)

  def lookup(path, shape, dtype):
    if path not in flat:
      raise fmt.StreamError(f"no sharding given for tensor {path!r}")
    return flat[path]

  return lookup
