"""Episodes on the engine (single- and multi-turn), evaluation, metrics, the sync GRPO loop."""

import json
import math
import re
import os
import pathlib
import subprocess
import sys
import time

import chex
from hypothesis import given, settings, strategies as st
import jax
import numpy as np
import pytest

from rljax.engine.engine import DecodeEngine, SamplingParams
from rljax.envs import ArithmeticEnv, StepResult, Verdict
from rljax.model import forward
from rljax.model.packing import pack
from rljax.model.scoring import packed_logprobs
from rljax.numerics import Numerics
from rljax.pipeline.evaluate import evaluate, pass_at_k
from rljax.pipeline.metrics import MetricsLogger, plot_reward_curve, read_jsonl
from rljax.pipeline.rollout import generate_groups
from rljax.pipeline.core import rows_for
from rljax.pipeline import wire
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory

from tests.shapes import ENGINE, TWO_LAYERS

DET = Numerics("deterministic")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _engine(tiny_cfg, tiny_params, env, **shape):
  """An engine of conftest's shared shape, or of `shape` where a test is about it."""
  return DecodeEngine(tiny_cfg, tiny_params, numerics=DET, eos_id=env.tokenizer.eos_id,
                      **(ENGINE | shape))


@given(st.integers(1, 12), st.integers(0, 20), st.integers(0, 12))
def test_pass_at_k_is_the_combinatorial_estimator(n, c, k):
  c, k = min(c, n), max(1, min(k, n))
  expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
  assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_bad_counts():
  with pytest.raises(ValueError):
    pass_at_k(4, 5, 2)
  with pytest.raises(ValueError):
    pass_at_k(4, 1, 0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60), st.sampled_from([64, 128]))
def test_rows_for_always_holds_the_worst_case(lengths, row_len):
  max_len = 40
  rows = rows_for(len(lengths), max_len, row_len, page_size=16)
  pack([[1] * n for n in lengths], row_len, 16, num_rows=rows)  # raises if it does not fit


def test_single_turn_groups_are_complete_ordered_and_scored(tiny_cfg, tiny_params):
  env = ArithmeticEnv(max_digits=2)
  tasks = env.prompts("train", 5, seed=0)
  eng = _engine(tiny_cfg, tiny_params, env)
  groups = generate_groups(eng, env, tasks, group_size=3, seed=1,
                           sampling=SamplingParams(max_new_tokens=4), first_request_id=100)
  assert [g.task for g in groups] == tasks
  for i, g in enumerate(groups):
    assert [t.sample_index for t in g.trajectories] == [0, 1, 2]
    for t in g.trajectories:
      assert t.request_id == 100 + i and t.group_id == 100 + i
      np.testing.assert_array_equal(t.prompt_ids, g.task.prompt_ids)
      assert t.outcome in (Outcome.SUCCESS, Outcome.MODEL_FAILURE)
      assert t.reward == (1.0 if t.outcome == Outcome.SUCCESS else 0.0)
  assert eng.idle and eng.pool.used_count == 0


class _EchoTool(ArithmeticEnv):
  """A multi-turn env that answers every turn with the same observation, three turns."""
  name = "echo_tool"
  max_turns = 3

  def __init__(self, fail_step_on_turn=None, step_delay_s=0.0, **kw):
    super().__init__(max_digits=2, **kw)
    self.fail_step_on_turn = fail_step_on_turn
    self.step_delay_s = step_delay_s
    self.obs = self.tokenizer.encode("<obs>7</obs>")

  def step(self, task, history_ids, action_ids):
    time.sleep(self.step_delay_s)
    # count whole observations: a random policy may emit a lone "</obs>" id itself
    h, o = list(history_ids), list(self.obs)
    turn = sum(h[i:i + len(o)] == o for i in range(len(h))) + 1
    if turn == self.fail_step_on_turn:
      raise RuntimeError("sandbox died")
    return StepResult(None, True) if turn >= self.max_turns else StepResult(self.obs, False)

  def verify(self, task, completion_ids):
    return Verdict.success() if len(completion_ids) % 2 else Verdict.model_failure("even")


def test_multi_turn_episode_is_one_growing_sequence_bitwise_the_trainers(tiny_cfg, tiny_params):
  env = _EchoTool()
  tasks = env.prompts("train", 3, seed=0)
  eng = _engine(tiny_cfg, tiny_params, env)
  groups = generate_groups(eng, env, tasks, group_size=2, seed=3,
                           sampling=SamplingParams(max_new_tokens=5))
  obs = list(env.obs)
  trajs = [t for g in groups for t in g.trajectories]
  # the trainer's packed forward on the whole episodes (its own routing, no replay)
  rescored = packed_logprobs(tiny_params, [t.tokens for t in trajs], cfg=tiny_cfg,
                             numerics=DET, row_len=ENGINE["max_seq_len"])
  for t, lp in zip(trajs, rescored):
    # three actions of <= 5 tokens with two observations between them, masked out
    c, m = t.completion_ids, t.loss_mask
    off = np.flatnonzero(~m)
    assert len(off) == 2 * len(obs)
    assert [list(c[off[i * len(obs):(i + 1) * len(obs)]]) for i in range(2)] == [obs, obs]
    assert np.all(t.behaviour_logprobs[~m] == 0) and np.all(t.versions[~m] == -1)
    assert t.outcome == (Outcome.SUCCESS if len(c) % 2 else Outcome.MODEL_FAILURE)
    # the trainer's forward on the whole episode gives the engine's log-probs exactly
    chex.assert_trees_all_equal(lp[len(t.prompt_ids) - 1:][m], t.behaviour_logprobs[m])
  assert eng.idle and not eng.parked and eng.pool.used_count == 0


