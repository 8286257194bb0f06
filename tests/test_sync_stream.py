"""Publisher and subscriber on the memory and file stores: bit-exact following, keyframes,
garbage collection, faults (corrupt, truncated, missing objects, a diverged subscriber, a
publisher killed mid-version, a reader racing the writer) and resuming after a restart."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import ml_dtypes
import numpy as np
import pytest

from rljax.sync import Publisher, Store, StreamError, Subscriber, codecs
from rljax.sync import manifest as fmt

SHAPES = {"embed": {"embedding": (64, 32)}, "layer": {"w": (32, 48), "b": (48,)},
          "head": {"kernel": (32, 64)}}


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: {n: (0.02 * rng.standard_normal(s)).astype(np.float32) for n, s in v.items()}
          for k, v in SHAPES.items()}


def step(params, rng, lr=1e-5):
  """An Adam-like update: every weight moves by ~lr, so a few % of the bf16 values change."""
  return jax.tree.map(lambda w: (w + lr * np.sign(rng.standard_normal(w.shape))).astype(
      np.float32), params)


def bits(tree):
  return {p: np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)
          for p, x in fmt.flatten(tree).items()}


def assert_same(sub, params):
  got, want = bits(sub.params), bits(params)
  assert got.keys() == want.keys()
  for p in want:
    np.testing.assert_array_equal(got[p], want[p], err_msg=p)


def history(n, seed=0):
  rng = np.random.default_rng(seed)
  out = [make_params(seed)]
  for _ in range(n - 1):
    out.append(step(out[-1], rng))
  return out


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
  return Store.open("memory://" if request.param == "memory" else f"file://{tmp_path}/stream")


def test_follow_bitwise_in_place(store):
  versions = history(8)
  pub = Publisher(store, keyframe_every=3, retain=10)
  sub = Subscriber(store)
  assert sub.poll() is None
  pointers = None
  for v, params in enumerate(versions):
    m = pub.publish(params, v)
    assert m.keyframe == (v % 3 == 0) and m.parent == (None if v == 0 else v - 1)
    assert sub.poll() == v
    assert_same(sub, params)
    leaves = jax.tree.leaves(sub.params)
    # deltas land in the same device buffers: no second copy. (Not the first delta after
    # a keyframe: on CPU, device_put aliases the host array, which XLA cannot donate.)
    if v >= 2:
      assert [x.unsafe_buffer_pointer() for x in leaves] == pointers
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
  assert sub.stats.keyframes_loaded == 1  # keyframes carry deltas too
  assert sub.stats.versions_applied == 7 and not sub.stats.errors
  assert sub.poll() is None


def test_manifest_records_the_version(store):
  versions = history(3)
  pub = Publisher(store, keyframe_every=2, retain=10)
  for v, params in enumerate(versions):
    pub.publish(params, 10 + v)
  assert json.loads(store.read(fmt.LATEST_KEY)) == {"version": 12}
  m = fmt.Manifest.from_bytes(store.read(fmt.manifest_key(11)))
  assert (m.version, m.parent, m.keyframe, m.keyframe_version) == (11, 10, False, 10)
  want = bits(versions[1])
  for path, t in m.tensors.items():
    assert t.dtype == "bfloat16" and t.shape == want[path].shape
    (s,) = t.shards
    assert s.codec == codecs.DEFAULT_DELTA and s.checksum == fmt.checksum(want[path])
    assert s.object_checksum == fmt.checksum(store.read(s.key)) and s.nbytes > 0
  assert m.bytes_written == sum(s.nbytes for t in m.tensors.values() for s in t.shards)
  assert m.full_bytes == 2 * sum(w.size for w in want.values())
  k = fmt.Manifest.from_bytes(store.read(fmt.manifest_key(12)))
  assert k.keyframe and k.parent == 11 and {s.codec for t in k.tensors.values()
                                            for s in t.shards} == {"raw"}
  assert k.delta_bytes < k.full_bytes / 3


def test_gc_keeps_a_keyframe_and_the_deltas_after_it(store):
  versions = history(14)
  pub = Publisher(store, keyframe_every=4, retain=3)
  for v, params in enumerate(versions):
    pub.publish(params, v)
  # newest 3 are 11..13; 11 needs keyframe 8 and deltas 9, 10
  assert [fmt.parse_manifest_key(k) for k in store.list(fmt.MANIFESTS)] == list(range(8, 14))
  assert {k.split("/")[1] for k in store.list(fmt.OBJECTS)} == {
      fmt.version_name(v) for v in range(8, 14)}
  joiner = Subscriber(store)
  assert joiner.poll() == 13
  assert_same(joiner, versions[13])
  assert joiner.stats.keyframes_loaded == 1 and joiner.stats.versions_applied == 1  # 12 + 13


def test_catch_up_and_fall_back_when_the_chain_is_gone(store):
  versions = history(16)
  pub = Publisher(store, keyframe_every=4, retain=3)
  sub = Subscriber(store)
  for v in range(6):
    pub.publish(versions[v], v)
  sub.poll()
  for v in range(6, 9):
    pub.publish(versions[v], v)
  assert sub.poll() == 8  # three deltas in one poll, across keyframe 8
  assert_same(sub, versions[8])
  assert sub.stats.keyframes_loaded == 1
  for v in range(9, 16):
    pub.publish(versions[v], v)
  assert sub.poll() == 15  # 9..11 were collected: a gap, so keyframe 12 and deltas
  assert_same(sub, versions[15])
  assert sub.stats.keyframes_loaded == 2 and sub.stats.fallbacks == 1


class FlakyStore(Store):
  """Corrupts (or truncates) the first read of the keys in `bad`."""

  def __init__(self, inner, bad, how):
    super().__init__(inner.kvstore, driver=inner.driver)
    self.bad, self.how = set(bad), how

  def read_many(self, keys):
    keys = list(keys)
    out = super().read_many(keys)
    for i, k in enumerate(keys):
      if k in self.bad and out[i] is not None:
        self.bad.discard(k)
        out[i] = out[i][:-3] if self.how == "truncate" else _flip(out[i])
    return out


def _flip(data: bytes) -> bytes:
  b = bytearray(data)
  b[len(b) // 2] ^= 0x10
  return bytes(b)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_transient_corruption_is_refetched(how):
  store = Store.open("memory://")
  versions = history(3)
  pub = Publisher(store, keyframe_every=10)
  pub.publish(versions[0], 0)
  m = pub.publish(versions[1], 1)
  keys = [s.key for t in m.tensors.values() for s in t.shards][:2]
  sub = Subscriber(FlakyStore(store, keys, how))
  assert sub.poll() == 1  # keyframe 0, then delta 1 (two objects bad on first read)
  assert_same(sub, versions[1])
  assert sub.stats.refetches == 2 and sub.stats.fallbacks == 0


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_persistent_corruption_never_reaches_the_weights(tmp_path, how):
  root = tmp_path / "stream"
  store = Store.open(f"file://{root}")
  versions = history(9)
  pub = Publisher(store, keyframe_every=4, retain=10)
  sub = Subscriber(store)
  for v in range(5):
    pub.publish(versions[v], v)
  assert sub.poll() == 4
  m = pub.publish(versions[5], 5)
  victim = root / m.tensors["layer/w"].shards[0].key
  if how == "delete":
    victim.unlink()
  else:
    data = victim.read_bytes()
    victim.write_bytes(_flip(data) if how == "flip" else data[: len(data) // 2])
  assert sub.poll() is None  # 5 cannot be verified: the weights stay at 4
  assert sub.version == 4
  assert_same(sub, versions[4])
  assert sub.stats.refetches == 1 and sub.stats.errors
  for v in range(6, 8):
    pub.publish(versions[v], v)
  assert sub.poll() is None and sub.version == 4  # 6, 7 need 5 too
  pub.publish(versions[8], 8)  # a keyframe: the way around the bad object
  assert sub.poll() == 8
  assert_same(sub, versions[8])


def test_diverged_weights_are_rolled_back_and_rejoined():
  store = Store.open("memory://")
  versions = history(4)
  pub = Publisher(store, keyframe_every=10)
  sub = Subscriber(store)
  pub.publish(versions[0], 0)
  pub.publish(versions[1], 1)
  sub.poll()
  # simulate memory corruption on the rollout host: one weight of one tensor changes
  tensors = sub._tensors
  tensors["layer/w"] = tensors["layer/w"].at[0, 0].add(1.0)
  pub.publish(versions[2], 2)
  assert sub.poll() == 2  # the delta's checksum fails, rolls back, keyframe 0 + 1 + 2
  assert_same(sub, versions[2])
  assert any("checksum mismatch" in e for e in sub.stats.errors)
  assert sub.stats.keyframes_loaded == 2 and sub.stats.fallbacks == 1


_KILLED_PUBLISHER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from rljax.sync import Publisher, Store
    from tests.test_sync_stream import history

    class DiesBeforeManifest(Store):
      def write_many(self, items):
        if any(k.startswith("manifests/000000000002") for k in items):
          os.kill(os.getpid(), signal.SIGKILL)  # between the delta writes and the manifest
        super().write_many(items)

    inner = Store.open({url!r})
    pub = Publisher(DiesBeforeManifest(inner.kvstore, driver="file"), keyframe_every=10)
    for v, params in enumerate(history(3)):
      pub.publish(params, v)
""")


