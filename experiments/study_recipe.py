"""The GRPO recipe study: held-out pass@1 against steps, per setting, SFT start and seed.

  python experiments/study_recipe.py --out=/tmp/study --starts=0.25,0.7 --seeds=0,1,2 \
      --settings=v1,trl,v2 --steps=500 --parallel=2

Every run is `experiments/grpo.py` (the lockstep loop) on configs/arith_tiny.py with one
setting's overrides. A start is an SFT warm start stopped at greedy pass@1 >= the start's
target on the train probe tasks (probed every 10 steps); it is made once per (start, seed)
by that pair's first run and loaded by the others, so every setting starts from the same
weights. Held-out evaluation every `--eval_every` steps. Runs already finished under
`--out` (their summary.json exists) are not rerun, so an interrupted study resumes.
`--parallel=2` runs two at a time, each pinned to its own core.

Per run: held-out greedy pass@1 at each evaluation, the first step reaching each level,
the largest fall from the run's best (a collapse shows here), and the sampled tokens' mean
-log pi at the start and end (the sampling entropy; it falls as the policy collapses).
Per setting and start: the first step at which the mean over seeds of held-out pass@1
reaches each level, against `--reference`'s (default trl, TRL's recipe). The last line is
one JSON object; `<out>/table.md` has the tables.
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

_OUT = flags.DEFINE_string("out", None, "study directory (runs resume from here)", required=True)
_STARTS = flags.DEFINE_list("starts", ["0.25", "0.7"], "SFT starts: target greedy pass@1")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds")
_SETTINGS = flags.DEFINE_list("settings", ["v1", "trl", "v2"], "settings (see SETTINGS)")
_STEPS = flags.DEFINE_integer("steps", 500, "GRPO steps per run")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "held-out evaluation every N steps")
_REFERENCE = flags.DEFINE_string("reference", "trl", "the setting every other is compared "
                                  "to, level by level, on the seed-mean curve")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "runs at once (each pinned to one core)")
_WORKLOAD = flags.DEFINE_enum("workload", "arith_tiny", ["arith_tiny", "bench_step"],
                              "arith_tiny: the config as it is; bench_step: bench_step's model "
                              "and batch (every layer MoE, experts of width 64, 16 x 8 samples, "
                              "5 new tokens)")

LEVELS = (0.5, 0.7, 0.8, 0.9)

# Each setting is a set of config overrides on configs/arith_tiny.py, spelled out in full so
# that a change of the config's defaults does not change what a setting means.
SETTINGS = {
    # arith_tiny's GRPO recipe before this study
    "v1": {"rl.learning_rate": 2e-4, "rl.warmup_steps": 20, "rl.final_lr_frac": 0.05,
           "rl.loss.clip_high": 0.28, "rl.loss.tis": True, "rl.router_replay": True,
           "rl.signal_scaled_updates": False, "rl.step_clip_norm": 0.0},
    # TRL GRPOTrainer's defaults as measured against it: lr 1e-4 constant, clip 0.2
    "trl": {"rl.learning_rate": 1e-4, "rl.warmup_steps": 0, "rl.final_lr_frac": 1.0,
            "rl.loss.clip_high": 0.2, "rl.loss.tis": False, "rl.router_replay": False,
           "rl.signal_scaled_updates": False, "rl.step_clip_norm": 0.0},
    # trl's step size and schedule with v1's clip-higher, TIS and router replay
    "v2": {"rl.learning_rate": 1e-4, "rl.warmup_steps": 0, "rl.final_lr_frac": 1.0,
           "rl.loss.clip_high": 0.28, "rl.loss.tis": True, "rl.router_replay": True,
           "rl.signal_scaled_updates": False, "rl.step_clip_norm": 0.0},
    # v1 without the cosine decay: the weak start was still improving when v1's lr had
    # decayed to 0.05x, and trl's constant 1e-4 caught up there
    "v3": {"rl.learning_rate": 2e-4, "rl.warmup_steps": 20, "rl.final_lr_frac": 1.0,
           "rl.loss.clip_high": 0.28, "rl.loss.tis": True, "rl.router_replay": True,
           "rl.signal_scaled_updates": False, "rl.step_clip_norm": 0.0},
    # v3 at 2.5x the step size: one update per batch keeps every ratio at 1, so on the
    # lockstep loop the step size and schedule are all that act, and v1/v3 at 2e-4 moved
    # faster than trl at 1e-4 wherever they moved at all
    "v4": {"rl.learning_rate": 5e-4, "rl.warmup_steps": 20, "rl.final_lr_frac": 1.0,
           "rl.loss.clip_high": 0.28, "rl.loss.tis": True, "rl.router_replay": True,
           "rl.signal_scaled_updates": False, "rl.step_clip_norm": 0.0},
    # v1 with each update scaled by the share of its samples that have an advantage (none
    # when no sample has one): the recipe that held from a transformers-trained start
    # (experiments/study_vs_trl.py), where v1 collapsed
    "v5": {"rl.learning_rate": 2e-4, "rl.warmup_steps": 20, "rl.final_lr_frac": 0.05,
           "rl.loss.clip_high": 0.28, "rl.loss.tis": True, "rl.router_replay": True,
           "rl.signal_scaled_updates": True, "rl.step_clip_norm": 0.0},
    # v5 with each update (Adam's step) also times min(1, 1 / the raw gradient norm): from a
    # transformers-trained start whose gradient norms are 5-25 (rljax's own starts': 1-3)
    # v5 and TRL fell 0.23-0.41 in held-out pass@1 where this rose (study_vs_trl.py)
    "v6": {"rl.learning_rate": 2e-4, "rl.warmup_steps": 20, "rl.final_lr_frac": 0.05,
           "rl.loss.clip_high": 0.28, "rl.loss.tis": True, "rl.router_replay": True,
           "rl.signal_scaled_updates": True, "rl.step_clip_norm": 1.0},
}


# bench_step.py's workload as overrides of arith_tiny (the collapse was measured
# on it): 1.0M parameters, 16 prompts x 8 samples of at most 5 new tokens
WORKLOADS = {
    "arith_tiny": {},
    "bench_step": {"model.mlp_only_layers": "()", "model.moe_intermediate_size": 64,
                   "rl.group_size": 8, "rl.max_new_tokens": 5},
}


@dataclasses.dataclass
class Job:
  setting: str
  start: str
  seed: str
  steps: int
  eval_every: int
  out: str
  workload: str = "arith_tiny"

  @property
  def workdir(self) -> str:
    prefix = "" if self.workload == "arith_tiny" else f"{self.workload}_"
    return os.path.join(self.out, f"{prefix}start{self.start}_seed{self.seed}_{self.setting}")

  def sft_dir(self, first_setting: str) -> str:
    return os.path.join(dataclasses.replace(self, setting=first_setting).workdir,
                        "sft_checkpoint")

  def done(self) -> bool:
    return os.path.exists(os.path.join(self.workdir, "summary.json"))

  def command(self, first_setting: str) -> list[str]:
    over = {"seed": self.seed, "rl.steps": self.steps, "eval.every": self.eval_every,
            "sft.target_pass1": self.start, "sft.probe_every": 10, "sft.slow_down_at": 1.0,
            "log.tensorboard": False} | WORKLOADS[self.workload] | SETTINGS[self.setting]
    if self.setting != first_setting:
      over["sft.load"] = self.sft_dir(first_setting)
    return ([sys.executable, "experiments/grpo.py", "--config=configs/arith_tiny.py",
             f"--workdir={self.workdir}", "--noprogress"]
            + [f"--config.{k}={v}" for k, v in over.items()])


def run_jobs(jobs: list[Job], first_setting: str, parallel: int) -> None:
  """Runs the jobs not yet done, `parallel` at a time; a run that loads an SFT start waits
  for the run that makes it."""
  pending = [j for j in jobs if not j.done()]
  running: dict[int, tuple[subprocess.Popen, Job]] = {}
  while pending or running:
    for core, (proc, job) in list(running.items()):
      if proc.poll() is None:
        continue
      del running[core]
      if proc.returncode:
        raise RuntimeError(f"{job.workdir}: exit {proc.returncode}; see its run.log")
      with open(os.path.join(job.workdir, "stdout.txt"), encoding="utf-8") as f:
        summary = f.read().strip().splitlines()[-1]
      with open(os.path.join(job.workdir, "summary.json"), "w", encoding="utf-8") as f:
        f.write(summary + "\n")
      print(f"finished {os.path.basename(job.workdir)}", file=sys.stderr, flush=True)
    for core in [c for c in range(parallel) if c not in running]:
      ready = [j for j in pending if j.setting == first_setting
               or os.path.exists(os.path.join(os.path.dirname(j.sft_dir(first_setting)),
                                              "summary.json"))]
      if not ready:
        break
      job = ready[0]
      pending.remove(job)
      os.makedirs(job.workdir, exist_ok=True)
      pin = (lambda c=core: os.sched_setaffinity(0, {c})) if parallel > 1 else None
      with open(os.path.join(job.workdir, "stdout.txt"), "w", encoding="utf-8") as out, \
           open(os.path.join(job.workdir, "run.log"), "w", encoding="utf-8") as log:
        running[core] = (subprocess.Popen(job.command(first_setting), stdout=out, stderr=log,
                                          preexec_fn=pin), job)
      print(f"started {os.path.basename(job.workdir)}" + (f" on core {core}" if pin else ""),
            file=sys.stderr, flush=True)
    time.sleep(2.0)


def read_run(job: Job) -> dict:
  records = [json.loads(line) for line in open(os.path.join(job.workdir, "metrics.jsonl"))]
  evals = {}
  for r in records:
    if r["phase"] == "eval":
      evals[r["step"]] = r["pass1"]  # step 0: init, then "before" (after SFT) overwrites
  curve = sorted(evals.items())
  grpo = [r for r in records if r["phase"] == "grpo"]
  best, fall = 0.0, 0.0
  for _, p in curve:
    best = max(best, p)
    fall = max(fall, best - p)
  nll = [r["sampled_nll_mean"] for r in grpo]
  return {"setting": job.setting, "start": job.start, "seed": job.seed,
          "curve": curve, "reach": {str(level): first_reach(curve, level) for level in LEVELS},
          "max_fall_from_best": round(fall, 4), "final_pass1": curve[-1][1],
          "sampled_nll_first10": round(statistics.mean(nll[:10]), 4),
          "sampled_nll_last10": round(statistics.mean(nll[-10:]), 4),
          "summary": json.load(open(os.path.join(job.workdir, "summary.json")))}


def compare_to_reference(runs: list[dict], settings: list[str], starts: list[str],
                         reference: str) -> dict:
  """Per start and setting: the first step at which the seed-mean curve reaches each level,
  and whether it is no later than the reference's (a level the reference never reaches is
  met by any setting; one only the reference reaches is missed).

  The seed-mean curve, not each seed: one setting from one start reaches a level hundreds of
  steps apart from seed to seed (trl from 0.25: 0.5 at steps 25, 400 and 150), so two
  settings' per-seed cells compare draws of that spread."""
  out = {}
  for start in starts:
    curves = {s: mean_curve([r for r in runs if r["start"] == start and r["setting"] == s])
              for s in settings}
    ref = {lv: first_reach(curves[reference], lv) for lv in LEVELS}
    out[start] = {}
    for s in settings:
      reach = {lv: first_reach(curves[s], lv) for lv in LEVELS}
      out[start][s] = {
          "mean_curve_reach": {str(lv): reach[lv] for lv in LEVELS},
          "no_later_than_reference": {
              str(lv): ref[lv] is None or (reach[lv] is not None and reach[lv] <= ref[lv])
              for lv in LEVELS},
          "mean_final_pass1": round(curves[s][-1][1], 4)}
  return out