@pytest.fixture(scope="module")
def echo_episodes_with_room(tiny_cfg, tiny_params):
  """The deadlock test's reference: its episodes on an engine with pages to spare (the
  env's step delay changes no episode, so the three cases share it)."""
  env = _EchoTool()
  roomy = _engine(tiny_cfg, tiny_params, env)
  return generate_groups(roomy, env, env.prompts("train", 6, seed=0), group_size=4, seed=5,
                         sampling=SamplingParams(max_new_tokens=5))


@pytest.mark.parametrize("step_delay_s,steps_per_call", [(0.0, 8), (0.01, 8), (0.0, 1)])
def test_multi_turn_continuations_waiting_for_pages_do_not_deadlock(tiny_cfg, tiny_params,
                                                                    echo_episodes_with_room,
                                                                    step_delay_s,
                                                                    steps_per_call):
  # Continuations queued by extend() hold their pages while they wait; with the pool
  # full of them nothing could run (calc_tiny hit OutOfPages). Their caches are dropped
  # and re-prefilled instead, and the episodes stay bitwise the same. A slow env step
  # must not leave parked sequences holding the pool either (it did when steps ran on
  # the env threads while the engine admitted new prompts). With one step per call a
  # lone running sequence may need a page only waiting continuations hold: their caches
  # go (it raised OutOfPages "a single sequence does not fit" on calc_tiny's eval).
  env = _EchoTool(step_delay_s=step_delay_s)
  tasks = env.prompts("train", 6, seed=0)
  sp = SamplingParams(max_new_tokens=5)
  small = _engine(tiny_cfg, tiny_params, env, num_slots=4, max_seq_len=64, num_pages=9,
                  steps_per_call=steps_per_call)  # 4 slots x 4 pages: 9 pages press
  a = generate_groups(small, env, tasks, group_size=4, seed=5, sampling=sp)
  assert small.stats["preemptions"] > 0 and len(a) == len(echo_episodes_with_room)
  for ga, gb in zip(a, echo_episodes_with_room):
    for ta, tb in zip(ga.trajectories, gb.trajectories):
      chex.assert_trees_all_equal(ta.tokens, tb.tokens)
      chex.assert_trees_all_equal(ta.behaviour_logprobs, tb.behaviour_logprobs)
      chex.assert_trees_all_equal(ta.expert_ids, tb.expert_ids)
  assert small.idle and small.pool.used_count == 0


def test_episodes_that_outgrow_the_context_are_cut_there(tiny_cfg, tiny_params,
                                                        echo_episodes_with_room):
  # An env that never says done: every episode ends at the context (48 tokens), either
  # because a turn reached it or because the next observation did not fit. Each keeps
  # what it had (observations off the mask, the trainer's log-probs bitwise), finishes
  # as FinishReason.CONTEXT, and keeps that reason across the wire.
  env = _EchoTool()
  env.max_turns = 50
  max_len, obs = 48, len(env.obs)
  eng = _engine(tiny_cfg, tiny_params, env, max_seq_len=max_len, num_pages=None)
  groups = generate_groups(eng, env, env.prompts("train", 4, seed=0), group_size=4, seed=2,
                           sampling=SamplingParams(max_new_tokens=5))
  trajs = [t for g in groups for t in g.trajectories]
  rescored = packed_logprobs(tiny_params, [t.tokens for t in trajs], cfg=tiny_cfg,
                             numerics=DET, row_len=max_len)
  for t, lp in zip(trajs, rescored):
    assert t.finish_reason == FinishReason.CONTEXT and 1 <= t.info["turns"] < 50
    assert len(t.tokens) == max_len or len(t.tokens) + obs >= max_len
    m = t.loss_mask
    assert (~m).sum() == (t.info["turns"] - 1) * obs and m[-1]
    chex.assert_trees_all_equal(lp[len(t.prompt_ids) - 1:][m], t.behaviour_logprobs[m])
  full = sum(len(t.tokens) == max_len for t in trajs)
  assert 0 < full < len(trajs)  # both ways of reaching the context happened
  for g in groups:
    back = wire.group_from_arrays(wire.group_to_arrays(g.trajectories), g.request_id)
    assert [t.finish_reason for t in back] == [FinishReason.CONTEXT] * 4
  assert eng.idle and not eng.parked and eng.pool.used_count == 0
  # episodes the env ends (3 turns, with room) are not cut
  assert all(t.finish_reason != FinishReason.CONTEXT
             for g in echo_episodes_with_room for t in g.trajectories)

  # single turn (same engine): an answer stopped by the context is cut, one stopped by
  # max_new_tokens is not
  arith = ArithmeticEnv(max_digits=2)
  tasks = arith.prompts("train", 2, seed=0)
  reasons = set()
  for new, first in ((max_len, 100), (2, 200)):
    for g in generate_groups(eng, arith, tasks, group_size=4, seed=1, first_request_id=first,
                             sampling=SamplingParams(max_new_tokens=new)):
      for t in g.trajectories:
        if t.completion_ids[-1] == arith.tokenizer.eos_id:
          assert t.finish_reason == FinishReason.EOS
        else:
          assert t.finish_reason == (FinishReason.CONTEXT if len(t.tokens) == max_len
                                     else FinishReason.LENGTH)
          assert len(t.tokens) == max_len or len(t.completion_ids) == new
        reasons.add(t.finish_reason)
  assert {FinishReason.CONTEXT, FinishReason.LENGTH} <= reasons


