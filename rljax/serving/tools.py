"""Function calling: a request's `tools` checked, and the model's tool calls parsed out of
its reply's text by a parser chosen per model family.

A parser is `parse(text) -> (content, calls) | None`: `calls` a non-empty list of
{"name": str, "arguments": str (JSON)} and `content` the text around them (None when
empty); None when the text holds no well-formed tool call (malformed ones included: the
model's outcome, returned as content). `load_tool_parser(spec)`: "hermes" (Qwen3, Hermes:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), "none", or an import path
`package.module:function`. A parser that raises counts as no tool call.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

from rljax.envs.chat import hermes_tool_calls
from rljax.serving.api import ApiError

ToolParser = Callable[[str], "tuple[str | None, list[dict]] | None"]

PARSERS: dict[str, ToolParser | None] = {"hermes": hermes_tool_calls, "qwen3": hermes_tool_calls,
                                         "none": None}


def load_tool_parser(spec: str | None) -> ToolParser | None:
  """"hermes" / "qwen3" / "none" / None, or `package.module:function`."""
  if spec is None or spec in PARSERS:
    return PARSERS.get(spec or "none")
  module, _, name = spec.partition(":")
  if not module or not name:
    raise ValueError(f"tool parser {spec!r}: one of {sorted(PARSERS)} or package.module:function")
  return getattr(importlib.import_module(module), name)


def parse_tool_calls(parser: ToolParser | None, text: str
                     ) -> tuple[str | None, list[dict]] | None:
  """The parser on a reply's text; never raises (a parser's error: no tool call)."""
  if parser is None:
    return None
  try:
    out = parser(text)
  except Exception:  # pylint: disable=broad-except  (the model's text, someone's parser)
    return None
  if out is None:
    return None
  content, calls = out
  if not calls or not all(isinstance(c, Mapping) and isinstance(c.get("name"), str)
                          and isinstance(c.get("arguments"), str) for c in calls):
    return None
  return content, [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


def check_tools(tools: Any, tool_choice: Any) -> list[dict] | None:
  """The request's tools (None: none) for the chat template; `tool_choice` "auto" (or
  absent) lets the model choose, "none" renders the tools and parses no call; forcing a
  call ("required", a named function) is refused: the model's own choice is what trains."""
  if tools is None or tools == []:
    tools = None
  elif not isinstance(tools, list) or not all(
      isinstance(t, Mapping) and t.get("type") == "function" and isinstance(
          t.get("function"), Mapping) and isinstance(t["function"].get("name"), str)
      for t in tools):
    raise ApiError(400, "tools must be a list of {'type': 'function', 'function': {'name', "
                   "'description'?, 'parameters'?}}", param="tools")
  if tool_choice not in (None, "auto", "none"):
    raise ApiError(400, f"tool_choice={str(tool_choice)[:80]}: only 'auto' and 'none' (the "
                   "model chooses; a forced call is not sampled from the policy)",
                   "unsupported_parameter", param="tool_choice")
  return None if tools is None else [dict(t) for t in tools]


def wire_tool_calls(calls: list[dict], prefix: str) -> list[dict]:
  """Parsed calls as OpenAI's `message.tool_calls`."""
  return [{"id": f"{prefix}_{i}", "type": "function",
           "function": {"name": c["name"], "arguments": c["arguments"]}}
          for i, c in enumerate(calls)]
