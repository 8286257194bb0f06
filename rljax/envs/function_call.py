"""Function calling through a chat template: 3-digit products with a `multiply` tool the
policy calls the way a Qwen3 model does (`<tool_call>{json}</tool_call>`, read by the
hermes parser into OpenAI `tool_calls`), not by writing a program.

The episode is the token sequence the OpenAI endpoint (rljax.serving) records for the same
conversation driven by a function-calling harness, token for token:

  prompt     the chat template's render of [user: "What is 123 * 456?"] with TOOLS
  action 1   <tool_call>\\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}\\n
             </tool_call><|im_end|>                     policy tokens (loss_mask 1)
  obs        the template's text after the reply for [tool: "56088"]
             (rljax.envs.chat.render_after_reply: the tool response and the next
             assistant header; <|im_end|> was sampled)  env tokens (loss_mask 0)
  action 2   56088<|im_end|>                            policy tokens; no call: the end

`step` runs the calls of an action that holds well-formed ones (`call_tool`: an unknown
tool or bad arguments is an "error: ..." response, counted in `tool_errors`); an action
without one (plain content, or a malformed call: the model's outcome) ends the episode, as
the harness does with a reply without `tool_calls`. `verify`: the final reply's content is
the product. The same env gives the harness its messages and tools (`messages`, TOOLS),
the tool (`call_tool`) and the reward (`reward_of`), so an in-process episode and an
endpoint episode are scored alike. The tokenizer must be a `transformers` one whose chat
template renders tools and tool calls (TOOLS_TEMPLATE: Qwen3's layout, its instructions
shortened for a 128-token context); `examples/function_call_tokenizer/` is one.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from rljax.envs.arithmetic import canonical_key, draw_operand
from rljax.envs.base import BaseEnv, SFTTarget, StepResult, Task, Verdict
from rljax.envs.chat import hermes_tool_calls, render_after_reply, render_prompt

TOOL_NAME = "multiply"
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME, "description": "a * b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]

# Qwen3's tool layout (tools as JSON in a system block, calls as <tool_call> blocks, tool
# replies as <tool_response> in a user turn), its instructions shortened
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + "
    "call.function.arguments + '}\\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def call_tool(name: str, arguments: str) -> tuple[str, bool]:
  """The tool's response to one call (`arguments`: JSON text) and whether it is an error
  (the model's: an unknown tool, arguments that are not two integers a and b)."""
  if name != TOOL_NAME:
    return f"error: unknown tool {name[:40]!r}", True
  try:
    args = json.loads(arguments)
  except ValueError:
    return "error: arguments are not JSON", True
  if (not isinstance(args, dict) or set(args) != {"a", "b"}
      or not all(isinstance(args[k], int) and not isinstance(args[k], bool) for k in "ab")):
    return "error: multiply takes integers a and b", True
  return str(args["a"] * args["b"]), False


def call_text(a: int, b: int) -> str:
  """A reply that calls the tool, as the template renders the call (a demonstration)."""
  return ('<tool_call>\n{"name": "' + TOOL_NAME + '", "arguments": '
          + json.dumps({"a": a, "b": b}) + '}\n</tool_call>')


class FunctionCallEnv(BaseEnv):
  name = "function_call"
  tools = TOOLS  # what a harness sends (rljax.serving.harness)
  call_tool = staticmethod(call_tool)

  def __init__(self, *, min_digits: int = 3, max_digits: int = 3, max_turns: int = 3,
               **kwargs):
    super().__init__(**kwargs)
    if not 1 <= min_digits <= max_digits:
      raise ValueError("need 1 <= min_digits <= max_digits")
    if max_turns < 1:
      raise ValueError("max_turns must be >= 1")
    self.hf = getattr(self.tokenizer, "hf", None)
    if self.hf is None or not self.hf.chat_template:
      raise ValueError("function_call needs a transformers tokenizer with a chat template "
                       "that renders tools (config.tokenizer kind='hf'; e.g. "
                       "examples/function_call_tokenizer)")
    rendered = render_prompt(self.hf, [{"role": "user", "content": "?"}], TOOLS)
    if TOOL_NAME not in rendered:
      raise ValueError(f"the chat template of {self.tokenizer.name} does not render tools")
    self.min_digits, self.max_digits, self.max_turns = min_digits, max_digits, max_turns

  # ---------------------------------------------------------------- the conversation

  @staticmethod
  def messages(task: Task) -> list[dict]:
    """The harness's first messages for `task`."""
    return [{"role": "user", "content": task.task_id}]

  @staticmethod
  def reward_of(task: Task, final_content: str | None) -> float:
    """1.0 when the final reply's content is the product, else 0.0."""
    return float((final_content or "").strip() == str(task.data["result"]))

  def _sample(self, rng: np.random.Generator) -> Task:
    a, b = (draw_operand(rng, self.min_digits, self.max_digits) for _ in range(2))
    text = f"What is {a} * {b}?"
    ids = self.tokenizer.encode(render_prompt(self.hf, [{"role": "user", "content": text}],
                                              TOOLS))
    return Task(self.name, text, canonical_key((a, b), ("*",)), ids, str(a * b),
                {"a": a, "b": b, "result": a * b})

  def _observation(self, task: Task, reply: Mapping[str, Any], results: list[str],
                   stop_id: int | None) -> np.ndarray:
    """The tokens the template appends after the reply for its tool responses."""
    stop_text = "" if stop_id is None else self.tokenizer.decode([stop_id])
    new = [{"role": "tool", "tool_call_id": f"call_{i}", "content": r}
           for i, r in enumerate(results)]
    history = self.messages(task) + [dict(reply, role="assistant")]
    return self.tokenizer.encode(render_after_reply(self.hf, history, new, TOOLS, stop_text))

  # ------------------------------------------------------------------------- the env

  def step(self, task: Task, history_ids: np.ndarray, action_ids: np.ndarray) -> StepResult:
    self.latency.sleep()
    action = np.asarray(action_ids).reshape(-1)
    stopped = len(action) and int(action[-1]) in self.tokenizer.stop_ids
    turn = self._tool_responses(history_ids) + 1
    text = self._decode(action[:-1] if stopped else action)
    parsed = None if text is None or not stopped else hermes_tool_calls(text)
    if parsed is None or turn >= self.max_turns:
      return StepResult(None, True)
    content, calls = parsed
    responses = [call_tool(c["name"], c["arguments"]) for c in calls]
    reply = {"content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": c} for i, c in enumerate(calls)]}
    obs = self._observation(task, reply, [r for r, _ in responses], int(action[-1]))
    return StepResult(obs, False, info={"tool_calls": len(calls),
                                        "tool_errors": sum(e for _, e in responses)})

  def _tool_responses(self, history_ids: np.ndarray) -> int:
    """Earlier observations (tool responses) in the completion so far."""
    text = self._decode(np.asarray(history_ids).reshape(-1)) or ""
    return text.count("<tool_response>")

  def verify(self, task: Task, completion_ids: np.ndarray) -> Verdict:
    ids = np.asarray(completion_ids).reshape(-1)
    if not len(ids) or int(ids[-1]) not in self.tokenizer.stop_ids:
      return Verdict.model_failure("no eos")  # the last reply was cut
    text = self._decode(ids[:-1])
    if text is None:
      return Verdict.model_failure("undecodable")
    final = text.rsplit("<|im_start|>assistant\n", 1)[-1]
    calls = text.count("<tool_call>")
    if hermes_tool_calls(final) is not None:
      return Verdict.model_failure("ended on a tool call", tool_calls=calls)
    if self.reward_of(task, final):
      return Verdict.success(tool_calls=calls)
    return Verdict.model_failure("wrong answer", tool_calls=calls)

  def sft_target(self, task: Task) -> SFTTarget:
    """One call, its response (loss_mask 0), then the product."""
    tok, eos = self.tokenizer, self.tokenizer.eos_id
    a, b = task.data["a"], task.data["b"]
    call = np.concatenate([tok.encode(call_text(a, b)), [eos]])
    reply = {"content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": TOOL_NAME, "arguments": json.dumps({"a": a, "b": b})}}]}
    obs = self._observation(task, reply, [task.answer], eos)
    answer = np.concatenate([tok.encode(task.answer), [eos]])
    ids = np.concatenate([call, obs, answer]).astype(np.int32)
    mask = np.concatenate([np.ones(len(call)), np.zeros(len(obs)), np.ones(len(answer))])
    return SFTTarget(ids, mask.astype(bool))
