"""GRPO from a checkpoint trained elsewhere: TRL's GRPOTrainer and rljax's lockstep GRPO
side by side from the same start, held-out greedy pass@1 against steps.

  python experiments/study_vs_trl.py --out=/tmp/vs_trl --seeds=0,1,2 --steps=300 \
      --settings=trl,default --parallel=2

The start is made outside rljax, the way a user's checkpoint is: a Qwen3-MoE (1.0M
params: hidden 128, 4 MoE layers, 8 experts of width 64 top-2, 8 heads x 16 with 4 KV
heads, vocab 64) trained in plain PyTorch + transformers on every pair a+b of numbers below
100 (`--sft_digits`) that is not a held-out task of the RL env, every number written
least-significant digit first (prompt "<bos>21+43=", completion "64<eos>": a char-level
tokenizer, completion-only cross-entropy, AdamW lr 1e-3, betas 0.9/0.98, batch 256, 100
warmup steps then cosine to 0.1x, `--sft_steps` 1000), saved with `save_pretrained`
beside its tokenizer: `<out>/start`, made once and reused. It is sharp (SFT loss 6e-5):
sampled at T=1 nearly every group of 8 ties, so most GRPO batches carry no advantage.

The RL task is the same format on numbers of 1 to 3 digits (`--min_digits`,
`--max_digits`; rljax's arithmetic env with `little_endian=True`), 16 prompts x 8 samples
per step, at most 5 new tokens at T=1, reward 1 for the exact answer. The start never saw a
3-digit number: it solves what it was taught and some more (held-out 0.37 here), and RL
has to teach it the rest. Held-out: greedy pass@1 on the env's first `--heldout` held-out
tasks (eval seed 0), at step 0 and every `--eval_every` steps, the same tasks and the same
verifier on both sides.

Sides (`--settings`):
* `trl`: TRL's `GRPOTrainer` in float32 on the start (lr 1e-4 constant, clip 0.2, no KL,
  TRL's other defaults: its router aux loss included: TRL's recipe as users run it), torch
  on one thread; `trl_*`: TRL with other arguments (TRL_SETTINGS).
* every other name: rljax (`configs/arith_tiny.py`'s blocks, `init_from=hf:<out>/start`
  with its tokenizer, the lockstep loop `experiments/grpo.py` runs), with that entry's
  overrides of SETTINGS; `default` is the config as it is.

Runs already finished under `--out` are not rerun; `--parallel=2` runs two at a time, each
pinned to its own core. Output: `<out>/table.md` (steps to each level per seed, on the
seed-mean curve against `--reference`, the largest fall below the start), `<out>/curves.png`
and one JSON object as the last line.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

from experiments.curves import first_reach, mean_curve

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined only when this file runs as a program (tests import
  it beside other studies that define flags of the same names)."""
  flags.DEFINE_string("out", None, "study directory (runs resume from here)", required=True)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "RL seeds")
  flags.DEFINE_list("settings", ["trl", "default"],
                    "sides: trl, or rljax settings (see SETTINGS)")
  flags.DEFINE_integer("steps", 300, "GRPO steps per run")
  flags.DEFINE_integer("eval_every", 10, "held-out evaluation every N steps")
  flags.DEFINE_integer("heldout", 500, "held-out tasks")
  flags.DEFINE_string("reference", "trl", "the setting every other is compared to")
  flags.DEFINE_integer("parallel", 1, "runs at once (each pinned to one core)")
  flags.DEFINE_integer("sft_digits", 2, "the start's SFT data: every pair of numbers of at "
                       "most this many digits (3: 20,000 random pairs)")
  flags.DEFINE_integer("sft_steps", 1000, "the start's SFT steps")
  flags.DEFINE_integer("min_digits", 1, "RL task: digits per operand, at least")
  flags.DEFINE_integer("max_digits", 3, "RL task: digits per operand, at most")
  flags.DEFINE_integer("rl_tasks", NUM_TASKS, "RL task: distinct train tasks drawn")
  flags.DEFINE_string("job", None, "internal: run one job (JSON) in this process")


