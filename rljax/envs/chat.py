"""Chat-template rendering in token space, shared by the OpenAI endpoint (rljax.serving)
and the envs that speak through a chat template (function_call), so both append the same
tokens for the same messages.

An episode is one growing token sequence: a later turn's new tokens are the template's
text *after* the last reply, rendered in context, never a re-tokenization of the history.
`render_after_reply` renders the conversation with the last reply's content replaced by a
sentinel (its tool calls dropped: its sampled tokens, calls included, are recorded
already) and the new messages after it, and returns the text after the sentinel (the
template's close of the reply, the new messages, the generation prompt). Templates that
rewrite earlier turns (Qwen3 drops old reasoning) therefore never change recorded tokens.

`hermes_tool_calls`: the tool-call parser of the Qwen3 / Hermes family,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import json
import re
from typing import Mapping, Sequence

SENTINEL = "\u2063rljax-end-of-reply\u2063"  # stands for the last reply's content in a render


class TemplateError(ValueError):
  """The chat template fails on these messages (its own error)."""


class UnsuitableTemplate(TemplateError):
  """The template does not render the last reply's content exactly once: the server's
  template cannot be applied incrementally, whatever the messages."""


def render_prompt(hf_tokenizer, messages: Sequence[Mapping], tools: list[dict] | None) -> str:
  """The messages (and tools, as the template renders them) with the generation prompt."""
  kwargs = {} if tools is None else {"tools": tools}
  try:
    return hf_tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                            add_generation_prompt=True, **kwargs)
  except Exception as e:  # pylint: disable=broad-except  (a template's own errors)
    raise TemplateError(f"the chat template failed on these messages: {e}") from None


def render_after_reply(hf_tokenizer, history: Sequence[Mapping], new: Sequence[Mapping],
                       tools: list[dict] | None, stop_text: str = "") -> str:
  """The text a turn appends after the last message of `history` (the last reply): the
  template applied to `new` in context. `stop_text`: the text of the stop token the reply
  ended on; when the close of the reply starts with it (<|im_end|>), it is dropped (the
  token was sampled, and is recorded)."""
  context = [dict(m) for m in history]
  context[-1] = {"role": context[-1]["role"], "content": SENTINEL}
  text = render_prompt(hf_tokenizer, context + [dict(m) for m in new], tools)
  if text.count(SENTINEL) != 1:
    raise UnsuitableTemplate("the chat template does not render the last reply's content "
                             "once")
  after = text[text.index(SENTINEL) + len(SENTINEL):]
  if stop_text and after.startswith(stop_text):
    after = after[len(stop_text):]
  return after


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes_tool_calls(text: str) -> tuple[str | None, list[dict]] | None:
  """Qwen3 / Hermes: every `<tool_call>{json}</tool_call>` block, each a JSON object with
  a string `name` and an object `arguments`, as (the text around them or None, the calls
  as {"name", "arguments": JSON text}); any block that is not (or an unclosed
  `<tool_call>`): None, the whole text is content."""
  blocks = _HERMES.findall(text)
  rest = _HERMES.sub("", text)
  if not blocks or "<tool_call>" in rest:
    return None
  calls = []
  for block in blocks:
    try:
      call = json.loads(block.strip())
    except ValueError:
      return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(
        call.get("arguments", {}), dict):
      return None
    calls.append({"name": call["name"],
                  "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)})
  content = rest.strip()
  return (content or None), calls
