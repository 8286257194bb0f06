"""Math word problems from rows of a JSONL file, with a Hugging Face tokenizer: the
arith_tiny run's blocks with a `tokenizer` block and a `dataset` env.

  .venv/bin/python examples/gsm_tiny/make_tokenizer.py /tmp/gsm_tok
  .venv/bin/python experiments/grpo.py --config=examples/gsm_tiny/config.py:/tmp/gsm_tok

train.jsonl holds 70 short problems written for this example, with GSM8K's fields: a
`question`, and an `answer` whose worked solution ends with "#### <number>" (the SFT
target). `rljax.envs.math_answer:reward_fn` compares the completion's final number (after
"####", or in \\boxed{}) with the answer's. Prompts are rendered by the tokenizer's chat
template; an answer ends with <|im_end|> or <|endoftext|>. A shape for trying the path,
not a tuned recipe: its lengths suit the example tokenizer (prompts <= 76 tokens,
answers <= 81); another tokenizer needs its own.
"""

import os

import ml_collections

from configs import arith_tiny

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(tokenizer_dir: str = "") -> ml_collections.ConfigDict:
  c = arith_tiny.get_config()
  c.name = "gsm_tiny"
  c.tokenizer = ml_collections.ConfigDict(dict(
      kind="hf", path=tokenizer_dir, chat_template=True,
      stop_tokens=("<|im_end|>", "<|endoftext|>")))
  c.model.update(dict(vocab_size=512, max_position_embeddings=176))
  c.env = ml_collections.ConfigDict()
  c.env.name = "dataset"
  c.env.kwargs = ml_collections.ConfigDict(dict(
      path=os.path.join(HERE, "train.jsonl"), prompt_field="question", answer_field="answer",
      id_field="id", reward_fn="rljax.envs.math_answer:reward_fn", held_out_fraction=0.2,
      max_prompt_tokens=80, verifier_processes=2, verifier_timeout_s=5.0))
  c.engine = ml_collections.ConfigDict(dict(num_slots=32, max_seq_len=176))
  # 70 rows: 59 train, 11 held out (split by id). A short trial of the path on CPU: a
  # fixed warm start on the worked solutions, then a few GRPO steps
  c.sft.steps = 100
  c.sft.target_pass1 = 0.0
  c.sft.num_tasks = 48
  c.sft.probe_tasks = 32
  c.sft.batch_size = 16
  c.rl.steps = 20
  c.rl.num_tasks = 48
  c.rl.prompts_per_step = 8
  c.rl.group_size = 8
  c.rl.max_new_tokens = 88  # + a prompt of <= max_prompt_tokens fits max_seq_len
  c.eval = ml_collections.ConfigDict(dict(num_tasks=8, k=4, n=4, temperature=1.0, seed=0,
                                          every=50))
  return c
