"""Trained weights out of the Tinker service as files: `save_weights_external` and the
download the SDK and the cookbook make of it.

The path the tinker SDK 0.38 and tinker-cookbook 0.6.1 download weights by:

  TrainingClient.save_weights_external(name, ttl_seconds=, age_encryption_recipients=)
      -> tinker://<model_id>/external_weights/<name>
  RestClient.get_external_weights_urls(path)
      GET /api/v1/training_runs/<model_id>/checkpoints/external_weights/<name>/external_weights_urls
      -> {"urls": {file: url}, "expires": time}; each url a plain GET (no auth header)
  tinker_cookbook.weights.download(tinker_path=, output_dir=)  (and `tinker checkpoint
      download`): fetches those urls; given a save_state path (tinker://.../weights/<name>)
      it loads the state into a new client, exports it encrypted to a fresh age key, fetches,
      decrypts, then deletes the export (DELETE .../checkpoints/<id>) after renewing its TTL
      (PUT .../checkpoints/<id>/ttl). Sampler paths are refused by both, client side.

Here an export is the client's adapters as a PEFT adapter of the base that
`rljax.model.hf_export` writes (`rljax.model.lora_export`: adapter_model.safetensors +
adapter_config.json), each file age-encrypted to the request's recipients (then named
`<file>.age`) when it names any. The urls are this server's own,
`/api/v1/external_weights_files/<token>/<file>`, the token a random secret of the export
(what a signed URL is: whoever holds it may fetch, without the API key).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import secrets
import shutil
import threading
import time
from typing import Any

from rljax.model.lora_export import export_peft
from rljax.tinker.states import check_name
from rljax.tinker.training import UserError

KIND = "external_weights"
FILES_ROUTE = "external_weights_files"  # /api/v1/<FILES_ROUTE>/<token>/<file>
URL_LIFETIME_S = 3600
MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 24 * 3600  # the SDK's documented range
MAX_RECIPIENTS = 10
AGE_SUFFIX = ".age"


class WeightsNotFound(LookupError):
  """No such export (or it expired): the SDK's NotFoundError (404)."""


def external_path(model_id: str, name: str) -> str:
  return f"tinker://{model_id}/{KIND}/{name}"


@dataclasses.dataclass
class Export:
  directory: str
  token: str  # the secret in its download urls
  files: tuple[str, ...]
  expires_at: float | None  # time.time() after which it is gone; None: never

  def expired(self) -> bool:
    return self.expires_at is not None and time.time() >= self.expires_at


def _ttl(ttl_seconds: Any) -> float | None:
  if ttl_seconds is None:
    return None
  if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool) or not (
      MIN_TTL_S <= ttl_seconds <= MAX_TTL_S):
    raise UserError(f"ttl_seconds must be an int in [{MIN_TTL_S}, {MAX_TTL_S}] or null, got "
                    f"{ttl_seconds!r}")
  return time.time() + ttl_seconds


def _age_recipients(recipients: Any) -> list:
  """pyrage recipients of native `age1...` keys or SSH public keys (UserError names a bad
  one)."""
  if not isinstance(recipients, list) or not recipients or len(recipients) > MAX_RECIPIENTS:
    raise UserError(f"age_encryption_recipients must be a list of 1 to {MAX_RECIPIENTS} "
                    f"keys, got {recipients!r}")
  try:
    import pyrage  # pylint: disable=g-import-not-at-top  (only encrypted exports need it)
  except ImportError:
    raise UserError("age_encryption_recipients: this server has no age library (pip "
                    "install pyrage)") from None
  out = []
  for r in recipients:
    kind = pyrage.ssh if isinstance(r, str) and r.startswith("ssh-") else pyrage.x25519
    try:
      out.append(kind.Recipient.from_str(r))
    except (pyrage.RecipientError, TypeError, ValueError) as e:
      raise UserError(f"age_encryption_recipients: {r!r} is not an age or SSH public key "
                      f"({e})") from None
  return out


def _encrypt_in_place(directory: str, files: list[str], recipients: list) -> list[str]:
  import pyrage  # pylint: disable=g-import-not-at-top
  out = []
  for name in files:
    plain = os.path.join(directory, name)
    with open(plain, "rb") as f:
      data = f.read()
    with open(plain + AGE_SUFFIX, "wb") as f:
      f.write(pyrage.encrypt(data, recipients))
    os.remove(plain)
    out.append(name + AGE_SUFFIX)
  return out