VOCAB, PROMPTS, SAMPLES, NEW_TOKENS, NUM_TASKS = 64, 16, 8, 5, 20000
HELD_OUT_FRACTION = 0.1
LEVELS = (0.6, 0.7, 0.8, 0.9)

# TRL settings: GRPOConfig arguments over TRL_BASE (TRL's recipe as users run it)
TRL_BASE = dict(learning_rate=1e-4, lr_scheduler_type="constant", epsilon=0.2, beta=0.0)
TRL_SETTINGS = {
    "trl": {},
    # rljax's default step size and schedule (lr 2e-4, 20 warmup steps, cosine to 5%)
    "trl_v1": dict(learning_rate=2e-4, warmup_steps=20, lr_scheduler_type="cosine_with_min_lr",
                   lr_scheduler_kwargs={"min_lr_rate": 0.05}),
}

# rljax settings: overrides of configs/arith_tiny.py's blocks (on top of the workload below)
SETTINGS = {
    "default": {},
    # the default recipe before signal-scaled updates (and step clipping)
    "v1": {"rl.signal_scaled_updates": False, "rl.step_clip_norm": 0.0},
    "lr1e-4_const": {"rl.learning_rate": 1e-4, "rl.warmup_steps": 0, "rl.final_lr_frac": 1.0},
    "f32": {"model.dtype": "float32", "model.param_dtype": "float32"},
    "clip0.2": {"rl.loss.clip_high": 0.2},
    "no_tis": {"rl.loss.tis": False},
    "no_replay": {"rl.router_replay": False},
    "seq_mean": {"rl.loss.aggregation": "seq_mean_token_mean"},
    "b2_0.98": {"rl.adam_b2": 0.98},
    "clip_norm_0.1": {"rl.clip_norm": 0.1},
    "no_warmup_decay": {"rl.warmup_steps": 0, "rl.final_lr_frac": 1.0},
    "dyn3": {"rl.dynamic_sampling_rounds": 3},
    # the two halves of signal-scaled updates apart: "skip_only" leaves a batch without an
    # advantage out of Adam (no step, moments untouched; the lr schedule goes on) but
    # does not scale the others by their signal fraction (an optimizer patched in this
    # process); "signal" is both, what the default now does
    "skip_only": {"rl.signal_scaled_updates": False, "patch.skip_only": True},
    "signal": {"rl.signal_scaled_updates": True},
    "lr5e-5_const": {"rl.learning_rate": 5e-5, "rl.warmup_steps": 0, "rl.final_lr_frac": 1.0},
    # exploration: rollouts (and the learner's log-probs) at a temperature above 1
    "t1.5": {"rl.temperature": 1.5},
    "t2": {"rl.temperature": 2.0},
    # a KL penalty to the start policy (k3, token mean)
    "kl0.1": {"rl.kl_to_start": True, "rl.loss.kl_coef": 0.1},
    # the step (after Adam) times min(1, c / raw gradient norm): own starts' gradient norms
    # stay below ~3 (study_recipe), this start's are 5-25
    "stepclip3": {"rl.step_clip_norm": 3.0},
    "stepclip1": {"rl.step_clip_norm": 1.0},
    # the default recipe before step_clip_norm (1.0) was on
    "no_stepclip": {"rl.step_clip_norm": 0.0},
}


@dataclasses.dataclass
class Job:
  setting: str
  seed: int
  steps: int
  eval_every: int
  heldout: int
  out: str
  min_digits: int = 1
  max_digits: int = 3
  num_tasks: int = NUM_TASKS

  @property
  def start_dir(self) -> str:
    return os.path.join(self.out, "start")

  @property
  def workdir(self) -> str:
    return os.path.join(self.out, "runs", f"{self.setting}_seed{self.seed}")

  @property
  def result_path(self) -> str:
    return os.path.join(self.workdir, "result.json")

  def done(self) -> bool:
    return os.path.exists(self.result_path)


# ------------------------------------------------------------------ the external start


