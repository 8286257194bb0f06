"""The OpenAI schema's side of the endpoint: errors as OpenAI answers them, which request
parameters are served (every other one is a 400 naming it), the messages of a chat
request, what each finish reason is called."""

from __future__ import annotations

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
                     "logprobs", "user", "episode_id"})
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "metadata"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# fields accepted only at a value that asks for nothing (some clients always send them)
NO_OP_VALUES = {"stream": (False,), "presence_penalty": (0,), "frequency_penalty": (0,),
                "logit_bias": ({},), "response_format": ({"type": "text"},),
                "store": (False,), "tools": ([],), "tool_choice": ("none", "auto"),
                "parallel_tool_calls": (True, False)}


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
  """The request's messages as {role, content[, name, tool_call_id]} with text content."""
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
    if m.get("tool_calls"):
      raise ApiError(400, f"messages[{i}]: tool_calls are not supported (the model's tool "
                     "calls are text in its reply's content)")
    out.append(msg)
  return out


def same_message(a: Mapping, b: Mapping) -> bool:
  return a["role"] == b["role"] and a["content"] == b["content"]


def finish_reason_name(reason: FinishReason) -> str:
  return "length" if reason in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"

