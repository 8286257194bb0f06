"""One GRPO step of rljax vs one step of Hugging Face TRL's `GRPOTrainer`, same workload.

Workload: configs/arith_tiny.py's env (3-digit addition, char tokenizer, answers of at
most 4 digits + EOS, so 5 new tokens at most) and its architecture with every layer MoE and
expert width 64, to land near 1.0M parameters: a Qwen3-MoE of hidden 128, 4 layers, 8
heads of 16 (4 KV heads), 8 experts of width 64 top-2, vocab 64 (1,004,800 params). One
step = 16 prompts x 8 samples, at most 5 new tokens at temperature 1, one update on all
128. Both sides start from the same weights: transformers' own random init, saved with
`save_pretrained` and read into rljax by its importer (`rljax.model.hf_import`).

rljax: the lockstep loop's step (`rljax.pipeline.lockstep.step`, one sampling round) on
the objects `build(config)` makes, in the config's numerics and dtypes (recorded in the
JSON): `rljax_rollout_s` = its rollout (`generate_groups` on the engine: sampling +
verify), the record's rollout_s; `rljax_update_s` = the rest of the step:
`grpo_update.train_on_groups` (advantages, packing, the jitted GRPO step), the new serving
weights into the engine, the step's record. The engine has one
slot per sample (128), as HF `generate` batches all 128. The first step (compiles) is
reported apart as `rljax_first_step_s`.
TRL: `GRPOTrainer` on CPU in float32, torch on 1 thread, no vLLM, the same prompts (a
`PreTrainedTokenizerFast` whose ids are the char tokenizer's; the script checks that every
prompt tokenizes to the env's ids), the env's verifier as reward function, loss as close
to rljax's as TRL has it (token-mean "dapo", clip 0.2/0.28, no KL, no aux loss, lr and
grad-norm clip of the config). `trl_step_s` is on_step_begin -> on_step_end (generation,
reward, loss, backward, optimizer); `trl_generate_s` is its `_generate_and_score_completions`
and `trl_update_s` the rest. TRL's first step is reported apart as `trl_first_step_s`.

Timing: TRL's own training loop runs; after every `--steps_per_round` TRL steps a callback
runs as many rljax steps (A B A B ...). `rljax_over_trl_step` is the median over rounds
of (mean rljax step) / (mean TRL step), and likewise rollout / generate and update /
update; the times are medians over steps. JAX uses
the process's cores (XLA:CPU's thread pool), torch one thread. Last line: one JSON object.
"""

import json
import os
import statistics
import tempfile
import time

from absl import app, flags
import jax
import numpy as np

from configs import arith_tiny
from experiments import machine_info
from rljax import numerics
from rljax.model import count_params
from rljax.model.hf_import import hf_config_kwargs, load_hf_params
from rljax.pipeline import core, lockstep
from rljax.pipeline.run import LOCKSTEP, build

_ROUNDS = flags.DEFINE_integer("rounds", 10, "interleaved rounds (TRL steps, then rljax steps)")
_STEPS = flags.DEFINE_integer("steps_per_round", 2, "steps of each side per round")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (a fresh temp dir if unset)")

PROMPTS, SAMPLES, NEW_TOKENS, MOE_WIDTH = 16, 8, 5, 64
NUM_TASKS = 512  # the train tasks both sides draw their prompts from


def rljax_config(total_steps):
  config = arith_tiny.get_config()
  config.model.update(dict(mlp_only_layers=(), moe_intermediate_size=MOE_WIDTH))
  config.rl.update(dict(prompts_per_step=PROMPTS, group_size=SAMPLES, max_new_tokens=NEW_TOKENS,
                        num_tasks=NUM_TASKS, steps=total_steps, dynamic_sampling_rounds=1,
                        kl_to_start=False))  # TRL's side has no reference model (beta 0)
  config.engine.num_slots = PROMPTS * SAMPLES
  config.sft.steps = 0
  config.log.tensorboard = False
  return config


def hf_model(cfg, char):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  hf_cfg = transformers.Qwen3MoeConfig(**hf_config_kwargs(cfg), bos_token_id=char.bos_id,
                                       eos_token_id=char.eos_id, pad_token_id=char.pad_id)
  torch.manual_seed(0)
  return transformers.Qwen3MoeForCausalLM(hf_cfg).float()  # transformers' own init