class ExternalWeights:
  """Exports under `root` (`<root>/<model_id>/<name>/`), by tinker:// path; `cfg`: the
  served model's config, `base_model`: its name (adapter_config.json's
  base_model_name_or_path)."""

  def __init__(self, root: str, cfg, base_model: str):
    self.root, self.cfg, self.base_model = root, cfg, base_model
    self._exports: dict[str, Export] = {}  # tinker:// path -> export
    self._lock = threading.Lock()

  def save(self, model_id: str, name: Any, lora, adapters, *, ttl_seconds: Any = None,
           recipients: Any = None) -> tuple[str, int]:
    """Exports `adapters` (a client's, `lora` its config) as `name`; (path, bytes).
    Saving a name again replaces the earlier export (its urls stop working)."""
    name = check_name(name)
    expires_at = _ttl(ttl_seconds)
    age = _age_recipients(recipients) if recipients is not None else None
    path = external_path(model_id, name)
    directory = os.path.join(self.root, model_id.replace(":", "_"), name)
    staging = f"{directory}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    files = export_peft(adapters, self.cfg, lora, staging, base_model_name_or_path=self.base_model)
    if age is not None:
      files = _encrypt_in_place(staging, files, age)
    size = sum(os.path.getsize(os.path.join(staging, f)) for f in files)
    with self._lock:
      shutil.rmtree(directory, ignore_errors=True)
      os.replace(staging, directory)
      self._exports[path] = Export(directory, secrets.token_urlsafe(24), tuple(files),
                                   expires_at)
    return path, size

  def _get(self, model_id: str, checkpoint_id: str, doing: str) -> tuple[str, Export]:
    """(path, export) of a live export; an expired one is deleted here. `doing`: what the
    request does, for the message refusing another kind of checkpoint."""
    if not checkpoint_id.startswith(f"{KIND}/"):
      raise UserError(f"{doing} works on external weights only (tinker://<model_id>/{KIND}/"
                      f"<name>, made by save_weights_external), not {checkpoint_id!r}")
    path = f"tinker://{model_id}/{checkpoint_id}"
    with self._lock:
      export = self._exports.get(path)
      if export is not None and export.expired():
        self._drop(path)
        export = None
    if export is None:
      raise WeightsNotFound(f"no external weights at {path!r}")
    return path, export

  def urls(self, model_id: str, checkpoint_id: str, server_url: str) -> dict:
    """ExternalWeightsUrlsResponse: each file's url on this server (`server_url`: how the
    client reached it), valid for URL_LIFETIME_S or until the export expires."""
    _, export = self._get(model_id, checkpoint_id, "a download")
    expires = time.time() + URL_LIFETIME_S
    if export.expires_at is not None:
      expires = min(expires, export.expires_at)
    stamp = datetime.datetime.fromtimestamp(expires, datetime.timezone.utc)
    return {"urls": {f: f"{server_url}/api/v1/{FILES_ROUTE}/{export.token}/{f}"
                     for f in export.files},
            "expires": stamp.isoformat()}

  def set_ttl(self, model_id: str, checkpoint_id: str, ttl_seconds: Any) -> None:
    _, export = self._get(model_id, checkpoint_id, "a TTL")
    export.expires_at = _ttl(ttl_seconds)

  def delete(self, model_id: str, checkpoint_id: str) -> None:
    path, _ = self._get(model_id, checkpoint_id, "deleting")
    with self._lock:
      self._drop(path)

  def _drop(self, path: str) -> None:
    export = self._exports.pop(path, None)
    if export is not None:
      shutil.rmtree(export.directory, ignore_errors=True)

  def file(self, token: str, name: str) -> str:
    """The local file a download url names (WeightsNotFound: no live export has it)."""
    with self._lock:
      live = [(p, e) for p, e in self._exports.items() if secrets.compare_digest(e.token, token)]
    if not live or name not in live[0][1].files:
      raise WeightsNotFound("no such download (the url is wrong, or its export was deleted "
                            "or expired)")
    path, export = live[0]
    if export.expired():
      with self._lock:
        self._drop(path)
      raise WeightsNotFound(f"the external weights at {path!r} expired")
    return os.path.join(export.directory, name)


def checkpoint_route(route: str) -> tuple[str, str, str] | None:
  """(model_id, checkpoint_id, action) of `training_runs/<model_id>/checkpoints/<kind>/
  <name>[/<action>]`, action '' for the checkpoint itself; None for another route."""
  m = re.fullmatch(r"training_runs/([^/]+)/checkpoints/([^/]+/[^/]+)(?:/([^/]+))?", route)
  return None if m is None else (m.group(1), m.group(2), m.group(3) or "")
