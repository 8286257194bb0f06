"""The OpenAI schema's side of the endpoint: errors as OpenAI answers them, which request
parameters are served (every other one is a 400 naming it), the messages of a chat
request, what each finish reason is called."""

from __future__ import annotations

import json
from typing import Any, Mapping

from rljax.rl.trajectory import FinishReason


class ApiError(Exception):
  """An error answered to the client: HTTP status, message, OpenAI-style type and code."""

  def __init__(self, status: int, message: str, code: str | None = None,
               kind: str = "invalid_request_error", param: str | None = None):
    super().__init__(message)
    self.status, self.message, self.code, self.kind = status, message, code, kind
    self.param = param

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "code": self.code,
                      "param": self.param}}


# request fields the endpoint serves (each checked where it is used)
_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                     "logprobs", "user", "episode_id", "group_id", "stream", "stream_options"})
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "metadata",
                         "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# fields accepted only at a value that asks for nothing (some clients always send them)
NO_OP_VALUES = {"presence_penalty": (0,), "frequency_penalty": (0,),
                "logit_bias": ({},), "response_format": ({"type": "text"},),
                "store": (False,)}


def check_fields(body: Mapping, fields: frozenset) -> None:
  """A 400 naming the first parameter this server does not honour (null: not given)."""
  for key, value in body.items():
    if value is None or key in fields:
      continue
    if key in NO_OP_VALUES and any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                   for v in NO_OP_VALUES[key]):
      continue
    raise ApiError(400, f"{key}={str(value)[:80]}: this server does not support {key!r}",
                   "unsupported_parameter", param=key)



def content_text(content: Any, where: str) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in content):
    return "".join(p["text"] for p in content)
  raise ApiError(400, f"{where}: content must be a string or a list of text parts")


def parse_messages(raw: Any) -> list[dict]:
  """The request's messages as {role, content[, name, tool_call_id, tool_calls]} with text
  content (null: "")."""
  if not isinstance(raw, list) or not raw:
    raise ApiError(400, "messages must be a non-empty list")
  out = []
  for i, m in enumerate(raw):
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
      raise ApiError(400, f"messages[{i}] must be an object with a string role")
    msg = {"role": m["role"], "content": content_text(m.get("content") or "",
                                                        f"messages[{i}]")}
    for key in ("name", "tool_call_id"):
      if isinstance(m.get(key), str):
        msg[key] = m[key]
    calls = message_tool_calls(m.get("tool_calls"), f"messages[{i}]")
    if calls is not None:
      if m["role"] != "assistant":
        raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                       param="messages")
      msg["tool_calls"] = calls
    out.append(msg)
  return out


def same_message(a: Mapping, b: Mapping) -> bool:
  """The same message as recorded: role, content and tool calls (see same_tool_calls)."""
  return (a["role"] == b["role"] and a["content"] == b["content"]
          and same_tool_calls(a.get("tool_calls"), b.get("tool_calls")))


def message_tool_calls(raw: Any, where: str) -> list[dict] | None:
  """An assistant message's `tool_calls` from a request, as the template reads them."""
  if raw is None or raw == []:
    return None
  if not isinstance(raw, list):
    raise ApiError(400, f"{where}.tool_calls must be a list", param="messages")
  out = []
  for j, c in enumerate(raw):
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(
        fn.get("arguments"), str):
      raise ApiError(400, f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', "
                     "'function': {'name', 'arguments': JSON text}}", param="messages")
    out.append({"id": str(c.get("id") or f"call_{j}"), "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]}})
  return out


def same_tool_calls(a: list[dict] | None, b: list[dict] | None) -> bool:
  """The same calls (names, and arguments as JSON values: a re-serialised call matches)."""
  def key(calls):
    out = []
    for c in calls or ():
      args = c["function"]["arguments"]
      try:
        args = json.loads(args)
      except ValueError:
        pass
      out.append((c["function"]["name"], args))
    return out
  return key(a) == key(b)


def finish_reason_name(reason: FinishReason) -> str:
  return "length" if reason in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"

