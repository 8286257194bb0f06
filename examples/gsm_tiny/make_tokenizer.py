"""Writes a small byte-level BPE tokenizer for the gsm_tiny example to DIR:

  .venv/bin/python examples/gsm_tiny/make_tokenizer.py DIR

trained on the example's own questions and answers (512 ids; Qwen's chat tokens and chat
template, `rljax.envs.tokenizer.train_byte_level_bpe`). A real model's tokenizer directory
works the same way in the config (`config.py:DIR`), with that model's vocabulary.
"""

import json
import os
import sys

from rljax.envs.tokenizer import train_byte_level_bpe

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.jsonl")


def main(directory: str) -> None:
  with open(DATA, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  train_byte_level_bpe([f"{r['question']}\n{r['answer']}" for r in rows], directory,
                       vocab_size=512)
  print(directory)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  main(sys.argv[1])