def make_start(directory: str, seed: int = 0, steps: int = 1000, digits: int = 2) -> dict:
  """The SFT start, trained with torch + transformers only; saved to `directory`."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import torch
  import transformers
  from rljax.envs.tokenizer import CharTokenizer
  torch.manual_seed(seed)
  char = CharTokenizer()
  tokenizer = char.to_hf(VOCAB)
  config = transformers.Qwen3MoeConfig(
      vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
      num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
      moe_intermediate_size=64, intermediate_size=256, max_position_embeddings=64,
      rope_theta=10_000.0, tie_word_embeddings=False, bos_token_id=char.bos_id,
      eos_token_id=char.eos_id, pad_token_id=char.pad_id)
  model = transformers.Qwen3MoeForCausalLM(config).float()
  rev = lambda n: str(n)[::-1]  # noqa: E731
  from rljax.envs.arithmetic import canonical_key, draw_operand  # pylint: disable=g-import-not-at-top
  from rljax.envs.base import split_of  # pylint: disable=g-import-not-at-top
  if digits <= 2:
    pairs = [(a, b) for a in range(10**digits) for b in range(10**digits)]
  else:  # numbers of 1 to `digits` digits, as the env draws them
    draw = np.random.default_rng(seed + 1000)
    pairs = sorted({(draw_operand(draw, 1, digits), draw_operand(draw, 1, digits))
                    for _ in range(20000)})
  # never a held-out task of the RL env (the same split of the same canonical key)
  pairs = [p for p in pairs if split_of(canonical_key(p, ("+",)), HELD_OUT_FRACTION) == "train"]
  prompts = [[char.bos_id, *char.encode(f"{rev(a)}+{rev(b)}=")] for a, b in pairs]
  answers = [[*char.encode(rev(a + b)), char.eos_id] for a, b in pairs]
  width = max(len(p) + len(c) for p, c in zip(prompts, answers))
  ids = np.full((len(pairs), width), char.pad_id, np.int64)
  labels = np.full((len(pairs), width), -100, np.int64)
  for i, (p, c) in enumerate(zip(prompts, answers)):
    ids[i, :len(p) + len(c)] = p + c
    labels[i, len(p):len(p) + len(c)] = c  # completion-only loss
  ids, labels = torch.from_numpy(ids), torch.from_numpy(labels)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
  warmup = 100

  def lr_factor(step):
    if step < warmup:
      return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress))

  schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
  rng = np.random.default_rng(seed)
  order, cursor, losses = rng.permutation(len(pairs)), 0, []
  model.train()
  for _ in range(steps):
    if cursor + 256 > len(order):
      order, cursor = rng.permutation(len(pairs)), 0
    idx = torch.from_numpy(order[cursor:cursor + 256])
    cursor += 256
    loss = model(input_ids=ids[idx], attention_mask=(ids[idx] != char.pad_id).long(),
                 labels=labels[idx]).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    losses.append(float(loss.detach()))
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return {"sft_steps": steps, "sft_digits": digits, "sft_pairs": len(pairs), "sft_loss_first": losses[0], "sft_loss_last": losses[-1]}


# ------------------------------------------------------------------------- the env


def make_env(job: Job):
  """The RL task with the start's own tokenizer (what both sides sample and score with)."""
  # pylint: disable=g-import-not-at-top
  from rljax.envs.arithmetic import ArithmeticEnv
  from rljax.envs.tokenizer import TransformersTokenizer
  return ArithmeticEnv(min_digits=job.min_digits, max_digits=job.max_digits, ops=("+",),
                       little_endian=True,
                       held_out_fraction=HELD_OUT_FRACTION,
                       tokenizer=TransformersTokenizer.from_dir(job.start_dir))


# -------------------------------------------------------------------------- TRL


