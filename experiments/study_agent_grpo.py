"""GRPO through the OpenAI-compatible endpoint, per seed: a function-calling harness drives
every episode over HTTP with the `openai` SDK, as agent frameworks do (chat completions
with `tools`; the model's `tool_calls` run by the harness, their results sent back as
`role: tool` messages), and the trainer takes the episodes the endpoint recorded:

  .venv/bin/python experiments/study_agent_grpo.py --config=configs/function_call_tiny.py \
      --workdir=/tmp/fc --seeds=0,1,2

The harness and the GRPO step are `rljax.serving.harness`'s. Per seed (in
<workdir>/seed<N>):
1. SFT warm start on the env's demonstrations (`function_call`: one call, its response,
   the product), until greedy pass@1 on train probe tasks reaches `sft.target_pass1`
   (probed in-process: the env's episodes are the token sequences the endpoint records;
   the held-out greedy pass@1 in-process is reported beside the endpoint's).
2. The endpoint (rljax.serving) on the run's engine, tool calls read by `--tool_parser`.
3. Held-out greedy pass@1 through the endpoint (`temperature: 0`), before and after.
4. `rl.steps` GRPO steps: `rl.prompts_per_step` tasks x `rl.group_size` episodes at once
   through the endpoint (each episode names itself and its group by the `X-Episode-Id` /
   `X-Group-Id` headers and is closed with its reward by `POST .../finish`); the complete
   groups are taken from the endpoint (`take_groups`), one update runs on them
   (`grpo_update.train_on_groups`) and the endpoint serves the new weights.

Per episode, the harness counts turns, tool calls and tool errors (a call the tool refused:
an unknown tool, bad arguments); their means are in every grpo and endpoint_eval record of
<workdir>/seed<N>/metrics.jsonl. Each seed's summary is printed as a JSON line; the last
line is one JSON object: every seed's before / after / gain, and the machine.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from rljax import compile_cache, numerics
from rljax.pipeline import core, grpo_update, report, sft
from rljax.pipeline.run import LOCKSTEP, build
from rljax.serving import Endpoint
from rljax.serving.harness import evaluate, grpo_step

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import machine_info  # noqa: E402  pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file("config", "configs/function_call_tiny.py",
                                          "experiment config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "study directory (fresh): a run per seed",
                               required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (config.seed of each run)")
_TOOL_PARSER = flags.DEFINE_string("tool_parser", "hermes", "how the endpoint reads the "
                                   "model's tool calls (see rljax.serving.tools)")


def run_seed(config, workdir: str, tool_parser: str) -> dict:
  """One seed's run (see the module docstring); its summary."""
  if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    raise app.UsageError(f"{workdir} holds an earlier run: use a fresh workdir")
  t0 = time.perf_counter()
  run = core.setup(build(config, LOCKSTEP), workdir)
  summary = sft.warm_start(run, os.path.join(workdir, "sft_checkpoint"),
                           lambda it, **_: iter(it))
  run.engine.update_weights(run.serve(run.state), run.version)
  summary["before_inprocess_pass1"] = report.run_eval(run, 0, "before_inprocess")["pass1"]
  c = config.rl
  workers = max(c.prompts_per_step * c.group_size, len(run.heldout))
  with Endpoint(run.engine, run.env.tokenizer, sampling=run.built.sampling, seed=config.seed,
                model_name=config.name, group_size=c.group_size,
                tool_parser=tool_parser) as endpoint, \
      concurrent.futures.ThreadPoolExecutor(workers) as pool:
    before = evaluate(run, endpoint, pool, config.name, "before")
    learner = grpo_update.grpo_learner(run)
    tasks = core.task_stream(run.env, c.num_tasks, config.seed)
    records = [grpo_step(run, endpoint, pool, config.name, learner, tasks, step)
               for step in range(1, c.steps + 1)]
    after = evaluate(run, endpoint, pool, config.name, "after")
    stats = dict(endpoint.stats)
  summary |= {
      "config": config.name, "seed": config.seed, "numerics": config.numerics,
      "steps": len(records), "before_pass1": before["pass1"], "after_pass1": after["pass1"],
      "gain": after["pass1"] - before["pass1"],
      **{f"after_{k}": v for k, v in after.items() if k.endswith("_per_episode")},
      "last_step": {k: records[-1][k] for k in ("success_frac", "turns_per_episode",
                                                "tool_calls_per_episode",
                                                "tool_errors_per_episode")} if records else {},
      "mismatch_max_abs": run.mismatch.value,
      **{k: stats.get(k, 0) for k in ("http_500", "undelivered_replies", "rolled_back_turns")},
      "wall_s": round(time.perf_counter() - t0, 1), "workdir": workdir}
  run.log.write("summary", run.version, {k: v for k, v in summary.items()
                                         if isinstance(v, (int, float))})
  run.log.close()
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  for name in ("httpx", "httpx2"):  # (the openai SDK's) a line per request otherwise
    logging.getLogger(name).setLevel(logging.WARNING)
  numerics.set_up_process(config.numerics)
  compile_cache.enable_from_flags()
  root = os.path.abspath(_WORKDIR.value)
  runs = []
  for seed in (int(s) for s in _SEEDS.value):
    seeded = config.copy_and_resolve_references()
    seeded.seed = seed
    runs.append(run_seed(seeded, os.path.join(root, f"seed{seed}"), _TOOL_PARSER.value))
    print(json.dumps(runs[-1]), flush=True)
  gains = [r["gain"] for r in runs]
  print(json.dumps({
      "study": "agent_grpo", "config": config.name,
      "workload": (f"SFT to train-probe pass@1 {config.sft.target_pass1}, then "
                   f"{config.rl.steps} GRPO steps of {config.rl.prompts_per_step} x "
                   f"{config.rl.group_size} episodes through the endpoint; held-out greedy "
                   f"pass@1 on {config.eval.num_tasks} tasks through the endpoint"),
      "seeds": [r["seed"] for r in runs],
      "before_pass1": [r["before_pass1"] for r in runs],
      "after_pass1": [r["after_pass1"] for r in runs], "gain": gains,
      "min_gain": min(gains), "http_500": sum(r["http_500"] for r in runs),
      "machine": machine_info.machine()}), flush=True)


if __name__ == "__main__":
  app.run(main)