@pytest.mark.parametrize("overlong", ["score", "mask", "drop"])
def test_overlong_says_what_an_episode_cut_by_the_context_trains(overlong):
  # two groups of four; sample 0 of each was cut by the context
  import types  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import grpo_update, watch  # pylint: disable=import-outside-toplevel
  from rljax.rl.advantages import group_advantages  # pylint: disable=import-outside-toplevel
  rewards = np.array([1, 0, 0, 1, 0, 1, 1, 1], np.float32)
  cut = np.array([1, 0, 0, 0, 1, 0, 0, 0], bool)
  groups = [[Trajectory(np.array([1], np.int32), np.array([2, 3], np.int32), np.ones(2, bool),
                        np.zeros(2, np.float32), np.zeros(2, np.int32), None,
                        FinishReason.CONTEXT if cut[i] else FinishReason.EOS,
                        reward=float(rewards[i]),
                        outcome=Outcome.SUCCESS if rewards[i] else Outcome.MODEL_FAILURE)
             for i in range(4 * g, 4 * g + 4)] for g in range(2)]
  run = types.SimpleNamespace(config=ml_collections.ConfigDict(
      {"rl": {"prompts_per_step": 2, "group_size": 4, "overlong": overlong}}))
  grpo = types.SimpleNamespace(advantages=lambda r, gid, v: group_advantages(
      r, gid, v, kind="grpo", num_groups=2))
  adv = grpo_update.advantages_of(run, grpo, groups)
  gids = np.repeat([0, 1], 4)
  everyone, uncut = np.ones(8, bool), ~cut
  want = np.asarray(group_advantages(rewards, gids, uncut if overlong == "drop" else everyone,
                                     kind="grpo", num_groups=2)[0])
  chex.assert_trees_all_equal(adv.values, want)
  chex.assert_trees_all_equal(adv.valid, everyone if overlong == "score" else uncut)
  assert adv.stats["overlong_episodes"] == 2
  if overlong == "drop":  # group 1 without its cut sample ties: no signal, advantages 0
    assert not grpo_update.has_signal(groups[1], overlong) and not adv.values[4:].any()
  else:
    assert grpo_update.has_signal(groups[1], overlong) and adv.values[4:].any()
  assert watch.rollout_stats([t for g in groups for t in g])["overlong_frac"] == 0.25


def test_env_errors_are_infra_failures(tiny_cfg, tiny_params):
  env = _EchoTool(fail_step_on_turn=2)
  eng = _engine(tiny_cfg, tiny_params, env)
  groups = generate_groups(eng, env, env.prompts("train", 2, seed=0), group_size=2, seed=0,
                           sampling=SamplingParams(max_new_tokens=4))
  assert all(t.outcome == Outcome.INFRA_FAILURE and t.reward == 0.0
             for g in groups for t in g.trajectories)
  assert eng.idle and not eng.parked and eng.pool.used_count == 0


def test_evaluate_counts_greedy_and_sampled(tiny_cfg, tiny_params):
  env = ArithmeticEnv(max_digits=2)
  tasks = env.prompts("held_out", 6, seed=0)
  eng = _engine(tiny_cfg, tiny_params, env)
  out = evaluate(eng, env, tasks, k=2, n=4, temperature=1.0, max_new_tokens=4, seed=0)
  assert out["tasks"] == 6 and out["infra_failures"] == 0
  assert 0.0 <= out["pass1"] <= 1.0 and 0.0 <= out["pass2"] <= 1.0
  again = evaluate(eng, env, tasks, k=2, n=4, temperature=1.0, max_new_tokens=4, seed=0)
  assert again == out  # PRNG keys derive from (seed, request id, position): reproducible


def test_metrics_logger_writes_jsonl_tensorboard_and_a_plot(tmp_path):
  with MetricsLogger(str(tmp_path)) as log:
    for s in range(1, 6):
      log.write("grpo", s, {"reward_mean": np.float32(s / 10), "skipped": np.bool_(False)})
    log.write("eval", 5, {"pass1": 0.5})
    with pytest.raises(TypeError):
      log.write("grpo", 6, {"bad": np.zeros(3)})
  records = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["phase"] for r in records] == ["grpo"] * 5 + ["eval"]
  assert records[2]["reward_mean"] == pytest.approx(0.3)
  assert any(p.name.startswith("events") for p in (tmp_path / "tb").iterdir())
  plot_reward_curve(records, str(tmp_path / "curve.png"))
  assert (tmp_path / "curve.png").stat().st_size > 1000


def _grpo(workdir, *overrides):
  cmd = [sys.executable, str(ROOT / "experiments" / "grpo.py"), f"--workdir={workdir}",
         "--progress=false", "--config.sft.steps=30", "--config.sft.log_every=10",
         "--config.sft.probe_every=10", "--config.sft.probe_tasks=8",
         "--config.rl.steps=3", "--config.rl.prompts_per_step=4", "--config.rl.group_size=4",
         "--config.eval.num_tasks=8", "--config.eval.n=4", "--config.eval.k=4",
         "--config.eval.every=2", "--config.engine.num_slots=16", *TWO_LAYERS, *overrides]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  def strict(name):  # NaN / Infinity are not JSON
    raise ValueError(f"non-JSON constant {name} in the last line")
  return json.loads(proc.stdout.strip().splitlines()[-1], parse_constant=strict)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
  """A short lockstep run in fast mode: (workdir, its summary)."""
  workdir = tmp_path_factory.mktemp("lockstep") / "fast"
  return workdir, _grpo(workdir)


def test_the_collapse_alarm_fires_on_a_fall_from_the_best_not_on_noise():
  from rljax.pipeline.metrics import FallAlarm  # pylint: disable=import-outside-toplevel
  alarm = FallAlarm(threshold=0.15)
  seen = [alarm.update(p) for p in (0.25, 0.5, 0.42, 0.75, 0.68, 0.39, 0.8)]
  assert [s["collapse_alarm"] for s in seen] == [0, 0, 0, 0, 0, 1, 0]
  assert seen[5]["pass1_fall_from_best"] == 0.75 - 0.39
  assert alarm.best == 0.8 and alarm.max_fall == 0.75 - 0.39 and alarm.alarms == 1


