"""What a run reports: held-out evaluations (`run_eval`, with the held-out collapse
alarm), each update's alarms (`train_collapse`: the training signal's collapse alarm;
`watch_rollouts`: the infra-failure stop) and the run's summary (`summarize`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from absl import logging

from rljax.pipeline.core import Run
from rljax.pipeline.evaluate import evaluate, sampled_key
from rljax.pipeline.watch import AllInfraFailures


def run_eval(run: Run, step: int, name: str, params: Any = None) -> dict:
  """Held-out evaluation with the serving params of run.state (or `params`, e.g. gathered
  onto the evaluating process's device)."""
  e = run.config.eval
  run.engine.update_weights(run.serve(run.state) if params is None else params, run.version)
  t0 = time.perf_counter()
  out = evaluate(run.engine, run.env, run.heldout, k=e.k, n=e.n, temperature=e.temperature,
                 max_new_tokens=run.config.rl.max_new_tokens, seed=e.seed,
                 failures=run.failures)
  out["eval_s"] = time.perf_counter() - t0
  if name != "init":  # the random model's score is no baseline
    out |= run.heldout_fall.update(out["pass1"])
    if out["collapse_alarm"]:
      logging.warning("step %d: held-out pass@1 %.3f is %.3f below its best %.3f (%.3f "
                      "below its start %.3f): is the policy collapsing? (see entropy, kl, "
                      "sampled_nll_mean, mismatch_max_abs, ratio_max in metrics.jsonl)",
                      step, out["pass1"], out["pass1_fall_from_best"], run.heldout_fall.best,
                      out["pass1_fall_from_start"], run.heldout_fall.start)
  run.log.write("eval", step, out)
  return out | {"name": name}


def watch_rollouts(run: Run, step: int, stats: dict,
                   first_errors: dict | None = None) -> None:
  """One update's rollout stats into `run.watch`; raises AllInfraFailures (after writing a
  `stopped` record) when every episode of rl.max_all_infra_updates consecutive updates was
  an infra failure. `first_errors`: the first failure of each kind (default: this
  process's, `run.failures.first`)."""
  run.watch.update(step, stats, max_new_tokens=run.config.rl.max_new_tokens,
                   stop_ids=run.env.stop_ids)
  message = run.watch.stop_message(run.failures.first if first_errors is None
                                   else first_errors)
  if message:
    run.log.write("stopped", step, {"all_infra_updates": run.watch.streak,
                                    **run.watch.summary()})
    raise AllInfraFailures(message)


def train_collapse(run: Run, step: int, success_frac: float) -> dict:
  """One update's sampled success fraction into the training signal's collapse alarm
  (`run.train_fall`); its record fields. Warns the first time it fires."""
  out = run.train_fall.update(success_frac)
  if out["train_collapse_alarm"] and run.train_fall.alarms == 1:
    logging.warning("step %d: the sampled success fraction's %d-update mean %.3f is %.3f "
                    "below its start %.3f: is the policy collapsing? (see entropy, kl, "
                    "sampled_nll_mean, ratio_max in metrics.jsonl)", step,
                    run.train_fall.window, out["success_frac_avg"],
                    out["success_fall_from_start"], run.train_fall.start)
  return out


def summarize(run: Run, evals: Sequence[dict], wall_s: float, extra: dict) -> dict:
  """The run's summary: held-out results before/after, mismatch, timings, and `extra`."""
  by_name = {e["name"]: e for e in evals}
  k = run.config.eval.k
  out = {
      "config": run.config.name, "env": run.env.name, "seed": run.config.seed,
      "numerics": run.numerics.mode,
      "heldout_pass1_init": by_name["init"]["pass1"],
      "heldout_pass1_before": by_name["before"]["pass1"],
      "heldout_pass1_after": by_name["after"]["pass1"],
      f"heldout_{sampled_key(k)}_before": by_name["before"][sampled_key(k)],
      f"heldout_{sampled_key(k)}_after": by_name["after"][sampled_key(k)],
      "heldout_reward_before": by_name["before"]["reward_greedy"],
      "heldout_reward_after": by_name["after"]["reward_greedy"],
      "heldout_tasks": len(run.heldout),
      "steps": run.version,
      "mismatch_max_abs": run.mismatch.value,  # None: no token was checked
      "mismatch_tokens": run.mismatch.tokens,
      "heldout_max_fall": run.heldout_fall.max_fall,
      "collapse_alarms": run.heldout_fall.alarms,
      # updates whose sampled success moving average was down by rl.collapse_fall
      "train_collapse_alarms": run.train_fall.alarms,
      "train_max_success_fall": run.train_fall.max_fall,
      "rollout_s": round(run.timings["rollout_s"], 1),
      "train_s": round(run.timings["train_s"], 1),
      "wall_s": round(wall_s, 1),
      # every update's episodes: infra failures (by reason), reward-function errors, and
      # updates whose every sample ran out of max_new_tokens
      **run.watch.summary(),
  }
  return out | extra
