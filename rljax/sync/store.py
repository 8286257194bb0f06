"""One object store for the weight stream: a tensorstore kvstore, any driver.

`Store.open` takes a URL or a tensorstore kvstore spec:

  memory://                      in-process (share the Store object, or a ts.Context)
  file:///abs/dir/               local or network file system
  gs://bucket/prefix/            Google Cloud Storage; TENSORSTORE_GCS_HTTP_URL points the
                                 driver at an emulator (tests use fake-gcs-server)
  http://host/path/, https://…   read-only; no listing (readers need only `latest` and
                                 the keys a manifest names)

Reads of many keys are issued together and awaited together, so they run concurrently.
A missing key reads as None; every other failure raises.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping
from urllib.parse import urlparse

import tensorstore as ts


def kvstore_spec(url: str) -> dict[str, Any]:
  """URL -> tensorstore kvstore spec (the path always ends in '/')."""
  parsed = urlparse(url)
  scheme = parsed.scheme
  if scheme == "memory":
    path = (parsed.netloc + parsed.path).strip("/")
    return {"driver": "memory", "path": f"{path}/" if path else ""}
  if scheme == "file":
    if parsed.netloc:
      raise ValueError(f"file URLs take an absolute path (file:///dir/), got {url!r}")
    return {"driver": "file", "path": parsed.path.rstrip("/") + "/"}
  if scheme == "gs":
    if len(parsed.netloc) < 3:
      raise ValueError(f"GCS bucket names have at least 3 characters, got {parsed.netloc!r}")
    path = parsed.path.strip("/")
    return {"driver": "gcs", "bucket": parsed.netloc, "path": f"{path}/" if path else ""}
  if scheme in ("http", "https"):
    return {"driver": "http", "base_url": url.rstrip("/") + "/"}
  raise ValueError(f"unsupported store URL {url!r}: use memory://, file:///, gs://, http(s)://")


class Store:
  """read / write / list / delete over one kvstore root."""

  def __init__(self, kvstore: ts.KvStore, *, driver: str):
    self.kvstore = kvstore
    self.driver = driver
    self.read_only = driver == "http"
    self.can_list = driver != "http"

  @classmethod
  def open(cls, where: "str | Mapping[str, Any] | Store",
           context: ts.Context | None = None) -> "Store":
    if isinstance(where, Store):
      return where
    spec = kvstore_spec(where) if isinstance(where, str) else dict(where)
    kv = ts.KvStore.open(spec, context=context).result()
    return cls(kv, driver=spec["driver"])

  @property
  def url(self) -> str:
    try:
      return self.kvstore.url
    except Exception:
      return repr(self.kvstore.spec().to_json())

  def __repr__(self) -> str:
    return f"Store({self.url})"

  # reads

  def read(self, key: str) -> bytes | None:
    return self.read_many([key])[0]

  def read_many(self, keys: Iterable[str]) -> list[bytes | None]:
    futures = [self.kvstore.read(k) for k in keys]
    out = []
    for f in futures:
      r = f.result()
      out.append(bytes(r.value) if r.state == "value" else None)
    return out

  def list(self, prefix: str = "") -> list[str]:
    """Sorted keys under `prefix`."""
    if not self.can_list:
      raise NotImplementedError(f"the {self.driver} kvstore cannot list keys")
    keys = self.kvstore.list(_prefix_range(prefix)).result()
    return sorted(k.decode() for k in keys)

  # writes

  def _writable(self) -> None:
    if self.read_only:
      raise PermissionError(f"{self} is read-only")

  def write(self, key: str, value: bytes) -> None:
    self.write_many({key: value})

  def write_many(self, items: Mapping[str, bytes]) -> None:
    self._writable()
    futures = [self.kvstore.write(k, v) for k, v in items.items()]
    for f in futures:
      f.result()

  def delete(self, key: str) -> None:
    self._writable()
    self.kvstore.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()

  def delete_prefix(self, prefix: str) -> None:
    self._writable()
    self.kvstore.delete_range(_prefix_range(prefix)).result()

  def delete_range(self, start: str, stop: str) -> None:
    """Deletes keys in [start, stop)."""
    self._writable()
    self.kvstore.delete_range(ts.KvStore.KeyRange(start, stop)).result()


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
  if not prefix:
    return ts.KvStore.KeyRange()
  # the smallest key greater than every key starting with `prefix`
  stop = prefix[:-1] + chr(ord(prefix[-1]) + 1)
  return ts.KvStore.KeyRange(prefix, stop)
