"""The weight stream with sharded params, in worker processes started by these tests.

* one process, 8 simulated CPU devices: the publisher writes one object per shard of an
  fsdp-sharded model; subscribers on one device, on the same layout and on a decode layout
  ({data: 2, expert: 4}) follow it bit for bit, applying deltas in place.
* two processes (jax.distributed on 127.0.0.1), 4 devices each, one 8-device mesh: each
  process writes only the objects of the shards it holds; a subscriber here, on one
  device, reassembles every version bit for bit.

This file is also the worker: `python tests/test_sync_multiprocess.py MODE ...`.
"""

import json
import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
VERSIONS = 5


def _command(*args):
  return [sys.executable, str(HERE), *args]


def _run_together(commands, logs):
  from tests.process_group import run_together  # here: the worker script has no tests/
  return run_together(commands, timeout_s=300, logs=logs, cwd=str(REPO))


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def single8(tmp_path_factory):
  root = tmp_path_factory.mktemp("single8")
  (result,) = _run_together([_command("single8", str(root))],
                            tmp_path_factory.mktemp("single8_logs"))
  return result


@pytest.mark.multidevice
def test_sharded_publisher_writes_one_object_per_shard(single8):
  assert single8["objects_per_version"] == single8["unique_shards"]
  assert single8["max_shards_per_tensor"] == 8
  assert single8["objects_per_version"] == 8 + 8 + 8 + 8  # every tensor splits its embed


@pytest.mark.multidevice
@pytest.mark.parametrize("layout", ["one_device", "same_fsdp8", "decode_data2_expert4"])
def test_subscribers_on_any_layout_follow_bitwise(single8, layout):
  r = single8["subscribers"][layout]
  assert r["versions"] == list(range(VERSIONS))
  assert r["bitwise_equal"] == [True] * VERSIONS
  assert r["in_place"], "delta applies must reuse the device buffers"
  assert not r["errors"]
  if layout == "decode_data2_expert4":  # each device patches its own block
    assert r["apply_collectives"] and not any(r["apply_collectives"].values()), r


@pytest.mark.multidevice
def test_two_processes_write_only_their_shards(tmp_path):
  root = tmp_path / "stream"
  from tests.process_group import free_port
  port = free_port()
  results = _run_together([_command("process", str(root), str(port), str(i))
                           for i in range(2)], tmp_path / "logs")
  for r in results:
    assert r["foreign_keys"] == [] and r["written"] > 0
  written = [set(r["keys"]) for r in results]
  assert not written[0] & written[1]

  from rljax.sync import Subscriber
  from rljax.sync import manifest as fmt
  import numpy as np
  sub = Subscriber(f"file://{root}")
  assert sub.poll() == VERSIONS - 1  # keyframe 0 + four 8-shard deltas, each verified
  assert sub.stats.versions_applied == VERSIONS - 1 and not sub.stats.errors
  got = {p: fmt.checksum(np.asarray(x).view(np.uint16))
         for p, x in fmt.flatten(sub.params).items()}
  assert got == results[0]["full_checksums"]


# ---------------------------------------------------------------- workers


# A small tree with the roles of a MoE model's tensors (few shapes, so few compiles).
TREE = {"embed": {"embedding": ((128, 64), ("vocab", "embed"))},
        "moe": {"gate": ((64, 8, 32), ("embed", "expert", "mlp")),
                "down": ((8, 32, 64), ("expert", "mlp", "embed"))},
        "norm": {"scale": ((64,), ("embed",))}}


def _params(sharding):
  """f32 params (std 0.02) placed with `sharding` (a rljax Sharding): one tree per mesh."""
  import jax
  import numpy as np
  rng = np.random.default_rng(0)
  out = {}
  for group, leaves in TREE.items():
    for name, (shape, _) in leaves.items():
      host = (0.02 * rng.standard_normal(shape)).astype(np.float32)
      out.setdefault(group, {})[name] = jax.make_array_from_callback(
          shape, _shardings(sharding)[group][name], lambda idx, h=host: h[idx])
  return out


def _shardings(sharding):
  return {g: {n: sharding.named(axes) for n, (_, axes) in leaves.items()}
          for g, leaves in TREE.items()}