def rljax_step(run, loop):
  """The lockstep loop's step (one sampling round): (rollout_s, update_s, completion
  tokens per sample)."""
  t0 = time.perf_counter()
  record = lockstep.step(run, loop)
  jax.block_until_ready(run.engine.params)
  step_s = time.perf_counter() - t0
  return record["rollout_s"], step_s - record["rollout_s"], record["completion_tokens_mean"]


def main(_):
  import datasets  # pylint: disable=g-import-not-at-top  (test extras: TRL's dependencies)
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top
  k, rounds = _STEPS.value, _ROUNDS.value
  config = rljax_config(1 + rounds * k)
  numerics.set_up_process(config.numerics)  # before JAX starts
  torch.set_num_threads(1)
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="bench_step_")

  # ---- rljax: the run's objects, then the HF model's weights
  run = core.setup(build(config, LOCKSTEP), os.path.join(workdir, "rljax"))
  char = run.env.tokenizer
  model = hf_model(run.cfg, char)
  hf_dir = os.path.join(workdir, "hf_init")
  model.save_pretrained(hf_dir)
  run.state = core.params_only(load_hf_params(hf_dir, run.cfg, "float32"))
  run.engine.update_weights(run.serve(run.state), 0)
  loop = lockstep.start(run)  # the learner; the task stream: `tasks` shuffled
  tasks = run.env.prompts("train", NUM_TASKS, run.config.seed)
  n_params = count_params(run.state.params)
  if n_params != sum(p.numel() for p in model.parameters()):
    raise AssertionError("rljax and HF models differ in size")

  # ---- TRL: the same prompts (checked id for id), the env's verifier as reward
  tokenizer = char.to_hf(run.cfg.vocab_size)
  for t in tasks:
    if tokenizer(t.task_id)["input_ids"] != t.prompt_ids.tolist():
      raise AssertionError(f"HF tokenizer ids differ from the env's for {t.task_id!r}")

  def reward(completion_ids, task_index, **_):
    return [run.env.verify(tasks[i], np.asarray(ids, np.int32)).reward
            for ids, i in zip(completion_ids, task_index)]

  rl = run.config.rl
  args = trl.GRPOConfig(
      output_dir=os.path.join(workdir, "trl"), max_steps=1 + rounds * k,
      per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
      gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS,
      temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p, learning_rate=rl.learning_rate,
      max_grad_norm=rl.clip_norm, loss_type="dapo", epsilon=rl.loss.clip_low,
      epsilon_high=rl.loss.clip_high, beta=0.0, router_aux_loss_coef=0.0, use_vllm=False,
      use_cpu=True, bf16=False, report_to="none", logging_strategy="no", save_strategy="no",
      disable_tqdm=True, seed=run.config.seed)
  dataset = datasets.Dataset.from_dict({"prompt": [t.task_id for t in tasks],
                                        "task_index": list(range(len(tasks)))})
  times = {"rljax_rollout": [], "rljax_update": [], "trl_step": [], "trl_generate": []}
  ratios, tokens = {"step": [], "rollout": [], "update": []}, {"rljax": [], "trl": []}

  def rljax_steps(n):
    return [rljax_step(run, loop) for _ in range(n)]

  class Interleave(transformers.TrainerCallback):
    """Times TRL's steps; after every k of them (the first, warm-up step aside) runs k
    rljax steps, and closes the round."""

    def on_step_begin(self, args, state_, control, **kwargs):
      self.t0 = time.perf_counter()

    def on_step_end(self, args, state_, control, **kwargs):
      times["trl_step"].append(time.perf_counter() - self.t0)
      if state_.global_step == 1 or (state_.global_step - 1) % k:
        return
      ours = rljax_steps(k)
      times["rljax_rollout"] += [r for r, _, _ in ours]
      times["rljax_update"] += [u for _, u, _ in ours]
      tokens["rljax"] += [n for _, _, n in ours]
      step, gen = times["trl_step"][-k:], times["trl_generate"][-k:]
      ratios["step"].append(statistics.mean(r + u for r, u, _ in ours) / statistics.mean(step))
      ratios["rollout"].append(statistics.mean(r for r, _, _ in ours) / statistics.mean(gen))
      ratios["update"].append(statistics.mean(u for _, u, _ in ours)
                              / statistics.mean(s - g for s, g in zip(step, gen)))

  trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=[Interleave()])
  generate = trainer._generate_and_score_completions  # pylint: disable=protected-access

  def timed_generate(inputs):
    t0 = time.perf_counter()
    out = generate(inputs)
    times["trl_generate"].append(time.perf_counter() - t0)
    tokens["trl"].append(float(out["completion_mask"].sum()) / (PROMPTS * SAMPLES))
    return out

  trainer._generate_and_score_completions = timed_generate  # pylint: disable=protected-access

  first = rljax_steps(1)[0]  # compiles
  trainer.train()
  trl_first = times["trl_step"].pop(0)
  times["trl_generate"].pop(0)
  tokens["trl"].pop(0)
  if len(ratios["step"]) != rounds or len(times["trl_step"]) != rounds * k:
    raise AssertionError(f"expected {rounds} rounds of {k} steps, got {len(ratios['step'])} rounds")

  med = {name: statistics.median(v) for name, v in times.items()}
  trl_update = [s - g for s, g in zip(times["trl_step"], times["trl_generate"])]
  rljax_step_s = [r + u for r, u in zip(times["rljax_rollout"], times["rljax_update"])]
  cfg = run.cfg
  print(json.dumps({
      "bench": "step",
      "workload": (f"GRPO step: {PROMPTS} prompts x {SAMPLES} samples of 3-digit addition, "
                   f"<= {NEW_TOKENS} new tokens at T={rl.temperature}, one update on all "
                   f"{PROMPTS * SAMPLES}; Qwen3-MoE hidden {cfg.hidden_size}, "
                   f"{cfg.num_hidden_layers} MoE layers, {cfg.num_attention_heads} heads x "
                   f"{cfg.head_dim} ({cfg.num_key_value_heads} KV), {cfg.num_experts} experts "
                   f"x {cfg.moe_intermediate_size} top-{cfg.num_experts_per_tok}, vocab "
                   f"{cfg.vocab_size}; same initial weights; 1 CPU process"),
      "params": n_params,
      "rljax": {"numerics": run.numerics.mode, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype,
                "master_dtype": "float32", "engine_experts": cfg.engine_experts,
                "decode_attention": cfg.decode_attention, "engine_slots": run.engine.num_slots,
                "router_replay": rl.router_replay, "tis": rl.loss.tis,
                "jax_backend": jax.default_backend()},
      "trl": {"dtype": "float32", "torch_threads": torch.get_num_threads(),
              "attn_implementation": getattr(model.config, "_attn_implementation"),
              "experts_implementation": getattr(model.config, "_experts_implementation"),
              "loss_type": args.loss_type},
      "rljax_first_step_s": round(first[0] + first[1], 3),
      "rljax_first_step_parts_s": {"rollout": round(first[0], 3), "update": round(first[1], 3)},
      "trl_first_step_s": round(trl_first, 3),
      "rljax_rollout_s": round(med["rljax_rollout"], 4),
      "rljax_update_s": round(med["rljax_update"], 4),
      "rljax_step_s": round(statistics.median(rljax_step_s), 4),
      "trl_step_s": round(med["trl_step"], 4),
      "trl_generate_s": round(med["trl_generate"], 4),
      "trl_update_s": round(statistics.median(trl_update), 4),
      "rljax_over_trl_step": round(statistics.median(ratios["step"]), 3),
      "rljax_rollout_over_trl_generate": round(statistics.median(ratios["rollout"]), 3),
      "rljax_update_over_trl_update": round(statistics.median(ratios["update"]), 3),
      "round_ratios": [round(r, 3) for r in ratios["step"]],
      "completion_tokens_mean": {side: round(statistics.mean(v), 2) for side, v in tokens.items()},
      "rounds": rounds, "steps_per_round": k,
      "versions": {"jax": jax.__version__, "torch": torch.__version__,
                   "transformers": transformers.__version__, "trl": trl.__version__},
      "machine": machine_info.machine(),
  }))


if __name__ == "__main__":
  app.run(main)
