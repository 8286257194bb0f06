"""Multi-turn GRPO: the calculator-tool env (3-digit x 2-digit products) with the arith_tiny
policy. The policy cannot multiply in its head; it has to emit `<calc>a*b</calc>`, read the
env's `<obs>...</obs>` (appended to the same sequence, off the loss mask) and copy the
result. A short SFT warm start teaches the format imperfectly; GRPO improves the held-out
reward of whole episodes.
"""

import ml_collections

from configs import arith_tiny


def get_config() -> ml_collections.ConfigDict:
  c = arith_tiny.get_config()
  c.name = "calc_tiny"
  c.env.name = "calculator"
  c.env.kwargs = ml_collections.ConfigDict(dict(min_digits=2, max_digits=3, ops=("*",),
                                                max_turns=3, held_out_fraction=0.1))
  # prompt 9 + call 9 + observation <= 8 + answer <= 7 tokens
  c.engine = ml_collections.ConfigDict(dict(num_slots=64, max_seq_len=48,
                                          prefill_buckets=False))  # arith_tiny's
  c.sft.steps = 150
  c.sft.target_pass1 = 0.0  # a fixed short warm start
  c.rl.steps = 150
  c.rl.prompts_per_step = 8
  c.rl.group_size = 8
  c.rl.max_new_tokens = 10  # per turn
  c.eval.num_tasks = 128
  c.eval.every = 50
  return c
