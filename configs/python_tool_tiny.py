"""Multi-turn GRPO with a sandboxed Python tool: 3-digit x 3-digit products with the
arith_tiny policy. The policy cannot multiply in its head; it has to write a program,
`<calc>print(123*456)</calc>`, which the env runs in `rljax.envs.sandbox` (a fresh
interpreter per call, kernel-enforced limits), read the program's output (appended as
`<obs>56088</obs>`, off the loss mask) and copy it. A short SFT warm start on
demonstrations, stopped once greedy pass@1 on train probe tasks reaches 0.6, teaches the
format imperfectly (sampled at temperature 1, most episodes still fail); 50 GRPO steps
then improve the held-out success of whole episodes. Every tool call starts a process:
the evaluation samples one episode per task (k = n = 1: `pass1_sampled`), not eight, to
keep the calls of a run down, and runs only at init, after SFT and at the end.
"""

import ml_collections

from configs import arith_tiny


def get_config() -> ml_collections.ConfigDict:
  c = arith_tiny.get_config()
  c.name = "python_tool_tiny"
  c.env.name = "python_tool"
  c.env.kwargs = ml_collections.ConfigDict(dict(
      min_digits=3, max_digits=3, ops=("*",), max_turns=3, held_out_fraction=0.1,
      max_obs_tokens=16, limits=dict(cpu_s=1.0, wall_s=3.0, memory_bytes=256 * 2**20,
                                    output_bytes=4096)))
  # prompt 9 + call 16 + observation <= 8 + answer <= 7 tokens (a retry after an error
  # observation of <= 18 tokens may not fit: the sequence ends the episode when it is full)
  c.engine = ml_collections.ConfigDict(dict(num_slots=64, max_seq_len=48,
                                          prefill_buckets=False))  # arith_tiny's
  # SFT until greedy pass@1 on 64 train probe tasks reaches 0.6 (at most 150 steps), so
  # GRPO starts from a comparable, imperfect policy whatever the seed
  c.sft.steps = 150
  c.sft.target_pass1 = 0.6
  c.sft.probe_every = 5
  c.sft.probe_every_slow = 5
  c.sft.probe_tasks = 64
  c.rl.steps = 50
  c.rl.prompts_per_step = 8
  c.rl.group_size = 8
  c.rl.max_new_tokens = 20  # per turn
  c.rl.learning_rate = 4e-4  # a short run: a higher rate, short warmup, mild decay
  c.rl.warmup_steps = 5
  c.rl.final_lr_frac = 0.2
  c.eval.num_tasks = 128
  c.eval.k = 1
  c.eval.n = 1
  c.eval.every = 0  # init, after SFT, at the end
  return c