def test_killed_publisher_leaves_no_visible_version(tmp_path):
  root = tmp_path / "stream"
  url = f"file://{root}"
  repo = str(pathlib.Path(__file__).parents[1])
  proc = subprocess.run([sys.executable, "-c", _KILLED_PUBLISHER.format(repo=repo, url=url)],
                        capture_output=True, text=True, timeout=120, cwd=repo)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert any((root / "objects" / fmt.version_name(2)).rglob("*.*"))  # orphan deltas
  assert not (root / fmt.manifest_key(2)).exists()
  store = Store.open(url)
  sub = Subscriber(store)
  assert sub.poll() == 1
  versions = history(4)
  assert_same(sub, versions[1])
  pub = Publisher(store, keyframe_every=10)  # a restarted trainer
  assert pub.version == 1
  orphans = root / "objects" / fmt.version_name(2)
  assert not any(p.is_file() for p in orphans.rglob("*"))  # removed on restart
  pub.publish(versions[2], 2)  # no parent in memory: a keyframe
  pub.publish(versions[3], 3)
  assert sub.poll() == 3
  assert_same(sub, versions[3])


def test_reader_racing_the_writer_sees_only_whole_versions(tmp_path):
  store = Store.open(f"file://{tmp_path}/stream")
  versions = history(30)
  pub = Publisher(store, keyframe_every=3, retain=2)  # collects while the reader reads
  sub = Subscriber(Store.open(f"file://{tmp_path}/stream"))
  done = threading.Event()
  errors = []

  def write():
    try:
      for v, params in enumerate(versions):
        pub.publish(params, v)
    except Exception as e:
      errors.append(e)
    finally:
      done.set()

  writer = threading.Thread(target=write)
  writer.start()
  seen = []
  while not done.is_set() or sub.version != len(versions) - 1:
    if sub.poll() is not None:
      assert_same(sub, versions[sub.version])
      seen.append(sub.version)
    if done.is_set() and errors:
      break
  writer.join()
  assert not errors, errors
  assert seen[-1] == len(versions) - 1 and seen == sorted(seen)
  assert len(seen) >= 2


