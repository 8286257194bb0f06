"""The weight stream on real remote stores: GCS (a fake-gcs-server started here, on
127.0.0.1) and read-only HTTP (a local static server over a file stream)."""

import functools
import http.server
import threading

import pytest

from rljax.sync import Publisher, Store, Subscriber
from rljax.sync import manifest as fmt
from tests.fake_gcs import fake_gcs
from tests.test_sync_stream import assert_same, history

BUCKET = "rljax-stream"


@pytest.fixture(scope="module")
def gcs():
  """A fake GCS on 127.0.0.1 with one bucket; tensorstore's gcs driver pointed at it."""
  with fake_gcs(BUCKET) as url:
    yield url


def test_gcs_publish_follow_collect_and_recover(gcs):
  del gcs
  url = f"gs://{BUCKET}/runs/a"
  versions = history(10)
  pub = Publisher(url, keyframe_every=3, retain=2)
  sub = Subscriber(url)
  for v in range(6):
    pub.publish(versions[v], v)
    assert sub.poll() == v
    assert_same(sub, versions[v])
  store = Store.open(url)
  assert [fmt.parse_manifest_key(k) for k in store.list(fmt.MANIFESTS)] == [3, 4, 5]
  assert {k.split("/")[1] for k in store.list(fmt.OBJECTS)} == {
      fmt.version_name(v) for v in (3, 4, 5)}

  m = pub.publish(versions[6], 6)  # a keyframe (with deltas): corrupt one delta object
  key = m.deltas["layer/w"].shards[0].key
  data = bytearray(store.read(key))
  data[5] ^= 0xFF
  store.write(key, bytes(data))
  assert sub.poll() == 6  # delta fails twice -> keyframe 6
  assert_same(sub, versions[6])
  assert sub.stats.refetches == 1 and sub.stats.fallbacks == 1

  store.write(fmt.object_key(7, "layer/w", ((0, 1),)), b"orphan of a killed publisher")
  restarted = Publisher(url, keyframe_every=3, retain=2)
  assert restarted.version == 6 and not store.list(fmt.objects_prefix(7))
  restarted.resume(versions[6], 6)
  restarted.publish(versions[7], 7)
  joiner = Subscriber(url)
  assert joiner.poll() == 7 and sub.poll() == 7
  assert_same(joiner, versions[7])
  assert_same(sub, versions[7])


@pytest.fixture
def static_http(tmp_path):
  """A read-only HTTP server over tmp_path/www (missing files are 404s)."""
  root = tmp_path / "www"
  root.mkdir()

  class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(
      ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield root, f"http://127.0.0.1:{server.server_port}/stream/"
  server.shutdown()
  server.server_close()


def test_http_subscriber_follows_a_file_stream(static_http):
  root, url = static_http
  versions = history(6)
  pub = Publisher(f"file://{root}/stream", keyframe_every=4, retain=10)
  reader = Subscriber(url)
  assert reader.poll() is None  # nothing published: `latest` is a 404
  for v in range(6):
    pub.publish(versions[v], v)
    if v in (1, 2, 5):
      assert reader.poll() == v
      assert_same(reader, versions[v])
  assert reader.stats.keyframes_loaded == 1
  ro = Store.open(url)
  assert ro.read_only and not ro.can_list
  with pytest.raises(PermissionError):
    ro.write("x", b"y")
  with pytest.raises(ValueError, match="writable"):
    Publisher(url)
