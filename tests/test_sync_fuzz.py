"""Bad bytes in the weight stream: every malformed manifest, `latest` or object (random
bytes, valid JSON of the wrong type, truncations, bit flips, missing keys, wrong-type
fields, wrong shapes / dtypes / codec names, checksum mismatches) gives a StreamError or
a recorded error, never another exception, and a subscriber's weights are always exactly
a version the publisher wrote. Subscribers move on at the next good version; a fresh one
falls back to the newest intact version; a restarted publisher sets corrupt manifests
aside."""

import dataclasses
import json

from hypothesis import HealthCheck, given, settings, strategies as st
import ml_dtypes
import numpy as np
import pytest

from rljax.sync import Publisher, Store, StreamError, Subscriber, codecs
from rljax.sync import manifest as fmt

SHAPES = {"a": {"w": (8, 6)}, "b": (5,), "c": {"d": {"e": (3, 4)}}}
N, KEYFRAME_EVERY = 9, 3  # versions 0..8, keyframes 0, 3, 6
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _history():
  rng = np.random.default_rng(0)
  tree = lambda f: {"a": {"w": f((8, 6))}, "b": f((5,)), "c": {"d": {"e": f((3, 4))}}}
  out = [tree(lambda s: (0.02 * rng.standard_normal(s)).astype(np.float32))]
  for _ in range(N - 1):
    out.append({"a": {"w": out[-1]["a"]["w"] + 1e-4 * rng.standard_normal((8, 6))},
                "b": out[-1]["b"] + 1e-4 * rng.standard_normal(5),
                "c": {"d": {"e": out[-1]["c"]["d"]["e"] + 1e-4 * rng.standard_normal((3, 4))}}})
  return out


def bits(tree):
  return {p: np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)
          for p, x in fmt.flatten(tree).items()}


VERSIONS = _history()
WANT = [bits(p) for p in VERSIONS]
MANIFEST_0 = dataclasses.replace(  # the same bytes every run (hypothesis replays draws)
    Publisher(Store.open("memory://")).publish(VERSIONS[0], 0), created_unix=1.5e9)


class Pristine(tuple):
  def __repr__(self):
    return "pristine"  # hypothesis prints the arguments of a failing example


@pytest.fixture(scope="module")
def pristine():
  """Every key of a stream of versions 0..8 (keyframe_every 3), and its manifests."""
  store = Store.open("memory://")
  pub = Publisher(store, keyframe_every=KEYFRAME_EVERY, retain=100)
  manifests = [pub.publish(p, v) for v, p in enumerate(VERSIONS)]
  keys = store.list()
  return Pristine((dict(zip(keys, store.read_many(keys))), manifests))


def open_store(snapshot, latest, *, without=()):
  store = Store.open("memory://")
  store.write_many({k: v for k, v in snapshot.items()
                    if k != fmt.LATEST_KEY and k not in without})
  set_latest(store, latest)
  return store


def set_latest(store, version):
  store.write(fmt.LATEST_KEY, json.dumps({"version": version}).encode())


def assert_verified(sub, floor=None):
  """The weights are exactly a published version (or none, only if floor is None)."""
  if sub.version is None:
    assert floor is None and sub._tensors is None  # noqa: SLF001
    return
  assert floor is None or sub.version >= floor
  got, want = bits(sub.params), WANT[sub.version]
  assert got.keys() == want.keys()
  for p in want:
    np.testing.assert_array_equal(got[p], want[p], err_msg=f"{p} at {sub.version}")


def version_of(key):
  if key == fmt.LATEST_KEY:
    return None
  return int(key.split("/")[1].split(".")[0])


# ---- mutations ----

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=5)

# values of the right JSON type that are still wrong (the field's name -> candidates)
WRONG = {
    "dtype": ["float32", "int8", "float64", "int4", "nope", "", "bfloat16 "],
    "codec": codecs.names() + ["nope", ""],
    "shape": [[7], [0], [-1], [8, 7], [2**41, 2**41], [], [3, 4, 5]],
    "region": [[[0, 1]], [[0, 9], [0, 6]], [[-1, 8], [0, 6]], [[0, 8]], []],
    "version": [-1, 10**12, 2**64, 0, 99], "parent": [-1, 10**12, 99, 0],
    "keyframe_version": [-1, 10**12, 99, 1], "keyframe": [True, False],
    "checksum": ["xxh3:0123456789abcdef", "xxh3:", "md5:0123456789abcdef"],
    "object_checksum": ["xxh3:0123456789abcdef", "xxh3:0123456789ABCDEF"],
    "key": ["objects/000000000000/a/w/0-8.0-6", "latest", ""],
    "format": ["rljax.weights/1", None], "nbytes": [-1, 2**63],
    "created_unix": [float("inf"), float("nan"), 10**400],
}