def test_the_collapse_alarm_fires_on_a_fall_from_the_start():
  """The collapse that motivated the monitors: held-out pass@1 0.57 -> 0.24 within 40 steps
  (evaluations every 10; it never rose above its start, so best = start)."""
  from rljax.pipeline.metrics import FallAlarm  # pylint: disable=import-outside-toplevel
  alarm = FallAlarm(threshold=0.15)
  seen = [alarm.update(p) for p in (0.57, 0.55, 0.46, 0.33, 0.24)]
  assert [s["collapse_alarm"] for s in seen] == [0, 0, 0, 1, 1]
  np.testing.assert_allclose([s["pass1_fall_from_start"] for s in seen],
                             [0.0, 0.02, 0.11, 0.24, 0.33], atol=1e-12)
  assert alarm.start == 0.57 and alarm.alarms == 2
  healthy = FallAlarm(threshold=0.15)  # rises, with evaluation noise of a few hundredths
  assert not any(healthy.update(p)["collapse_alarm"]
                 for p in (0.57, 0.62, 0.60, 0.68, 0.66, 0.74, 0.71, 0.78))


def _success_fracs(start, end, steps, noise, seed):
  """Sampled success fractions of `steps` updates of 256 episodes (arith_tiny's 16 x 16),
  linear from `start` to `end`, each a binomial draw plus group-correlated noise."""
  rng = np.random.default_rng(seed)
  p = np.clip(np.linspace(start, end, steps) + noise * rng.standard_normal(steps), 0, 1)
  return rng.binomial(256, p) / 256


def test_the_train_collapse_alarm_fires_on_a_collapsing_success_rate_not_on_noise():
  from rljax.pipeline.metrics import SuccessFallAlarm  # pylint: disable=import-outside-toplevel
  # sampled success 0.41 -> 0.04 over 40 updates (exactly linear): the 10-update mean falls
  # 0.15 below its first window's (0.36) 27 updates in
  alarm = SuccessFallAlarm(threshold=0.15, window=10)
  seen = [alarm.update(x) for x in np.linspace(0.41, 0.04, 41)[1:]]
  fired = [i + 1 for i, s in enumerate(seen) if s["train_collapse_alarm"]]
  assert fired[0] == 27 and fired == list(range(27, 41)), fired
  assert all(s["success_fall_from_start"] == 0.0 for s in seen[:10])  # no start yet
  np.testing.assert_allclose(alarm.start, np.mean(np.linspace(0.41, 0.04, 41)[1:11]))
  assert alarm.alarms == 14
  np.testing.assert_allclose(seen[-1]["success_frac_avg"],
                             np.mean(np.linspace(0.41, 0.04, 41)[31:]))
  np.testing.assert_allclose(alarm.max_fall, alarm.start - seen[-1]["success_frac_avg"])
  # the same collapse with sampling noise (5 seeds): it fires, by update 30
  for seed in range(5):
    noisy = SuccessFallAlarm(threshold=0.15, window=10)
    alarms = [noisy.update(x)["train_collapse_alarm"]
              for x in _success_fracs(0.41, 0.04, 40, 0.03, seed)]
    assert 1 in alarms[:30], seed
  # a flat noisy run (0.41 +- binomial and 0.03 per update; 200 updates, 5 seeds) never does
  for seed in range(5):
    flat = SuccessFallAlarm(threshold=0.15, window=10)
    assert not any(flat.update(x)["train_collapse_alarm"]
                   for x in _success_fracs(0.41, 0.41, 200, 0.03, seed)), seed
    assert flat.alarms == 0 and flat.max_fall < 0.1
  # a rising run never does either (its fall from the start is negative)
  rising = SuccessFallAlarm(threshold=0.15, window=10)
  falls = [rising.update(x)["success_fall_from_start"] for x in np.linspace(0.4, 0.9, 50)]
  assert rising.alarms == 0 and falls[-1] < 0


def test_grpo_experiment_end_to_end(fast_run):
  workdir, fast = fast_run
  for key in ("heldout_pass1_before", "heldout_pass1_after", "heldout_pass4_after", "steps",
              "wall_s", "mismatch_max_abs", "heldout_max_fall", "collapse_alarms"):
    assert key in fast, key
  evals = [r for r in read_jsonl(str(workdir / "metrics.jsonl")) if r["phase"] == "eval"]
  assert "collapse_alarm" not in evals[0]  # the random model's score is no baseline
  assert all("pass1_fall_from_best" in r and "pass1_fall_from_start" in r for r in evals[1:])
  grpo = [r for r in read_jsonl(str(workdir / "metrics.jsonl")) if r["phase"] == "grpo"]
  for r in grpo:  # the collapse monitors of every update
    for key in ("entropy", "kl", "success_frac_avg", "success_fall_from_start",
                "train_collapse_alarm"):
      assert key in r, key
  assert grpo[0]["kl"] < 1e-3  # the start policy (fast numerics: not bitwise)
  assert "train_collapse_alarms" in fast
  assert fast["steps"] == 3 and fast["numerics"] == "fast"
  for f in ("metrics.jsonl", "reward_curve.png", "sft_checkpoint", "final_params"):
    assert (workdir / f).exists(), f
  assert fast["final_params"] == str(workdir / "final_params")
  records = read_jsonl(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records if r["phase"] == "grpo"] == [1, 2, 3]
  assert [r["step"] for r in records if r["phase"] == "eval"] == [0, 0, 2, 3]
  probes = [r["step"] for r in records if r["phase"] == "sft_probe"]
  assert probes == [10, 20, 30][:len(probes)] and fast["sft_steps"] == probes[-1]
  assert os.listdir(workdir / "tb")