def tables(runs: list[dict], settings: list[str], starts: list[str], reference: str,
           verdicts: dict) -> str:
  """Markdown: per start, mean held-out pass@1 (min..max over seeds) at each evaluation,
  the first step reaching each level per seed, and on the seed-mean curve against the
  reference setting's (`verdicts`: compare_to_reference's)."""
  out = []
  for start in starts:
    rs = [r for r in runs if r["start"] == start]
    steps = sorted({s for r in rs for s, _ in r["curve"]})
    out.append(f"\n### SFT start {start}: held-out greedy pass@1 (mean over seeds, min..max)\n")
    out.append("| step | " + " | ".join(settings) + " |")
    out.append("|---" * (len(settings) + 1) + "|")
    for step in steps:
      cells = []
      for s in settings:
        ps = [dict(r["curve"]).get(step) for r in rs if r["setting"] == s]
        ps = [p for p in ps if p is not None]
        cells.append(f"{statistics.mean(ps):.3f} ({min(ps):.2f}..{max(ps):.2f})" if ps else "")
      out.append(f"| {step} | " + " | ".join(cells) + " |")
    out.append("\n| setting | " + " | ".join(f"steps to {lv} (per seed)" for lv in LEVELS)
               + " | largest fall from best | sampled -log pi first/last 10 steps |")
    out.append("|---" * (len(LEVELS) + 3) + "|")
    for s in settings:
      mine = [r for r in rs if r["setting"] == s]
      reach = [", ".join(str(r["reach"][str(lv)]) for r in mine) for lv in LEVELS]
      fall = ", ".join(f"{r['max_fall_from_best']:.2f}" for r in mine)
      nll = ", ".join(f"{r['sampled_nll_first10']:.2f}/{r['sampled_nll_last10']:.2f}"
                      for r in mine)
      out.append(f"| {s} | " + " | ".join(reach) + f" | {fall} | {nll} |")
    out.append("\n| setting | " + " | ".join(f"mean curve to {lv}" for lv in LEVELS)
               + f" | mean final | no later than {reference} at every level |")
    out.append("|---" * (len(LEVELS) + 3) + "|")
    for s in settings:
      v = verdicts[start][s]
      out.append(f"| {s} | " + " | ".join(str(v["mean_curve_reach"][str(lv)]) for lv in LEVELS)
                 + f" | {v['mean_final_pass1']:.3f} | "
                 + ("yes" if all(v["no_later_than_reference"].values()) else "no") + " |")
  return "\n".join(out) + "\n"


