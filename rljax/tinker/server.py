"""The Tinker HTTP API (`/api/v1/...`, as the `tinker` SDK 0.38 speaks it) over a `Service`.

JSON bodies, except `forward_backward` (a protobuf ForwardBackwardRequest) and the results
of forward/backward and sampling futures (protobuf). Errors at submission are JSON
`{"detail": ...}` with `x-should-retry: false`, so the SDK raises its exception for the
status at once instead of retrying. Weight downloads (`rljax.tinker.weights`): a download
url, GET `external_weights_files/<token>/<file>`, streams an export's file as it is.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import shutil
import traceback
import urllib.parse
import uuid

from rljax.tinker.service import ApiError, Service
from rljax.tinker.weights import FILES_ROUTE, checkpoint_route


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 256


def _json_routes(service: Service) -> dict:
  def sample(body):
    future, n = service.sample(body)
    return {"request_id": future.request_id,
            "sample_sequence_ids": [uuid.uuid4().hex for _ in range(n)]}

  def heartbeat(body):
    service.open_session(str(body.get("session_id")))
    return {"type": "session_heartbeat"}

  return {
      # the SDK's transport and chunking: plain httpx, one forward_backward never split
      "client/config": lambda body: {"use_pyqwest_transport": False,
                                     "fwdbwd_max_chunk_len": 1_000_000,
                                     "fwdbwd_max_chunk_bytes_count": 1 << 31},
      "create_session": lambda body: {"session_id": service.create_session()},
      "session_heartbeat": heartbeat,
      "telemetry": lambda body: {"status": "accepted"},
      "create_model": lambda body: _future_reply(service.create_model(body)),
      "get_info": lambda body: service.info(str(body.get("model_id"))),
      "optim_step": lambda body: _future_reply(service.optim_step(body),
                                               model_id=body.get("model_id")),
      "save_weights_for_sampler": lambda body: _future_reply(
          service.save_weights_for_sampler(body), model_id=body.get("model_id")),
      "create_sampling_session": service.create_sampling_session,
      "save_weights": lambda body: _future_reply(service.save_state(body),
                                                 model_id=body.get("model_id")),
      "save_weights_external": lambda body: _future_reply(
          service.save_weights_external(body), model_id=body.get("model_id")),
      "load_weights": lambda body: _future_reply(service.load_state(body)),
      "asample": sample,
  }


def _future_reply(future, **extra) -> dict:
  return {"request_id": future.request_id, **{k: v for k, v in extra.items() if v}}


def make_server(service: Service, host: str, port: int) -> http.server.ThreadingHTTPServer:
  routes = _json_routes(service)

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # requests are not logged line by line
      del fmt, args

    def _send(self, status: int, body: bytes, content_type: str = "application/json"):
      self.send_response(status)
      self.send_header("Content-Type", content_type)
      self.send_header("Content-Length", str(len(body)))
      if status >= 400:
        self.send_header("x-should-retry", "false")
      self.end_headers()
      self.wfile.write(body)

    def _json(self, status: int, obj: dict):
      self._send(status, json.dumps(obj).encode())

    def _handle(self, method: str):
      path = self.path.split("?", 1)[0]
      try:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not path.startswith("/api/v1/"):
          raise ApiError(404, f"no route {path}")
        name = urllib.parse.unquote(path[len("/api/v1/"):])
        if method == "GET" and name.startswith(f"{FILES_ROUTE}/"):
          return self._file(name[len(FILES_ROUTE) + 1:])
        checkpoint = checkpoint_route(name)
        if checkpoint is not None:  # external weights: download urls, TTL, delete
          return self._json(200, service.checkpoint(method, *checkpoint,
                                                    self._body(raw) if raw else {},
                                                    self._server_url()))
        if method != "POST" and method != "GET":
          raise ApiError(404, f"no route {method} {path}")
        if method == "GET":
          return self._json(200, self._get(name))
        if name == "forward_backward":
          future = service.forward_backward(raw)
          return self._json(200, _future_reply(future))
        body = self._body(raw)
        if name == "retrieve_future":
          return self._retrieve(str(body.get("request_id")))
        finish = re.fullmatch(r"sessions/([^/]+)/finish", name)
        if finish:
          service.finish_session(finish.group(1))
          return self._json(200, {})
        if name not in routes:
          raise ApiError(404, f"no route {path}")
        return self._json(200, routes[name](body))
      except ApiError as e:
        self._json(e.status, {"detail": str(e)})
      except (BrokenPipeError, ConnectionResetError):
        pass  # the client went away mid-request
      except Exception as e:  # pylint: disable=broad-except
        logging.error("tinker %s %s:\n%s", method, path, traceback.format_exc())
        self._json(400, {"detail": f"{type(e).__name__}: {e}"})

    def _body(self, raw: bytes) -> dict:
      try:
        body = json.loads(raw or b"{}")
      except ValueError as e:
        raise ApiError(400, f"the body is not JSON: {e}") from None
      if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
      return body

    def _server_url(self) -> str:
      """This server as the client reached it (download urls point back here)."""
      host = self.headers.get("Host")
      if not host:
        host = "%s:%d" % self.server.server_address[:2]
      return f"http://{host}"

    def _file(self, rest: str):
      """A download url's file (`<token>/<file>`), streamed."""
      token, _, file_name = rest.partition("/")
      local = service.external_file(token, file_name)
      with open(local, "rb") as f:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
        self.end_headers()
        shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _get(self, name: str) -> dict:
      if name == "healthz":
        return {"status": "ok"}
      if name.startswith("samplers/"):
        return service.sampler_info(name[len("samplers/"):])
      if name == "get_server_capabilities":
        return {"supported_models": [{"model_name": service.model_name, "trainable": True,
                                      "sampleable": True,
                                      "max_context_length": service.max_tokens}]}
      raise ApiError(404, f"no route /api/v1/{name}")

    def _retrieve(self, request_id: str):
      future = service.result(request_id)
      if not future.done:  # the SDK re-polls a 408 at once, without logging
        return self._json(408, {"type": "try_again", "request_id": request_id,
                                "queue_state": "active"})
      if future.error is not None:
        return self._json(200, future.error)
      if future.proto is not None:
        return self._send(200, future.proto, "application/x-protobuf")
      return self._json(200, future.json)

    def do_GET(self):  # noqa: N802
      self._handle("GET")

    def do_POST(self):  # noqa: N802
      self._handle("POST")

    def do_PUT(self):  # noqa: N802
      self._handle("PUT")

    def do_DELETE(self):  # noqa: N802
      self._handle("DELETE")

  return _Server((host, port), Handler)