def _wrong_value(draw, name, original):
  choices = [json_values.filter(lambda x: type(x) is not type(original))]
  if name in WRONG:
    choices.append(st.sampled_from(WRONG[name]))
  return draw(st.one_of(*choices))


@st.composite
def mutate_json(draw, doc):
  """A copy of `doc` with one value somewhere in it deleted or replaced by a wrong one."""
  doc = json.loads(json.dumps(doc))
  parent, name, node = None, None, doc
  while isinstance(node, (dict, list)) and node and (parent is None or draw(st.booleans())):
    keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
    k = draw(st.sampled_from(keys))
    parent, name, node = node, k, node[k]
  if parent is None:
    return draw(json_values)  # the whole document has the wrong type
  field = name if isinstance(name, str) else None
  if isinstance(parent, dict) and draw(st.booleans()):
    del parent[name]  # a missing key
  else:
    parent[name] = _wrong_value(draw, field, node)
  return doc


@st.composite
def byte_mutation(draw, data):
  how = draw(st.sampled_from(["random", "truncate", "flip", "json"]))
  if how == "random":
    return draw(st.binary(max_size=64))
  if how == "truncate":
    return data[:draw(st.integers(0, max(len(data) - 1, 0)))]
  if how == "flip":
    i = draw(st.integers(0, len(data) - 1))
    return data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1:]
  return json.dumps(draw(json_values)).encode()


def recompute_checksum(doc):
  if isinstance(doc, dict):
    doc.pop("manifest_checksum", None)
    doc["manifest_checksum"] = fmt.manifest_checksum(doc)
  return doc


@st.composite
def corruption(draw, snapshot):
  """{key: bad bytes} for one key of versions 0..5 (or `latest`); manifests may be
  rewritten with a matching manifest checksum (a writer that is wrong, not bit rot), and
  objects with a matching object checksum (exercising the decoders)."""
  kind = draw(st.sampled_from([fmt.LATEST_KEY, fmt.MANIFESTS, fmt.OBJECTS]))
  key = draw(st.sampled_from(sorted(k for k in snapshot if k.startswith(kind) and (
      k == fmt.LATEST_KEY or version_of(k) <= 5))))
  data = snapshot[key]
  if key.startswith(fmt.OBJECTS):
    bad = draw(byte_mutation(data))
    if not draw(st.booleans()):
      return {key: bad}
    v = version_of(key)  # the object passes its checksum: only the decoder stands guard
    doc = json.loads(snapshot[fmt.manifest_key(v)])
    for group in ("tensors", "deltas"):
      for t in (doc[group] or {}).values():
        for s in t["shards"]:
          if s["key"] == key:
            s["object_checksum"] = fmt.checksum(bad)
    return {key: bad, fmt.manifest_key(v): json.dumps(recompute_checksum(doc)).encode()}
  if draw(st.booleans()):
    return {key: draw(byte_mutation(data))}
  doc = draw(mutate_json(json.loads(data)))
  if key != fmt.LATEST_KEY and draw(st.booleans()):
    doc = recompute_checksum(doc)
  return {key: json.dumps(doc).encode()}


# ---- parsing ----


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_manifest_and_latest_parsing_raise_only_stream_errors(data):
  m = MANIFEST_0
  raw = m.to_bytes()
  doc = json.loads(raw)
  for bad in (data.draw(byte_mutation(raw)),
              json.dumps(recompute_checksum(data.draw(mutate_json(doc)))).encode()):
    try:
      parsed = fmt.Manifest.from_bytes(bad)
    except StreamError:
      continue
    # what parses is the same manifest, or one whose every field was checked
    assert parsed == m or isinstance(parsed, fmt.Manifest)
  latest = json.dumps({"version": 3}).encode()
  for bad in (data.draw(byte_mutation(latest)), json.dumps(data.draw(mutate_json(
      {"version": 3}))).encode()):
    try:
      v = fmt.parse_latest(bad)
    except StreamError:
      continue
    assert type(v) is int and 0 <= v < fmt.MAX_VERSION


