"""`stream: true`: a finished call's response as OpenAI's server-sent events. The turn is
decoded and recorded exactly as without streaming (the same record, bit for bit); its
events are sent when the turn ends (not token by token): a role chunk, the content, each
tool call, the finish reason (with the `rljax` token record), the usage chunk when
`stream_options.include_usage`, then `[DONE]`."""

from __future__ import annotations

import json
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


def events(response: dict, body: Mapping) -> bytes:
  """The SSE body of `response` (a chat.completion or text_completion)."""
  chat = response["object"] == "chat.completion"
  (choice,) = response["choices"]
  head = {"id": response["id"], "object": "chat.completion.chunk" if chat else
          "text_completion", "created": response["created"], "model": response["model"]}
  chunks: list[dict[str, Any]] = []

  def add(part: dict, finish: str | None = None, **extra) -> None:
    chunks.append({**head, "choices": [{"index": 0, **part, "finish_reason": finish}],
                   **extra})

  if chat:
    message = choice["message"]
    add({"delta": {"role": "assistant", "content": ""}, "logprobs": None})
    if message.get("content"):
      add({"delta": {"content": message["content"]}, "logprobs": choice["logprobs"]})
    for i, call in enumerate(message.get("tool_calls") or ()):
      add({"delta": {"tool_calls": [{"index": i, **call}]}, "logprobs": None})
    add({"delta": {}, "logprobs": None}, choice["finish_reason"], rljax=response["rljax"])
  else:
    add({"text": choice["text"], "logprobs": choice["logprobs"]})
    add({"text": "", "logprobs": None}, choice["finish_reason"], rljax=response["rljax"])
  if (body.get("stream_options") or {}).get("include_usage"):
    chunks.append({**head, "choices": [], "usage": response["usage"]})
  out = [f"data: {json.dumps(c, allow_nan=False)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
  return "".join(out).encode()