def test_the_sft_checkpoint_warm_starts_a_deterministic_run_with_zero_mismatch(fast_run,
                                                                               tmp_path):
  det = _grpo(tmp_path / "det", f"--config.sft.load={fast_run[0] / 'sft_checkpoint'}",
              "--config.numerics=deterministic")
  assert det["mismatch_max_abs"] == 0.0  # trainer == engine, bit for bit
  assert det["steps"] == 3 and "sft_loaded_from" in det
  # a finished run's workdir is not run into again
  cmd = [sys.executable, str(ROOT / "experiments" / "grpo.py"), f"--workdir={tmp_path / 'det'}",
         "--progress=false", f"--config.sft.load={fast_run[0] / 'sft_checkpoint'}", *TWO_LAYERS]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "final_params exists (a finished run's)" in proc.stderr
  (tmp_path / "killed").mkdir()  # a run killed before it finished left its metrics
  (tmp_path / "killed" / "metrics.jsonl").write_text("")
  cmd[2] = f"--workdir={tmp_path / 'killed'}"
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "cannot resume: use a fresh workdir" in proc.stderr


def test_the_trained_weights_export_to_transformers(fast_run, tmp_path):
  import torch  # pylint: disable=g-import-not-at-top  (test extras)
  import transformers  # pylint: disable=g-import-not-at-top
  from rljax.model.hf_import import load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  out = tmp_path / "hf"
  cmd = [sys.executable, str(ROOT / "experiments" / "export_hf.py"),
         f"--params={fast_run[1]['final_params']}", f"--out={out}", "--dtype=float32",
         *TWO_LAYERS]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  env = ArithmeticEnv(min_digits=3, max_digits=3, ops=("+",))
  task = env.prompts("held_out", 1, 0)[0]
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert tok(task.task_id)["input_ids"] == task.prompt_ids.tolist()
  cfg, params = load_hf_checkpoint(str(out), dtype="float32")  # bitwise: test_hf_import
  cfg = cfg.resolved("cpu", "fast")
  tokens = np.asarray([task.prompt_ids.tolist() + [3] * 4], np.int32)
  positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
  ours = np.asarray(forward(params, tokens, positions, cfg=cfg, numerics=Numerics("fast")).logits)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  with torch.no_grad():
    theirs = model.eval()(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
  # f32 on both sides: summation order only (test_hf_import: ~1e-5 measured, 1e-4 bound)
  assert np.abs(ours - theirs).max() <= 1e-4


def test_sft_stops_at_the_first_probe_that_reaches_the_target(tmp_path, monkeypatch):
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, sft  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import build  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.model.update(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, moe_intermediate_size=16,
                           intermediate_size=32))
  config.sft.update(dict(steps=50, probe_every=5, probe_every_slow=2, probe_tasks=4,
                         batch_size=8, target_pass1=0.6, slow_down_factor=0.3))
  config.eval.num_tasks = 4
  config.log.tensorboard = False
  run = core.setup(build(config), str(tmp_path))
  rates = iter([0.1, 0.59, 0.6, 0.9])
  monkeypatch.setattr(sft, "success_rate", lambda groups: next(rates))
  learning_rates = []  # the schedule of every optimizer built, read at step 100
  make_optimizer = core.learner.make_optimizer
  monkeypatch.setattr(core.learner, "make_optimizer", lambda lr, **kw: (
      learning_rates.append(float(lr(100))), make_optimizer(lr, **kw))[1])
  out = sft.sft(run)
  assert out["sft_steps"] == 12 and out["sft_train_probe_pass1"] == 0.6
  records = read_jsonl(run.log.jsonl_path)
  assert [r["step"] for r in records if r["phase"] == "sft_probe"] == [5, 10, 12]
  # the probe passed slow_down_at (0.5) at step 10: from there the rate is cut and the
  # probe runs every probe_every_slow steps
  assert [r["step"] for r in records if r["phase"] == "sft_slow_down"] == [10]
  np.testing.assert_allclose(learning_rates, [config.sft.learning_rate,
                                              config.sft.learning_rate * 0.3], rtol=1e-6)

  # slow_down_factor 1.0 (arith_tiny's): the probe gets finer, the rate and step stay
  config.sft.slow_down_factor = 1.0  # run.config is this config
  run.log = MetricsLogger(str(tmp_path / "keep_rate"), tensorboard=False)
  rates, learning_rates[:] = iter([0.1, 0.59, 0.6]), []
  out = sft.sft(run)
  assert out["sft_steps"] == 12
  records = read_jsonl(run.log.jsonl_path)
  assert [r["step"] for r in records if r["phase"] == "sft_probe"] == [5, 10, 12]
  np.testing.assert_allclose(learning_rates, [config.sft.learning_rate], rtol=1e-6)