def main(_):
  unknown = set(_SETTINGS.value + [_REFERENCE.value]) - set(SETTINGS)
  if unknown:
    raise app.UsageError(f"unknown settings {sorted(unknown)}; known: {sorted(SETTINGS)}")
  if _REFERENCE.value not in _SETTINGS.value:
    raise app.UsageError(f"--reference={_REFERENCE.value} is not among --settings")
  os.makedirs(_OUT.value, exist_ok=True)
  first = _SETTINGS.value[0]
  jobs = [Job(setting, start, seed, _STEPS.value, _EVAL_EVERY.value, _OUT.value,
              _WORKLOAD.value)
          for start in _STARTS.value for seed in _SEEDS.value for setting in _SETTINGS.value]
  t0 = time.perf_counter()
  run_jobs(jobs, first, _PARALLEL.value)
  runs = [read_run(j) for j in jobs]
  verdicts = compare_to_reference(runs, _SETTINGS.value, _STARTS.value, _REFERENCE.value)
  md = tables(runs, _SETTINGS.value, _STARTS.value, _REFERENCE.value, verdicts)
  with open(os.path.join(_OUT.value, "table.md"), "w", encoding="utf-8") as f:
    f.write(md)
  print(md, file=sys.stderr)
  print(json.dumps({"study": "recipe", "config": "configs/arith_tiny.py",
                    "workload": {_WORKLOAD.value: WORKLOADS[_WORKLOAD.value]},
                    "steps": _STEPS.value,
                    "settings": {s: SETTINGS[s] for s in _SETTINGS.value},
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "reference": _REFERENCE.value,
                    "against_reference": verdicts,
                    "runs": [{k: v for k, v in r.items() if k != "summary"} for r in runs]}))


if __name__ == "__main__":
  app.run(main)
