"""Writes the tokenizer of configs/function_call_tiny.py to DIR
(examples/function_call_tokenizer is its output, committed):

  .venv/bin/python examples/make_function_call_tokenizer.py DIR

A byte-level BPE (`rljax.envs.tokenizer.train_byte_level_bpe`: up to 1024 ids, 511 learned;
every digit its own token as in Qwen's tokenizers; the fixed phrases merged) with Qwen's
chat tokens and `function_call.TOOLS_TEMPLATE` (Qwen3's tool layout), trained on
conversations of the function_call task rendered by that template: the task's tools,
questions, calls, tool responses (and error responses) and answers, as a model's
tokenizer is trained on its kind of text.
"""

import json
import os
import sys
import tempfile

import numpy as np

from rljax.envs.arithmetic import draw_operand
from rljax.envs.function_call import TOOL_NAME, TOOLS, TOOLS_TEMPLATE, call_text
from rljax.envs.tokenizer import train_byte_level_bpe

VOCAB_SIZE = 1024
CONVERSATIONS = 2000
SEED = 0


def conversations(rng: np.random.Generator, n: int) -> list[list[dict]]:
  """n conversations: a question, a call, its response, the answer (every 8th response an
  error, as the tool gives one)."""
  out = []
  for i in range(n):
    a, b = (draw_operand(rng, 3, 3) for _ in range(2))
    call = {"id": "call_0", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"a": a, "b": b})}}
    response = "error: multiply takes integers a and b" if i % 8 == 7 else str(a * b)
    out.append([{"role": "user", "content": f"What is {a} * {b}?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": response},
                {"role": "assistant", "content": str(a * b)}])
  return out


def main(directory: str) -> None:
  import transformers  # pylint: disable=g-import-not-at-top  (test extras)
  if os.path.exists(os.path.join(directory, "tokenizer.json")):
    sys.exit(f"{directory} already holds a tokenizer")
  with tempfile.TemporaryDirectory() as tmp:  # bytes only: the template, to render the texts
    train_byte_level_bpe(["x"], tmp, vocab_size=0, chat_template=TOOLS_TEMPLATE)
    renderer = transformers.AutoTokenizer.from_pretrained(tmp)
  rng = np.random.default_rng(SEED)
  convs = conversations(rng, CONVERSATIONS)
  texts = [renderer.apply_chat_template(c, tools=TOOLS, tokenize=False) for c in convs]
  args = json.loads(convs[0][1]["tool_calls"][0]["function"]["arguments"])
  if call_text(args["a"], args["b"]) not in texts[0]:  # demonstrations call as it renders
    sys.exit("TOOLS_TEMPLATE renders a tool call other than function_call.call_text")
  train_byte_level_bpe(texts, directory, vocab_size=VOCAB_SIZE, individual_digits=True,
                       chat_template=TOOLS_TEMPLATE)
  print(directory)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  main(sys.argv[1])