def test_sft_trains_on_the_env_it_is_given(tmp_path, monkeypatch):
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, sft  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import ConfigError, build  # pylint: disable=import-outside-toplevel
  from tests import own_tokenizer_env  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.model.update(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, moe_intermediate_size=16,
                           intermediate_size=32))
  config.sft.update(dict(steps=3, target_pass1=0.0, batch_size=4, num_tasks=8, log_every=1))
  config.eval.num_tasks = 4
  config.log.tensorboard = False
  run = core.setup(build(config), str(tmp_path), engine=False)
  # another task (one-digit products) on another tokenizer (59 ids; the run's has 55)
  other = own_tokenizer_env.own(min_digits=1, max_digits=1, ops=("*",))
  trained = []
  build_batch = sft.build_batch
  monkeypatch.setattr(sft, "build_batch", lambda trajs, *a, **kw: (
      trained.extend(trajs), build_batch(trajs, *a, **kw))[1])
  before = run.state.params
  out = sft.sft(run, env=other)
  assert out["sft_steps"] == 3 and np.isfinite(out["sft_nll"]) and len(trained) == 12
  tasks = {tuple(t.prompt_ids): t for t in other.prompts("train", 8, config.seed + 1)}
  for traj in trained:
    task = tasks[tuple(traj.prompt_ids)]
    assert "*" in task.task_id
    np.testing.assert_array_equal(traj.completion_ids, other.sft_target(task).completion_ids)
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(before),
                                            jax.tree.leaves(run.state.params)))
  # its vocabulary is checked against the model's, like a config's env
  too_wide = own_tokenizer_env.own(extra_ids=20)
  with pytest.raises(ConfigError, match=r"the SFT env's tokenizer \(arithmetic\) has 75 ids, "
                     r"the model \(config.model.vocab_size\) only 64"):
    sft.sft(run, env=too_wide)


def test_dynamic_sampling_replaces_groups_whose_rewards_tie(tmp_path, monkeypatch):
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, grpo_update, lockstep  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.rollout import Group
  from rljax.pipeline.run import build  # pylint: disable=import-outside-toplevel  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.model.update(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, moe_intermediate_size=16,
                           intermediate_size=32))
  config.rl.update(dict(steps=3, prompts_per_step=3, group_size=2, dynamic_sampling_rounds=3))
  config.eval.update(dict(num_tasks=4, every=0))
  config.log.tensorboard = False
  run = core.setup(build(config), str(tmp_path))
  # per generate_groups call, whether each drawn group has signal (rewards [1, 0]) or ties
  script = iter([[1, 0, 0, 1, 0, 0], [0, 0], [0, 1],  # step 1: 2 kept, none, then 1
                 [1, 1, 1, 1, 1, 1],  # step 2: the first round fills the batch
                 [0] * 6, [0] * 6, [0] * 6])  # step 3: nothing has signal: the last fills
  calls = []

  def fake_generate(engine, env, tasks, *, group_size, sampling, seed, first_request_id,
                    failures=None):
    signal = next(script)
    assert len(tasks) == len(signal)
    calls.append((first_request_id, len(tasks)))
    groups = []
    for i, (task, s) in enumerate(zip(tasks, signal)):
      trajs = []
      for reward in ([1.0, 0.0] if s else [0.0, 0.0]):
        t = Trajectory(task.prompt_ids, np.array([3], np.int32), np.array([True]),
                       np.zeros(1, np.float32), np.zeros(1, np.int32), None, FinishReason.EOS)
        t.reward = reward
        t.outcome = Outcome.SUCCESS if reward else Outcome.MODEL_FAILURE
        trajs.append(t)
      groups.append(Group(task, trajs, first_request_id + i))
    return groups

  trained = []
  monkeypatch.setattr(lockstep, "generate_groups", fake_generate)
  monkeypatch.setattr(grpo_update, "train_on_groups", lambda run, learner, groups: (
      trained.append([grpo_update.has_signal(g) for g in groups]), {"loss": 0.0})[1])
  lockstep.grpo(run)
  assert trained == [[True] * 3, [True] * 3, [False] * 3]
  assert calls == [(0, 6), (6, 2), (8, 2), (10, 6), (16, 6), (22, 6), (28, 6)]  # ids unique
  records = [r for r in read_jsonl(run.log.jsonl_path) if r["phase"] == "grpo"]
  assert [r["groups_sampled"] for r in records] == [10, 6, 18]
  # success over every sampled episode, not only the trained ones
  assert records[0]["success_frac"] == pytest.approx(3 / 20)


def test_a_nan_logprob_fails_the_mismatch_figures_and_none_means_no_tokens(tmp_path):
  import dataclasses  # pylint: disable=import-outside-toplevel
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, grpo_update  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.fidelity import VersionCheck  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.metrics import RunningMax, json_line  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import build  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.numerics = "deterministic"
  config.model.update(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, moe_intermediate_size=16,
                           intermediate_size=32))
  config.rl.update(dict(prompts_per_step=2, group_size=2))
  config.eval.num_tasks = 2
  config.log.tensorboard = False
  run = core.setup(build(config), str(tmp_path))
  learner = grpo_update.grpo_learner(run)
  check = VersionCheck(run, groups=2, keep_versions=3)
  check.hold(0, run.serve(run.state))
  groups = [g.trajectories for g in generate_groups(
      run.engine, run.env, run.env.prompts("train", 2, 0), group_size=2,
      sampling=run.built.sampling, seed=0)]
  check.check(groups)
  assert check.mismatch.value == 0.0 and check.mismatch.tokens > 0  # deterministic: exact
  poisoned = [list(g) for g in groups]
  lp = poisoned[1][1].behaviour_logprobs.copy()
  lp[np.flatnonzero(poisoned[1][1].loss_mask)[-1]] = np.nan
  poisoned[1][1] = dataclasses.replace(poisoned[1][1], behaviour_logprobs=lp)
  check.check(poisoned)
  assert np.isnan(check.mismatch.value)  # max(0.0, nan) would have said 0.0
  metrics = grpo_update.train_on_groups(run, learner, poisoned)  # version 0 sampled them all
  assert metrics["mismatch_tokens"] > 0 and np.isnan(metrics["mismatch_max_abs"])
  assert np.isnan(run.mismatch.value)
  # version 1 sampled none of these tokens: no figure, not 0.0
  metrics = grpo_update.train_on_groups(run, learner, groups)
  assert metrics["mismatch_tokens"] == 0 and "mismatch_max_abs" not in metrics
  assert np.isnan(run.mismatch.value)  # a NaN stays
  empty = RunningMax()
  empty.add(0.5, 0)
  assert empty.value is None and empty.tokens == 0
  assert json_line({"m": float("nan"), "n": None}) == '{"m": "NaN", "n": null}'