def run_trl(job: Job) -> dict:
  # pylint: disable=g-import-not-at-top
  import datasets
  import numpy as np
  import torch
  import transformers
  import trl
  torch.set_num_threads(1)
  env = make_env(job)
  tokenizer = transformers.AutoTokenizer.from_pretrained(job.start_dir, local_files_only=True)
  model = transformers.AutoModelForCausalLM.from_pretrained(job.start_dir, dtype=torch.float32)
  tasks = env.prompts("train", job.num_tasks, job.seed)
  heldout = env.prompts("held_out", job.heldout, 0)
  for t in tasks[:256] + heldout:
    if tokenizer(t.task_id)["input_ids"] != t.prompt_ids.tolist():
      raise AssertionError(f"TRL's prompt ids differ from the env's for {t.task_id!r}")

  def reward(completion_ids, task_index, **_):
    return [env.verify(tasks[i], np.asarray(ids, np.int32)).reward
            for ids, i in zip(completion_ids, task_index)]

  by_length = {}  # prompts of one length batch without padding
  for t in heldout:
    by_length.setdefault(len(t.prompt_ids), []).append(t)

  def greedy_pass1():
    model.eval()
    solved = 0
    for length, group in by_length.items():
      ids = torch.tensor(np.stack([t.prompt_ids for t in group]), dtype=torch.long)
      with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=env.tokenizer.eos_id,
                             pad_token_id=env.tokenizer.pad_id)
      done = out[:, length:].numpy().astype(np.int32)
      solved += sum(env.verify(t, c).reward >= 1.0 for t, c in zip(group, done))
    model.train()
    return solved / len(heldout)

  curve = [(0, greedy_pass1())]

  class Evaluate(transformers.TrainerCallback):

    def on_step_end(self, args, state, control, **kwargs):
      if state.global_step % job.eval_every == 0:
        curve.append((state.global_step, greedy_pass1()))
        print(f"step {state.global_step}: held-out pass@1 {curve[-1][1]:.3f}", file=sys.stderr,
              flush=True)

  args = trl.GRPOConfig(
      output_dir=os.path.join(job.workdir, "trl"), max_steps=job.steps,
      per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
      gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS, temperature=1.0,
      **(TRL_BASE | TRL_SETTINGS[job.setting]), use_vllm=False, use_cpu=True, bf16=False, report_to="none", logging_steps=1,
      save_strategy="no", disable_tqdm=True, seed=job.seed)
  dataset = datasets.Dataset.from_dict({"prompt": [t.task_id for t in tasks],
                                        "task_index": list(range(len(tasks)))})
  trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=[Evaluate()])
  trainer.train()
  logs = [r for r in trainer.state.log_history if "reward" in r]
  return {"curve": curve, "train_reward": [r["reward"] for r in logs],
          "entropy": [r.get("entropy") for r in logs],
          "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                       "trl": trl.__version__}}


# ------------------------------------------------------------------------ rljax


def rljax_config(job: Job):
  from configs import arith_tiny  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  config = arith_tiny.get_config()
  config.seed = job.seed
  config.init_from = f"hf:{job.start_dir}"
  config.tokenizer = ml_collections.ConfigDict(dict(kind="hf", path="", stop_tokens=(),
                                                    chat_template=False))
  from rljax.pipeline.run import BACKEND_FIELDS  # pylint: disable=g-import-not-at-top
  # the architecture is the checkpoint's (config.json); the model block keeps how to run it
  config.model = ml_collections.ConfigDict({k: v for k, v in config.model.items()
                                            if k in BACKEND_FIELDS})
  config.env.kwargs.update(dict(little_endian=True, min_digits=job.min_digits,
                                max_digits=job.max_digits))
  config.rl.update(dict(prompts_per_step=PROMPTS, group_size=SAMPLES, max_new_tokens=NEW_TOKENS,
                        num_tasks=job.num_tasks, steps=job.steps))
  config.engine.num_slots = PROMPTS * SAMPLES
  config.sft.steps = 0
  config.eval.update(dict(num_tasks=job.heldout, every=job.eval_every, seed=0))
  for key, value in SETTINGS[job.setting].items():
    if key.startswith("patch."):
      continue
    *path, leaf = key.split(".")
    block = config
    for p in path:
      block = block[p]
    block[leaf] = value
  return config


def run_rljax(job: Job) -> dict:
  # pylint: disable=g-import-not-at-top
  from rljax import numerics
  config = rljax_config(job)
  numerics.set_up_process(config.numerics)
  if SETTINGS[job.setting].get("patch.skip_only"):
    from rljax.rl import learner  # pylint: disable=g-import-not-at-top
    make = learner.make_optimizer
    learner.make_optimizer = lambda *a, **k: make(*a, **(k | {"skip_empty": True}))
  from rljax.pipeline.lockstep import run_experiment
  from rljax.pipeline.metrics import read_jsonl
  summary = run_experiment(config, job.workdir)
  records = read_jsonl(os.path.join(job.workdir, "metrics.jsonl"))
  evals = {}
  for r in records:
    if r["phase"] == "eval":
      evals[r["step"]] = r["pass1"]
  grpo = [r for r in records if r["phase"] == "grpo"]
  return {"curve": sorted(evals.items()), "train_reward": [r["success_frac"] for r in grpo],
          "sampled_nll": [r["sampled_nll_mean"] for r in grpo],
          "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}}


def run_job(job: Job) -> None:
  t0 = time.perf_counter()
  out = run_trl(job) if job.setting in TRL_SETTINGS else run_rljax(job)
  out |= {"setting": job.setting, "seed": job.seed, "wall_s": round(time.perf_counter() - t0, 1)}
  with open(job.result_path, "w", encoding="utf-8") as f:
    json.dump(out, f)


# ---------------------------------------------------------------------- the study


def run_jobs(jobs: list[Job], parallel: int) -> None:
  pending = [j for j in jobs if not j.done()]
  running: dict[int, tuple[subprocess.Popen, Job]] = {}
  while pending or running:
    for core, (proc, job) in list(running.items()):
      if proc.poll() is None:
        continue
      del running[core]
      if proc.returncode or not job.done():
        raise RuntimeError(f"{job.workdir}: exit {proc.returncode}; see its run.log")
      print(f"finished {os.path.basename(job.workdir)}", file=sys.stderr, flush=True)
    for core in [c for c in range(parallel) if c not in running]:
      if not pending:
        break
      job = pending.pop(0)
      os.makedirs(job.workdir, exist_ok=True)
      pin = (lambda c=core: os.sched_setaffinity(0, {c})) if parallel > 1 else None
      command = [sys.executable, __file__, f"--out={job.out}",
                 "--job=" + json.dumps(dataclasses.asdict(job))]
      with open(os.path.join(job.workdir, "run.log"), "w", encoding="utf-8") as log:
        running[core] = (subprocess.Popen(command, stdout=log, stderr=log, preexec_fn=pin,
                                          cwd=os.path.dirname(os.path.dirname(__file__)) or "."),
                         job)
      print(f"started {os.path.basename(job.workdir)}", file=sys.stderr, flush=True)
    time.sleep(2.0)


def summarize_run(r: dict) -> dict:
  start = r["curve"][0][1]
  best, fall_best = 0.0, 0.0
  for _, p in r["curve"]:
    best = max(best, p)
    fall_best = max(fall_best, best - p)
  return {"start": start, "final": r["curve"][-1][1], "best": best,
          "max_fall_below_start": round(max(0.0, start - min(p for _, p in r["curve"])), 4),
          "max_fall_from_best": round(fall_best, 4),
          "reach": {str(lv): first_reach(r["curve"], lv) for lv in LEVELS}}


def verdicts(runs: list[dict], settings: list[str], reference: str) -> dict:
  """Per setting: the seed-mean curve's first step at each level, no later than the
  reference's (a level the reference never reaches is met), and no seed more than 0.05
  below its start."""
  curves = {s: mean_curve([r for r in runs if r["setting"] == s]) for s in settings}
  ref = {lv: first_reach(curves[reference], lv) for lv in LEVELS}
  out = {}
  for s in settings:
    reach = {lv: first_reach(curves[s], lv) for lv in LEVELS}
    falls = [summarize_run(r)["max_fall_below_start"] for r in runs if r["setting"] == s]
    out[s] = {"mean_curve_reach": {str(lv): reach[lv] for lv in LEVELS},
              "no_later_than_reference": {
                  str(lv): ref[lv] is None or (reach[lv] is not None and reach[lv] <= ref[lv])
                  for lv in LEVELS},
              "max_fall_below_start": max(falls), "never_below_start_by_0.05": max(falls) <= 0.05,
              "mean_final_pass1": round(curves[s][-1][1], 4)}
  return out


def table(runs: list[dict], settings: list[str], reference: str, v: dict) -> str:
  lines = ["| setting | " + " | ".join(f"steps to {lv} (per seed)" for lv in LEVELS)
           + " | fall below start | final | mean curve: " + ", ".join(map(str, LEVELS))
           + f" | no later than {reference} |", "|---" * (len(LEVELS) + 5) + "|"]
  for s in settings:
    mine = [summarize_run(r) for r in runs if r["setting"] == s]
    cells = [", ".join(str(m["reach"][str(lv)] or "-") for m in mine) for lv in LEVELS]
    lines.append(f"| {s} | " + " | ".join(cells)
                 + " | " + ", ".join(f"{m['max_fall_below_start']:.2f}" for m in mine)
                 + " | " + ", ".join(f"{m['final']:.2f}" for m in mine)
                 + " | " + ", ".join(str(v[s]["mean_curve_reach"][str(lv)] or "-") for lv in LEVELS)
                 + " | " + ("yes" if all(v[s]["no_later_than_reference"].values()) else "no")
                 + " |")
  return "\n".join(lines) + "\n"


def plot(runs: list[dict], settings: list[str], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 5))
  for i, s in enumerate(settings):
    color = f"C{i}"
    mine = [r for r in runs if r["setting"] == s]
    for r in mine:
      ax.plot(*zip(*r["curve"]), color=color, alpha=0.25, lw=0.8)
    ax.plot(*zip(*mean_curve(mine)), color=color, lw=2, label=f"{s} (mean of {len(mine)})")
  ax.set_xlabel("GRPO step")
  ax.set_ylabel("held-out greedy pass@1")
  ax.set_title("GRPO from a transformers-trained SFT start")
  ax.legend()
  fig.savefig(path, dpi=100)


def main(_):
  if FLAGS.job:
    run_job(Job(**json.loads(FLAGS.job)))
    return
  settings = FLAGS.settings
  unknown = set(settings) - set(SETTINGS) - set(TRL_SETTINGS)
  if unknown:
    raise app.UsageError(f"unknown settings {sorted(unknown)}; known: "
                         f"{sorted(TRL_SETTINGS)}, {sorted(SETTINGS)}")
  if FLAGS.reference not in settings:
    raise app.UsageError(f"--reference={FLAGS.reference} is not among --settings")
  out = os.path.abspath(FLAGS.out)
  t0 = time.perf_counter()
  start_dir = os.path.join(out, "start")
  if not os.path.exists(os.path.join(start_dir, "config.json")):
    os.makedirs(out, exist_ok=True)
    info = make_start(start_dir, steps=_SFTFLAGS.steps, digits=FLAGS.sft_digits)
    with open(os.path.join(out, "start.json"), "w", encoding="utf-8") as f:
      json.dump(info, f)
  jobs = [Job(s, int(seed), FLAGS.steps, FLAGS.eval_every, FLAGS.heldout, out,
              FLAGS.min_digits, FLAGS.max_digits, FLAGS.rl_tasks)
          for seed in FLAGS.seeds for s in settings]
  run_jobs(jobs, FLAGS.parallel)
  runs = [json.load(open(j.result_path, encoding="utf-8")) for j in jobs]
  v = verdicts(runs, settings, FLAGS.reference)
  md = table(runs, settings, FLAGS.reference, v)
  with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as f:
    f.write(md)
  plot(runs, settings, os.path.join(out, "curves.png"))
  print(md, file=sys.stderr)
  from experiments import machine_info  # pylint: disable=g-import-not-at-top
  print(json.dumps({
      "study": "vs_trl", "steps": FLAGS.steps, "eval_every": FLAGS.eval_every,
      "heldout": FLAGS.heldout, "seeds": FLAGS.seeds,
      "task_digits": [FLAGS.min_digits, FLAGS.max_digits],
      "start": json.load(open(os.path.join(out, "start.json"), encoding="utf-8")),
      "settings": {s: SETTINGS[s] if s in SETTINGS else {"trl": TRL_BASE | TRL_SETTINGS[s]}
                   for s in settings},
      "reference": FLAGS.reference, "verdicts": v,
      "runs": [{"setting": r["setting"], "seed": r["seed"], "wall_s": r["wall_s"],
                **summarize_run(r), "curve": r["curve"]} for r in runs],
      "wall_s": round(time.perf_counter() - t0, 1), "machine": machine_info.machine()}))


if __name__ == "__main__":
  define_flags()
  app.run(main)
