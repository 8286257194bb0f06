"""`stream: true`: OpenAI's server-sent events, over chunked transfer encoding. The turn is
decoded and recorded exactly as without streaming (the same record, bit for bit). While
the engine decodes, the reply's text goes out as the engine steps produce it (`tokens`,
from the engine-owner thread's progress reports), held back where it could still turn out
to be the start of a stop string (and, with tools, until the end: a tool call is parsed
from the whole text); when the turn ends (`finish`), the rest of the content, each tool
call, the finish reason (with the `rljax` token record), the usage chunk when
`stream_options.include_usage`, then `[DONE]`. The deltas' text joined is the
non-streamed reply's content."""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from rljax.serving.api import ApiError


def check_stream(body: Mapping) -> bool:
  """Whether the call streams; `stream_options` only {"include_usage": bool}."""
  stream, options = body.get("stream"), body.get("stream_options")
  if stream not in (None, True, False):
    raise ApiError(400, "stream must be a boolean", param="stream")
  if options is not None and (not stream or not isinstance(options, Mapping) or any(
      k != "include_usage" or not isinstance(v, bool) for k, v in options.items())):
    raise ApiError(400, "stream_options: {'include_usage': bool} with stream=true only",
                   param="stream_options")
  return bool(stream)


class StreamWriter:
  """One streamed call's events, written to `handler` (a BaseHTTPRequestHandler)."""

  def __init__(self, handler, endpoint, body: Mapping, chat: bool):
    self.handler, self.endpoint, self.body, self.chat = handler, endpoint, body, chat
    stop = body.get("stop")
    self.stops = [stop] if isinstance(stop, str) else list(stop or [])
    self.hold_all = chat and bool(body.get("tools")) and body.get("tool_choice") != "none" \
        and endpoint.tool_parser is not None
    self.started, self.sent = False, ""
    self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-stream", "object":
                 "chat.completion.chunk" if chat else "text_completion",
                 "created": int(time.time()), "model": endpoint.model_name}

  def _write(self, data: bytes) -> None:
    self.handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

  def _event(self, chunk: Any) -> None:
    self._start()
    data = "[DONE]" if chunk is None else json.dumps(chunk, allow_nan=False)
    self._write(f"data: {data}\n\n".encode())

  def _start(self) -> None:
    if self.started:
      return
    self.started = True
    h = self.handler
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.send_header("Cache-Control", "no-cache")
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    if self.chat:
      self._delta({"role": "assistant", "content": ""})

  def _delta(self, part: dict, finish: str | None = None, logprobs: Any = None,
             **extra) -> None:
    choice = {"index": 0, "delta": part} if self.chat else {"index": 0, **part}
    self._event({**self.head, "choices": [{**choice, "logprobs": logprobs,
                                           "finish_reason": finish}], **extra})

  def _text(self, text: str) -> None:
    if text:
      self._delta({"content": text} if self.chat else {"text": text})
      self.sent += text

  def tokens(self, sampled: list[int]) -> None:
    """The turn's tokens so far (the engine-owner thread's report): the text that is sure."""
    if self.hold_all:
      return
    ep = self.endpoint
    body = sampled[:-1] if sampled and sampled[-1] in ep.stop_ids else sampled
    text = ep._decode(body).rstrip("\ufffd")  # pylint: disable=protected-access
    found = [text.find(s) for s in self.stops if s in text]
    if found:
      text = text[:min(found)]
    elif self.stops:
      text = text[:max(0, len(text) - max(len(s) for s in self.stops) + 1)]
    if text.startswith(self.sent):
      self._text(text[len(self.sent):])

  def finish(self, response: dict) -> None:
    """The rest of the reply, the finish and usage chunks, `[DONE]`, the stream's end."""
    (choice,) = response["choices"]
    self.head["id"] = response["id"]
    if self.chat:
      message = choice["message"]
      content = message.get("content") or ""
    else:
      content = choice["text"]
    if not content.startswith(self.sent):  # cannot happen: what was sent is sure
      self.endpoint.stats["stream_mismatches"] += 1
    self._start()
    rest = content[len(self.sent):] if content.startswith(self.sent) else content
    if self.chat:
      if rest or choice.get("logprobs"):
        self._delta({"content": rest}, logprobs=choice.get("logprobs"))
      for i, call in enumerate(message.get("tool_calls") or ()):
        self._delta({"tool_calls": [{"index": i, **call}]})
      self._delta({}, choice["finish_reason"], rljax=response["rljax"])
    else:
      self._delta({"text": rest}, logprobs=choice.get("logprobs"))
      self._delta({"text": ""}, choice["finish_reason"], rljax=response["rljax"])
    if (self.body.get("stream_options") or {}).get("include_usage"):
      self._event({**self.head, "choices": [], "usage": response["usage"]})
    self._event(None)
    self._write(b"")  # the last chunk: the stream's end

  def fail(self, error: ApiError) -> None:
    """An error after the stream started: an error event, then the stream's end."""
    self._event(error.body())
    self._event(None)
    self._write(b"")