def _tiny_lockstep_config(**rl):
  """test_a_nan_logprob...'s model, numerics and batch (the same programs), no SFT."""
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.numerics = "deterministic"
  config.model.update(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, moe_intermediate_size=16,
                           intermediate_size=32))
  config.rl.update(dict(prompts_per_step=2, group_size=2, **rl))
  config.eval.num_tasks = 2
  config.sft.steps = 0
  config.log.tensorboard = False
  return config


def test_on_step_gets_each_evaluation_and_returning_false_stops_the_run_cleanly(tmp_path):
  from rljax.pipeline import lockstep  # pylint: disable=import-outside-toplevel
  config = _tiny_lockstep_config(steps=5)
  config.eval.every = 1
  seen = []

  def on_step(record):
    seen.append(record)
    return record["step"] < 2  # False after the second step: stop there

  summary = lockstep.run_experiment(config, str(tmp_path), on_step=on_step)
  assert [r["step"] for r in seen] == [1, 2]
  records = read_jsonl(str(tmp_path / "metrics.jsonl"))
  evals = [r for r in records if r["phase"] == "eval"]
  assert [r["step"] for r in evals] == [0, 0, 1, 2, 2]  # init, before, step1, step2, after
  for r, logged in zip(seen, evals[2:4]):  # each step's evaluation, as logged
    assert r["eval"]["name"] == f"step{r['step']}"
    assert {k: v for k, v in r["eval"].items() if k != "name"} == {
        k: v for k, v in logged.items() if k not in ("phase", "step")}
  assert [r["step"] for r in records if r["phase"] == "grpo"] == [1, 2]
  # stopped cleanly: the final evaluation, the final params and the summary of 2 steps
  assert summary["steps"] == 2 and records[-1]["phase"] == "summary"
  assert records[-1]["steps"] == 2
  assert (tmp_path / "final_params").exists() and (tmp_path / "reward_curve.png").exists()


def test_max_steps_runs_the_first_steps_and_the_public_step_is_the_loops(tmp_path, monkeypatch):
  from rljax.pipeline import core, grpo_update, lockstep  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import build  # pylint: disable=import-outside-toplevel
  config = _tiny_lockstep_config(steps=10)
  config.eval.every = 0
  run = core.setup(build(config), str(tmp_path))
  calls, horizons = [], []
  generate = lockstep.generate_groups

  def counting_generate(engine, env, tasks, **kw):
    calls.append((kw["first_request_id"], [t.task_id for t in tasks]))
    return generate(engine, env, tasks, **kw)

  monkeypatch.setattr(lockstep, "generate_groups", counting_generate)
  monkeypatch.setattr(grpo_update, "train_on_groups", lambda run, learner, groups: (
      setattr(run, "version", run.version + 1), {"loss": 0.0})[1])  # the update: not ours
  grpo_learner = grpo_update.grpo_learner
  monkeypatch.setattr(grpo_update, "grpo_learner", lambda run: (
      horizons.append(run.config.rl.steps), grpo_learner(run))[1])
  out = lockstep.grpo(run, max_steps=3)
  assert out["steps"] == 3 and out["evals"] == [] and horizons == [10]  # rl.steps' schedule
  assert [r["step"] for r in read_jsonl(run.log.jsonl_path) if r["phase"] == "grpo"] == [1, 2, 3]
  by_loop, calls[:] = list(calls), []
  # by hand: the same request ids and tasks, step by step
  run.version = 0
  loop = lockstep.start(run)
  records = [lockstep.step(run, loop) for _ in range(3)]
  assert calls == by_loop and [r["step"] for r in records] == [1, 2, 3]
  assert loop.steps == 3 and loop.next_request == 6
  assert records[0]["groups_sampled"] == 2 and "success_frac" in records[0]
  # an on_step that returns False ends the loop after its step; None goes on
  assert lockstep.grpo(run, on_step=lambda r: None if r["step"] < 5 else False)["steps"] == 2


def test_rollout_stats_estimate_the_sampling_entropy_over_policy_tokens_only():
  from rljax.pipeline.watch import rollout_stats  # pylint: disable=g-import-not-at-top

  def traj(lps, mask, reward, outcome=Outcome.SUCCESS):
    n = len(lps)
    return Trajectory(np.array([1], np.int32), np.arange(n, dtype=np.int32),
                      np.asarray(mask), np.asarray(lps, np.float32),
                      np.where(mask, 0, -1).astype(np.int32), None, FinishReason.EOS,
                      reward=reward, outcome=outcome)

  # an observation token (off the mask) has a behaviour log-prob of 0 and must not count
  stats = rollout_stats([traj([-1.0, 0.0, -3.0], [True, False, True], 1.0),
                         traj([-2.0], [True], 0.0, Outcome.MODEL_FAILURE)])
  assert stats["sampled_nll_mean"] == pytest.approx(2.0)
  assert stats["success_frac"] == 0.5 and stats["completion_tokens_mean"] == 1.5
  assert rollout_stats([])["sampled_nll_mean"] == 0.0


