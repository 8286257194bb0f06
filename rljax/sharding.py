"""The mesh and the one table that maps logical axis names to mesh axes.

Model code names tensor roles ("embed", "expert", "batch", ...) and never mesh axes.
`RULES` is the training table; `DECODE_RULES` is its decode variant (weights replicated
over `fsdp`, since decode steps are latency-bound and re-gathering weights every token
costs more than the memory it saves) and the engine's KV page pool split over the axes
that split its slots (each device holds 1/n of the pages, not a replica of the pool).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
from flax.linen import partitioning as flax_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ("data", "fsdp", "expert", "model")

LogicalAxes = tuple[str | None, ...]

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated)
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("expert", "expert"),
    ("router", None),
    ("layers", None),
    ("pages", None),
    ("page_slot", None),
)
DECODE_RULES: tuple[tuple[str, Any], ...] = tuple(
    (name, None if name == "embed" else ("data", "fsdp", "expert") if name == "pages" else axes)
    for name, axes in RULES)


def make_mesh(shape: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 4-axis mesh (data, fsdp, expert, model); unnamed axes get size 1.

  `shape=None` puts every device on `data`.
  """
  devices = list(devices if devices is not None else jax.devices())
  shape = dict(shape or {"data": len(devices)})
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected a subset of {MESH_AXES}")
  sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} "
                     f"devices, have {len(devices)}")
  return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


@dataclasses.dataclass(frozen=True)
class Sharding:
  """A mesh with a rules table. Hashable: pass it to jitted functions as static."""

  mesh: Mesh
  rules: tuple[tuple[str, Any], ...] = RULES

  def axis_size(self, mesh_axis: str) -> int:
    return self.mesh.shape[mesh_axis]

  def spec(self, logical: LogicalAxes, *, gathered: bool = False) -> P:
    """PartitionSpec for logical axes (flax's logical partitioning over this mesh's
    rules); `gathered` drops `fsdp` (weights at use). Mesh axes of size 1 are left out,
    and a mesh axis shards at most one dimension (the first rule that claims it)."""
    table = dict(self.rules)
    for name in logical:
      if name is not None and name not in table:
        raise KeyError(f"logical axis {name!r} has no rule; add it to rljax.sharding.RULES")
    return P(*flax_partitioning.logical_to_mesh_axes(logical, self._mesh_rules(gathered)))

  @functools.lru_cache(maxsize=None)
  def _mesh_rules(self, gathered: bool) -> tuple[tuple[str, Any], ...]:
    """The rules with this mesh's size-1 axes (and fsdp, when gathered) removed."""
    out = []
    for name, axes in self.rules:
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      axes = tuple(a for a in axes if self.mesh.shape[a] > 1 and not (gathered and a == "fsdp"))
      out.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(out)

  def mesh_axes(self, logical: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split the logical axis `logical`, in order."""
    axes = self.spec((logical,))[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)

  def shards(self, logical: str) -> int:
    """How many ways this mesh splits the logical axis `logical`."""
    return int(np.prod([self.mesh.shape[a] for a in self.mesh_axes(logical)]))

  @functools.lru_cache(maxsize=None)
  def process_part(self, logical: str) -> tuple[int, int]:
    """(this process's part, how many parts) of an axis split by `logical` across the
    processes of a multi-process mesh: each part is the set of indices one process's
    devices hold, so processes whose devices hold the same indices (the axis is replicated
    between them) share a part and must feed it the same data. (0, 1) on one process."""
    n = self.shards(logical)
    index = self.named((logical,)).devices_indices_map((n,))
    held: dict[int, set[int]] = {}
    for device, (idx,) in index.items():
      held.setdefault(device.process_index, set()).update(range(*idx.indices(n)))
    parts = sorted({frozenset(v) for v in held.values()}, key=min)
    covered = sorted(i for part in parts for i in part)
    if covered != list(range(n)):
      raise ValueError(f"the processes' devices hold overlapping parts of {logical!r} on mesh "
                       f"{dict(self.mesh.shape)}: not a split per process")
    return parts.index(frozenset(held[jax.process_index()])), len(parts)

  def named(self, logical: LogicalAxes, *, gathered: bool = False) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical, gathered=gathered))

  def constrain(self, x: jax.Array, logical: LogicalAxes, *, gathered: bool = False) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, self.named(logical, gathered=gathered))

  def tree_shardings(self, logical_tree: Any) -> Any:
    """Maps a tree whose leaves are logical-axes tuples to NamedShardings."""
    return jax.tree.map(self.named, logical_tree, is_leaf=_is_axes)


def constrain(sharding: Sharding | None, x: jax.Array, logical: LogicalAxes,
              *, gathered: bool = False) -> jax.Array:
  """`sharding.constrain(...)`, or `x` unchanged when running unsharded."""
  return x if sharding is None else sharding.constrain(x, logical, gathered=gathered)


def committed(tree: Any) -> Any:
  """Every leaf a jax.Array committed to the one device it is on (numpy leaves to the
  default device first); a leaf already placed on a mesh is left as it is.

  jit compiles one program for uncommitted arguments and another for committed ones, and
  a program's outputs are committed: an engine or a train state made of fresh
  `jnp.zeros` / numpy leaves compiled each of its programs twice, once before and once
  after its first update (measured on CPU: 10.7 s for the GRPO step, 2-3 s per engine
  program).

  Several processes: the tree is returned as it is. An uncommitted leaf is a host value
  every process holds, which device_put places on a mesh across processes (the train
  state's shardings); one committed to a local device would be a cross-host transfer, which
  the CPU backend refuses (and a jitted program over the global mesh moves an uncommitted
  argument, where it rejects a committed one)."""
  if jax.process_count() > 1:
    return tree

  def commit(x):
    if isinstance(x, jax.core.Tracer):  # traced (jax.eval_shape of a state): no placement
      return x
    x = x if isinstance(x, jax.Array) else jax.numpy.asarray(x)
    if isinstance(x.sharding, jax.sharding.SingleDeviceSharding) and not x.committed:
      return jax.device_put(x, x.sharding)
    return x
  return jax.tree.map(commit, tree)


def _is_axes(x: Any) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