def test_manifest_bit_flips_and_wrong_types_are_refused():
  m = MANIFEST_0
  raw = m.to_bytes()
  assert fmt.Manifest.from_bytes(raw) == m
  name_at = raw.index(b'"a/w"') + 2
  flipped = raw[:name_at] + b"b" + raw[name_at + 1:]  # a renamed tensor: still valid JSON
  for bad, match in ((flipped, "manifest checksum"), (b"[]", "not an object"),
                     (b"\xff", "not JSON"), (b"3", "not an object")):
    with pytest.raises(StreamError, match=match):
      fmt.Manifest.from_bytes(bad)
  doc = json.loads(raw)
  doc["tensors"]["a/w"]["shape"] = [8, "6"]
  with pytest.raises(StreamError, match="shape"):
    fmt.Manifest.from_bytes(json.dumps(recompute_checksum(doc)).encode())
  doc = json.loads(raw)
  doc["tensors"] = []
  with pytest.raises(StreamError, match="not an object"):
    fmt.Manifest.from_bytes(json.dumps(recompute_checksum(doc)).encode())
  for bad in (b'{"version": -1}', b'{"version": 1e400}', b"[3]", b'{"version": "3"}',
              b'{"version": true}', b'{"v": 3}'):
    with pytest.raises(StreamError):
      fmt.parse_latest(bad)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(codecs.names()), st.data())
def test_decoders_raise_only_value_errors_on_bad_bytes(name, data):
  rng = np.random.default_rng(0)
  old = rng.integers(0, 2**16, 300, dtype=np.uint16)
  new = old.copy()
  new[rng.choice(300, 30, replace=False)] ^= 0x5
  codec = codecs.get(name)
  good = codec.encode(new, None if codec.keyframe else old)
  bad = data.draw(byte_mutation(good))
  try:
    patch = codec.decode(bad, new.size, 2)
  except ValueError:
    return
  assert patch.size == new.size and patch.values.dtype == np.uint16
  if patch.positions is not None:
    assert np.all(np.diff(patch.positions) > 0)
    assert patch.positions.size == 0 or 0 <= patch.positions[0] <= patch.positions[-1] < 300
  else:
    assert patch.values.size == new.size


# ---- subscribers on a corrupt stream ----


@FUZZ
@given(st.data())
def test_subscribers_survive_any_corruption_and_move_on(pristine, data):
  snapshot, _ = pristine
  bad = data.draw(corruption(snapshot))
  store = open_store(snapshot, 2)
  follower = Subscriber(store)
  assert follower.poll() == 2
  store.write_many(bad)
  if fmt.LATEST_KEY not in bad:
    set_latest(store, 5)
  fresh = Subscriber(store)
  touched = {version_of(k) for k in bad} - {None}
  for _ in range(2):  # never raises, and holds only verified weights
    follower.poll()
    fresh.poll()
    assert_verified(follower, floor=2)
    # keyframe 0 + 1, 2 or keyframe 3 + 4, 5 is intact: only a bad `latest` leaves nothing
    assert_verified(fresh, floor=None if fmt.LATEST_KEY in bad else 2)
  if fmt.LATEST_KEY not in bad and not touched & {3, 4, 5}:
    assert fresh.version == 5 and follower.version == 5
  set_latest(store, 8)  # versions 6..8 are intact: keyframe 6 is the way around
  follower.poll()  # (a `latest` beyond every version already led both here)
  fresh.poll()
  assert follower.version == 8 and fresh.version == 8
  assert_verified(follower)
  assert_verified(fresh)


def test_follower_skips_a_non_object_manifest_and_does_not_fail_forever():
  store = Store.open("memory://")
  pub = Publisher(store, keyframe_every=3, retain=100)
  sub = Subscriber(store)
  for v in range(3):
    pub.publish(VERSIONS[v], v)
  assert sub.poll() == 2
  pub.publish(VERSIONS[3], 3)
  pub.publish(VERSIONS[4], 4)
  store.write(fmt.manifest_key(3), b'["not", "a", "manifest"]')
  for _ in range(3):
    assert sub.poll() is None and sub.version == 2
  assert any("not an object" in e for e in sub.stats.errors)
  for v in range(5, 7):
    pub.publish(VERSIONS[v], v)
  assert sub.poll() == 6  # keyframe 6
  assert_verified(sub)