def test_a_broken_reward_fn_stops_the_run_loudly_after_n_updates(tmp_path, monkeypatch,
                                                                 caplog):
  """A reward_fn that raises (KeyError), returns "1.0" or NaN makes every episode an infra
  failure: each kind is logged once with its traceback and row, every update counts them,
  and the run stops after rl.max_all_infra_updates such updates."""
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.envs.dataset import DatasetEnv  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, grpo_update, lockstep, watch  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import build  # pylint: disable=import-outside-toplevel
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "kind": kind, "split": split})
                          + "\n" for i, (kind, split) in enumerate(
                              [("raise", "train"), ("string", "train"), ("nan", "train")] * 4
                              + [("ok", "held_out")])))
  config = arith_tiny.get_config()
  config.model.update(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, moe_intermediate_size=16,
                           intermediate_size=32))
  config.env.name = "dataset"
  config.env.kwargs = dict(path=str(rows), reward_fn="reward_fns:broken", split_field="split")
  config.sft.steps = 0
  config.rl.update(dict(steps=4, prompts_per_step=3, group_size=2, num_tasks=12,
                        max_all_infra_updates=2))
  config.eval.update(dict(num_tasks=1, every=0))
  config.log.tensorboard = False
  # every completion reaches the reward_fn (a random policy rarely writes EOS)
  monkeypatch.setattr(DatasetEnv, "_answer_text", lambda self, ids: "x")
  run = core.setup(build(config, ("model", "mesh", "env", "engine", "rl", "train", "eval",
                                  "log")), str(tmp_path / "run"))
  monkeypatch.setattr(grpo_update, "train_on_groups", lambda run, learner, groups: (
      setattr(run, "version", run.version + 1), {"loss": 0.0})[1])  # the update: not ours
  with pytest.raises(watch.AllInfraFailures, match="every episode of the last 2 updates") as e:
    lockstep.grpo(run)
  for kind in ("exception: KeyError (dataset row", "bad_return (", "nan (",
               "config.rl.max_all_infra_updates"):
    assert kind in str(e.value), kind
  records = read_jsonl(run.log.jsonl_path)
  grpo = [r for r in records if r["phase"] == "grpo"]
  assert [r["step"] for r in grpo] == [1, 2]  # stopped after the second update
  for r in grpo:
    assert r["infra_failures"] == r["reward_errors"] == r["episodes"] == 6
    assert sum(r.get(f"infra_failures_{k}", 0) for k in ("exception", "bad_return", "nan")) == 6
  stopped = [r for r in records if r["phase"] == "stopped"]
  assert stopped and stopped[0]["reward_errors"] == 12 and stopped[0]["all_infra_updates"] == 2
  summary = run.watch.summary()
  assert summary["infra_failures"] == summary["reward_errors"] == 12
  # one ERROR line per kind, however often it happened, with the row and its traceback
  errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
  assert len(errors) == 3, errors
  raised = next(m for m in errors if "exception: KeyError" in m)
  assert re.search(r"dataset row \d+ task '\d+\+\d+='", raised)
  assert 'return fields["no_such_field"]' in raised
  assert any("returned str '1.0'" in m for m in errors) and any("a reward of nan" in m
                                                               for m in errors)


def test_the_rollout_watch_warns_once_when_no_sample_stops_and_counts_infra_reasons(caplog):
  from rljax.pipeline.watch import RolloutWatch, rollout_stats  # pylint: disable=g-import-not-at-top
  from rljax.pipeline.run import ConfigError, check_values  # pylint: disable=g-import-not-at-top

  def traj(finish, outcome=Outcome.MODEL_FAILURE, reason=""):
    return Trajectory(np.array([1], np.int32), np.array([5, 6], np.int32), np.ones(2, bool),
                      np.zeros(2, np.float32), np.zeros(2, np.int32), None, finish,
                      reward=0.0, outcome=outcome, infra_reason=reason)
  caplog.set_level("WARNING")
  watch = RolloutWatch(max_all_infra=0)  # 0: never stops
  cut = rollout_stats([traj(FinishReason.LENGTH)] * 4)
  assert cut["length_frac"] == 1.0 and cut["infra_failures"] == cut["reward_errors"] == 0
  for step in (1, 2):
    watch.update(step, cut, max_new_tokens=6, stop_ids=(2,))
  mixed = rollout_stats([traj(FinishReason.LENGTH), traj(FinishReason.EOS),
                         traj(FinishReason.EOS, Outcome.INFRA_FAILURE, "timeout"),
                         traj(FinishReason.STOP, Outcome.INFRA_FAILURE, "step_failed")])
  assert mixed["length_frac"] == 0.25 and mixed["infra_failures"] == 2
  assert mixed["reward_errors"] == mixed["infra_failures_timeout"] == 1  # a verifier's
  assert mixed["infra_failures_step_failed"] == 1  # an env step's: not the reward's
  watch.update(3, mixed, max_new_tokens=6)
  warnings = [r.getMessage() for r in caplog.records if "max_new_tokens (6)" in r.getMessage()]
  assert len(warnings) == 1 and "every one of the 4 samples" in warnings[0]
  assert watch.summary() == {"infra_failures": 2, "reward_errors": 1,
                             "infra_failures_timeout": 1, "infra_failures_step_failed": 1,
                             "all_length_updates": 2}
  everything = rollout_stats([traj(FinishReason.EOS, Outcome.INFRA_FAILURE, "nan")] * 2)
  for _ in range(5):
    watch.update(4, everything, max_new_tokens=6)
  assert watch.streak == 5 and watch.stop_message() == ""  # never stops with 0
  watch.max_all_infra = 5
  assert "every episode of the last 5 updates" in watch.stop_message()
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  for bad in (-1, 1.5, True):
    config = arith_tiny.get_config()
    config.rl.max_all_infra_updates = bad
    with pytest.raises(ConfigError, match="config.rl.max_all_infra_updates must be an int"):
      check_values(config, ("rl",))
