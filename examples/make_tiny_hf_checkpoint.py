"""Writes a tiny random Qwen3-MoE Hugging Face checkpoint, with a tokenizer, to DIR:

  .venv/bin/python examples/make_tiny_hf_checkpoint.py DIR

configs/qwen3_30b_a3b.py's `tiny_architecture()` (its :tiny_random variant), initialised by
`transformers` (Qwen3MoeForCausalLM, f32, save_pretrained; generation_config.json's
eos_token_id <|im_end|> and <|endoftext|>, as Qwen3's), and a byte-level BPE tokenizer with
Qwen's chat tokens and template trained on examples/gsm_tiny/train.jsonl (512 ids,
`rljax.envs.tokenizer.train_byte_level_bpe`) in the same directory: what a real model's
directory holds, at CPU size. The :tiny variant takes any checkpoint's architecture from
its config.json:

  .venv/bin/python experiments/pipeline.py --config=configs/qwen3_30b_a3b.py:tiny \\
      --config.init_from=hf:DIR
"""

import json
import os
import sys

from configs import qwen3_30b_a3b
from rljax.envs.tokenizer import train_byte_level_bpe
from rljax.model import ModelConfig
from rljax.model.hf_import import hf_config_kwargs

SEED = 0


def main(directory: str) -> None:
  import torch  # pylint: disable=g-import-not-at-top  (test extras)
  import transformers  # pylint: disable=g-import-not-at-top
  if os.path.exists(os.path.join(directory, "config.json")):
    sys.exit(f"{directory} already holds a checkpoint")
  config = qwen3_30b_a3b.get_config("tiny_random")
  cfg = ModelConfig.from_dict(config.model.to_dict())
  with open(config.env.kwargs.path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  train_byte_level_bpe([f"{r['question']}\n{r['answer']}" for r in rows], directory,
                       vocab_size=cfg.vocab_size)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  torch.manual_seed(SEED)
  model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
      **hf_config_kwargs(cfg), eos_token_id=hf_tokenizer.eos_token_id,
      pad_token_id=hf_tokenizer.pad_token_id, bos_token_id=hf_tokenizer.bos_token_id))
  # what generate() stops at, as Qwen3's: the end of a turn and the end of the text
  model.generation_config.eos_token_id = [hf_tokenizer.convert_tokens_to_ids(t)
                                          for t in ("<|im_end|>", "<|endoftext|>")]
  model.float().save_pretrained(directory)
  print(directory)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  main(sys.argv[1])