@pytest.mark.parametrize("how", ["corrupt", "missing", "keyframe"])
def test_fresh_subscriber_falls_back_to_the_newest_intact_version(pristine, how):
  snapshot, manifests = pristine
  if how == "keyframe":  # keyframe 3's objects are bad: 5 needs them, 0 + 1 + 2 do not
    store = open_store(snapshot, 5)
    for t in manifests[3].tensors.values():
      store.write(t.shards[0].key, b"rot")
    want = 2
  else:
    store = open_store(snapshot, 5, without={fmt.manifest_key(5)} if how == "missing" else ())
    if how == "corrupt":
      store.write(fmt.manifest_key(5), snapshot[fmt.manifest_key(5)][:-20])
    want = 4
  sub = Subscriber(store)
  assert sub.poll() == want
  assert_verified(sub)
  assert sub.stats.errors
  # a subscriber that cannot list (http) counts the version numbers down instead
  store.can_list = False
  blind = Subscriber(store)
  assert blind.poll() == want
  assert_verified(blind)


def test_restarted_publisher_sets_corrupt_manifests_aside(caplog):
  store = Store.open("memory://")
  pub = Publisher(store, keyframe_every=3, retain=100)
  for v in range(6):
    pub.publish(VERSIONS[v], v)
  store.write(fmt.manifest_key(4), b"{}")
  store.write(fmt.manifest_key(5), b"\x00garbage")
  store.write(fmt.LATEST_KEY, b"[5]")
  with caplog.at_level("WARNING"):
    restarted = Publisher(store, keyframe_every=3, retain=100)
  assert restarted.set_aside == [4, 5] and restarted.version == 3
  assert "version 4" in caplog.text and "version 5" in caplog.text
  assert [fmt.parse_manifest_key(k) for k in store.list(fmt.MANIFESTS)] == [0, 1, 2, 3]
  assert store.read(fmt.set_aside_key(5)) == b"\x00garbage"
  assert not store.list(fmt.objects_prefix(5))  # 5's objects went with it (newest + 1 on)
  assert fmt.parse_latest(store.read(fmt.LATEST_KEY)) == 3
  restarted.resume(VERSIONS[3], 3)
  m = restarted.publish(VERSIONS[4], 4)
  assert not m.keyframe and m.parent == 3
  sub = Subscriber(store)
  assert sub.poll() == 4
  assert_verified(sub)
  # resumed on a chain through a set-aside version: the next version is a keyframe
  store.write(fmt.manifest_key(3), b"null")
  again = Publisher(store, keyframe_every=3, retain=100)
  assert again.set_aside == [3] and again.version == 4
  again.resume(VERSIONS[4], 4)
  assert again.publish(VERSIONS[5], 5).keyframe
  fresh = Subscriber(store)
  assert fresh.poll() == 5
  assert_verified(fresh)


def test_device_apply_of_add_patches_matches_numpy():
  """The subscriber's scatter uses codecs.ordered/unordered on device: the same wrapping
  ulp steps as the numpy path, on signed zeros, NaNs, infinities and sign flips."""
  import jax  # pylint: disable=import-outside-toplevel
  from rljax.sync.subscriber import apply_on_device  # pylint: disable=import-outside-toplevel
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-38, -1e-38, 3e38, 1.0, -1.0])
  old = codecs.bits_view(np.resize(special, 64).astype(ml_dtypes.bfloat16)).copy()
  new = old.copy()
  new[::3] = np.random.default_rng(1).integers(0, 2**16, new[::3].size, dtype=np.uint16)
  new[:4] ^= 0x8000
  patch = codecs.get("rice").decode(codecs.get("rice").encode(new, old), old.size, 2)
  x = jax.device_put(old.view(ml_dtypes.bfloat16))
  got = np.asarray(apply_on_device(x, patch)).view(np.uint16)
  np.testing.assert_array_equal(got, new)