def _update_fn():
  import jax
  import jax.numpy as jnp

  @jax.jit
  def update(params, key):
    """A sign-SGD step of 1e-5: a few % of the bf16 values change, shardings kept."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [
        w + 1e-5 * jnp.sign(jax.random.normal(k, w.shape)) for w, k in zip(leaves, keys)])

  return update


def worker_single8(root):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
  sys.path.insert(0, str(REPO))
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rljax import sharding as sharding_lib
  from rljax.sync import Publisher, Subscriber
  from rljax.sync import manifest as fmt

  assert jax.device_count() == 8
  train = sharding_lib.Sharding(sharding_lib.make_mesh({"fsdp": 8}))
  params = _params(train)
  decode = sharding_lib.Sharding(sharding_lib.make_mesh({"data": 2, "expert": 4}),
                                 sharding_lib.DECODE_RULES)
  url = f"file://{root}/stream"
  pub = Publisher(url, keyframe_every=3, retain=10)
  subs = {"one_device": Subscriber(url),
          "same_fsdp8": Subscriber(url, shardings=_shardings(train)),
          "decode_data2_expert4": Subscriber(url, shardings=_shardings(decode))}
  log = {name: {"versions": [], "bitwise_equal": [], "in_place": True, "errors": []}
         for name in subs}
  pointers = {}
  update = _update_fn()
  objects_per_version = []
  for v in range(VERSIONS):
    if v:
      params = update(params, jax.random.key(v))
    m = pub.publish(params, v)
    objects_per_version.append(sum(len(t.shards) for t in m.tensors.values()))
    want = {p: np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)
            for p, x in fmt.flatten(params).items()}
    for name, sub in subs.items():
      got_v = sub.poll()
      log[name]["versions"].append(got_v)
      flat = fmt.flatten(sub.params)
      log[name]["bitwise_equal"].append(all(
          np.array_equal(np.asarray(flat[p]).view(np.uint16), want[p]) for p in want))
      ptrs = [s.data.unsafe_buffer_pointer() for x in flat.values() for s in x.addressable_shards]
      if v >= 2 and ptrs != pointers[name]:  # (the first delta after a CPU device_put copies)
        log[name]["in_place"] = False
      pointers[name] = ptrs
      log[name]["errors"] = sub.stats.errors
  # the patch program of every tensor of the decode layout (replicated over data, split
  # over expert on a non-leading axis for the MoE weights): no collective at all
  from rljax.sync.subscriber import _sharded_apply_fn  # pylint: disable=import-outside-toplevel
  collectives = {}
  for p, x in fmt.flatten(subs["decode_data2_expert4"].params).items():
    rows = jax.ShapeDtypeStruct((8, 1024), jnp.int32)
    hlo = _sharded_apply_fn("xor", x.sharding).lower(
        x, rows, jax.ShapeDtypeStruct((8, 1024), jnp.uint16)).compile().as_text()
    collectives[p] = sum(hlo.count(op) for op in ("all-gather(", "all-reduce(", "all-to-all(",
                                                    "collective-permute(", "reduce-scatter("))
  log["decode_data2_expert4"]["apply_collectives"] = collectives
  unique = sum(len({fmt.region_of(s.index, x.shape) for s in x.addressable_shards
                    if s.replica_id == 0})
               for x in jax.tree.leaves(params))
  print(json.dumps({
      "objects_per_version": objects_per_version[-1], "unique_shards": unique,
      "max_shards_per_tensor": max(len(t.shards) for t in m.tensors.values()),
      "subscribers": log}))


def worker_process(root, port, process_id):
  sys.path.insert(0, str(REPO))
  import jax
  jax.config.update("jax_num_cpu_devices", 4)
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from rljax import sharding as sharding_lib
  from rljax.sync import Publisher, Store
  from rljax.sync import manifest as fmt

  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = sharding_lib.Sharding(sharding_lib.make_mesh({"fsdp": 4, "expert": 2}))
  params = _params(mesh)

  class Recording(Store):
    keys: list = []

    def write_many(self, items):
      Recording.keys.extend(items)
      super().write_many(items)

  inner = Store.open(f"file://{root}")
  pub = Publisher(Recording(inner.kvstore, driver="file"), keyframe_every=10)
  update = _update_fn()
  mine = set()
  for v in range(VERSIONS):
    if v:
      params = update(params, jax.random.key(v))
    pub.publish(params, v)
    for path, x in fmt.flatten(params).items():
      for s in x.addressable_shards:
        if s.replica_id == 0:
          mine.add(fmt.object_key(v, path, fmt.region_of(s.index, x.shape)))
  objects = [k for k in Recording.keys if "/_index/" not in k and k.startswith(fmt.OBJECTS)]
  full = {p: fmt.checksum(np.asarray(multihost_utils.process_allgather(
      x.astype(jnp.bfloat16), tiled=True)).view(np.uint16))
          for p, x in fmt.flatten(params).items()}
  print(json.dumps({"written": len(objects), "keys": objects,
                    "foreign_keys": sorted(set(objects) - mine), "full_checksums": full}))
  jax.distributed.shutdown()


if __name__ == "__main__":
  if sys.argv[1] == "single8":
    worker_single8(pathlib.Path(sys.argv[2]))
  elif sys.argv[1] == "process":
    worker_process(pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
  else:
    raise SystemExit(f"unknown worker mode {sys.argv[1]!r}")