def test_resume_after_restart_continues_with_deltas(store):
  versions = history(8)
  pub = Publisher(store, keyframe_every=5, retain=10)
  for v in range(4):
    pub.publish(versions[v], v)
  sub = Subscriber(store)
  sub.poll()
  restarted = Publisher(store, keyframe_every=5, retain=10)
  assert restarted.version == 3
  with pytest.raises(StreamError, match="does not match"):
    restarted.resume(versions[2], 3)
  restarted.resume(versions[3], 3)
  m = restarted.publish(versions[4], 4)
  assert not m.keyframe and m.parent == 3
  assert restarted.publish(versions[5], 5).keyframe  # still every 5: 0, 5, ...
  assert sub.poll() == 5 and sub.stats.keyframes_loaded == 1
  assert_same(sub, versions[5])


def test_bad_inputs_have_clear_errors(store, tmp_path):
  pub = Publisher(store)
  pub.publish(make_params(), 3)
  with pytest.raises(ValueError, match="not newer"):
    pub.publish(make_params(), 3)
  with pytest.raises(TypeError, match="nested dicts"):
    pub.publish([np.zeros(3)], 4)
  with pytest.raises(ValueError, match="without '/'"):
    pub.publish({"a/b": np.zeros(3)}, 4)
  with pytest.raises(ValueError, match="keyframe codec"):
    Publisher(store, keyframe_codec="rice")
  with pytest.raises(ValueError, match="unsupported store URL"):
    Store.open("s3://bucket/x")
  with pytest.raises(StreamError, match="poll"):
    Subscriber(Store.open("memory://")).params


def test_resuming_behind_the_newest_version_keeps_its_chain(store):
  """A trainer restored to version 1 publishes 6 with parent 1 while 2..5 (an abandoned
  lineage, with keyframe 3) are newer: collection must keep 6's chain (0, 1)."""
  versions = history(7)
  pub = Publisher(store, keyframe_every=3, retain=4)
  for v in range(6):
    pub.publish(versions[v], v)
  behind = Subscriber(store)
  assert behind.poll() == 5
  restarted = Publisher(store, keyframe_every=3, retain=4)  # keeps 3..6: keyframes 3, 0
  restarted.resume(versions[1], 1)
  branch = step(versions[1], np.random.default_rng(9))
  m = restarted.publish(branch, 6)
  assert (m.parent, m.keyframe_version) == (1, 0)
  fresh = Subscriber(store)
  assert fresh.poll() == 6 and behind.poll() == 6
  assert_same(fresh, branch)
  assert_same(behind, branch)
