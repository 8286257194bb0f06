"""The HTTP side: one `http.server` handler class routing requests to an `Endpoint`."""

from __future__ import annotations

import functools
import http.server
import json
import re
import select
import socket
import urllib.parse

from rljax.serving.api import ApiError
from rljax.serving.stream import StreamWriter, check_stream

_EPISODE_PATH = re.compile(r"^/episodes/([^/]+)(/v1/.*)$")


def _model_card(endpoint, model_id: str | None = None) -> dict:
  """`GET /v1/models/{id}` (404 `model_not_found` for any other id)."""
  if model_id is not None and model_id != endpoint.model_name:
    raise ApiError(404, f"the model {model_id[:80]!r} does not exist", "model_not_found",
                   param="model")
  return {"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "rljax"}


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 1024  # the listen backlog: many clients connect at once (default 5)


def make_server(endpoint, host: str, port: int) -> http.server.ThreadingHTTPServer:
  """The HTTP server of `endpoint` on (host, port) (not started)."""
  return _Server((host, port), make_handler(endpoint))


def make_handler(endpoint):

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rljax-endpoint"

    def log_message(self, *args):  # quiet: no line per request on stderr
      pass

    def _send(self, status: int, body: dict) -> None:
      data = json.dumps(body, allow_nan=False).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def _body(self) -> dict:
      try:
        n = int(self.headers.get("Content-Length") or 0)
      except ValueError:
        n = -1
      if n < 0:
        self.close_connection = True  # the body's end is unknown: the connection is done
        raise ApiError(400, "Content-Length must be a non-negative integer")
      raw = self.rfile.read(n) if n else b""
      try:
        body = json.loads(raw or b"{}")
      except ValueError:
        raise ApiError(400, "the body is not JSON") from None
      if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
      return body

    def _client_gone(self) -> bool:
      """Whether the client closed its end (a timeout, a disconnect) before its reply."""
      try:  # poll, not select: select() fails on descriptors >= 1024 (a busy server's)
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        events = poller.poll(0)
        if not events:
          return False
        if events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
          return True
        return self.connection.recv(1, socket.MSG_PEEK) == b""
      except OSError:
        return True

    def _route(self, method: str) -> None:
      writer, turn = None, None  # turn: a generation call's response (its delivery reported)
      try:
        path, episode = self.path.split("?")[0].rstrip("/"), None
        m = _EPISODE_PATH.match(path)
        if m:
          episode, path = m.group(1), m.group(2)
        body = self._body()  # read whatever came, so a kept-alive connection stays in step
        endpoint.stats["http_requests"] += 1
        generate = method == "POST" and path in ("/v1/chat/completions", "/v1/completions")
        if generate and check_stream(body):
          writer = StreamWriter(self, endpoint, body, chat=path == "/v1/chat/completions")
        on_tokens = None if writer is None else writer.tokens
        if method == "POST" and path == "/v1/chat/completions":
          out = turn = endpoint.chat(body, episode, self.headers, on_tokens=on_tokens,
                                     reports_delivery=True)
        elif method == "POST" and path == "/v1/completions":
          out = turn = endpoint.complete(body, episode, self.headers, on_tokens=on_tokens,
                                         reports_delivery=True)
        elif method == "POST" and path == "/v1/episodes":
          out = endpoint.episode(endpoint.register(body.get("episode_id"),
                                                   body.get("group_id"))).summary()
        elif method == "POST" and path.startswith("/v1/episodes/") and path.endswith("/finish"):
          eid = path[len("/v1/episodes/"):-len("/finish")]
          if "reward" not in body:
            raise ApiError(400, "finish needs {'reward': number}")
          endpoint.finish(eid, body["reward"], body.get("outcome"))
          out = endpoint.episode(eid).summary()
        elif method == "DELETE" and path.startswith("/v1/episodes/"):
          endpoint.drop(path[len("/v1/episodes/"):])
          out = {"deleted": True}
        elif method == "GET" and path.startswith("/v1/episodes/"):
          out = endpoint.episode(path[len("/v1/episodes/"):]).summary()
        elif method == "GET" and path == "/v1/models":
          out = {"object": "list", "data": [_model_card(endpoint)]}
        elif method == "GET" and path.startswith("/v1/models/"):
          out = _model_card(endpoint, urllib.parse.unquote(path[len("/v1/models/"):]))
        elif method == "GET" and path == "/health":
          out = {"ok": endpoint._broken is None}  # pylint: disable=protected-access
        else:
          raise ApiError(404, f"no route {method} {path}", "not_found")
        reply = functools.partial(self._send, 200, out) if writer is None else \
            functools.partial(writer.finish, out)
      except ApiError as e:
        endpoint.stats[f"http_{e.status}"] += 1
        reply = functools.partial(self._send, e.status, e.body())
        if writer is not None and writer.started:
          reply = functools.partial(writer.fail, e)
      except OSError:  # the client went away mid-stream: a retry of the call gets it again
        endpoint.stats["undelivered_replies"] += 1
        self.close_connection = True
        return
      except Exception as e:  # pylint: disable=broad-except
        endpoint.stats["http_500"] += 1
        error = ApiError(500, f"{type(e).__name__}: {e}", kind="server_error")
        reply = functools.partial(self._send, 500, error.body())
        if writer is not None and writer.started:
          reply = functools.partial(writer.fail, error)
      try:
        if turn is not None and self._client_gone():
          raise ConnectionAbortedError
        reply()
      except OSError:  # the client went away (a timeout): a retry of the call gets it again,
        endpoint.stats["undelivered_replies"] += 1  # another call may roll it back
        self.close_connection = True
        if turn is not None:
          endpoint.delivered(turn, False)
        return
      if turn is not None:
        endpoint.delivered(turn, True)

    def do_GET(self):  # pylint: disable=invalid-name
      self._route("GET")

    def do_POST(self):  # pylint: disable=invalid-name
      self._route("POST")

    def do_DELETE(self):  # pylint: disable=invalid-name
      self._route("DELETE")

  return Handler
