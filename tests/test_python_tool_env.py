"""The Python-tool env: step semantics, the observation a policy sees, the sandbox's own
failures as infra failures, limits applied, SFT targets that replay through the real
sandbox, per-episode tool metrics from the rollout, and a short run of
configs/python_tool_tiny.py's pipeline."""

import json
import logging
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rljax import envs
from rljax.engine.engine import DecodeEngine, SamplingParams
from rljax.envs import python_tool, sandbox
from rljax.envs.base import StepResult
from rljax.envs.sandbox_limits import SandboxLimits, SandboxResult
from rljax.envs.tokenizer import CALL_CLOSE_ID, EOS_ID, OBS_CLOSE_ID, OBS_OPEN_ID, CharTokenizer
from rljax.numerics import Numerics
from rljax.pipeline.metrics import read_jsonl
from rljax.pipeline.rollout import episode_info_means, generate_groups
from rljax.rl.trajectory import Outcome
from tests.shapes import TWO_LAYERS

TOK = CharTokenizer()
ROOT = pathlib.Path(__file__).resolve().parents[1]
EMPTY = np.zeros(0, np.int32)


def ids(text):
  return TOK.encode(text)


def obs_text(step):
  return TOK.decode(step.observation_ids)


def actions_of(target):
  """The policy's actions in an SFT target: its loss-masked runs."""
  mask = target.loss_mask
  starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
  ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]])) + 1
  return [target.completion_ids[a:b] for a, b in zip(starts, ends)]


def replay(actions):
  it = iter(actions)
  return lambda sequence: next(it)


@pytest.fixture(scope="module")
def env():
  return envs.make("python_tool")


def test_registered_multi_turn_env_with_the_calculator_tasks(env):
  assert isinstance(env, envs.PythonToolEnv) and isinstance(env, envs.MultiTurnEnv)
  assert env.stop_ids == (EOS_ID, CALL_CLOSE_ID) and env.max_turns == 3
  tasks = env.prompts("train", 20, seed=0)
  for task in tasks:
    a, b = task.task_id.rstrip("?").split("*")
    assert len(a) == len(b) == 3 and task.data["result"] == int(a) * int(b)
  # the calculator's split: a problem is held out in both envs or in neither
  calc_held = {t.split_key for t in envs.CalculatorEnv(min_digits=3).prompts("held_out", 30, 0)}
  assert calc_held.isdisjoint({t.split_key for t in tasks})
  with pytest.raises(ValueError, match="max_obs_tokens"):
    envs.PythonToolEnv(max_obs_tokens=4)
  with pytest.raises(ValueError, match="positive"):
    envs.PythonToolEnv(limits={"wall_s": 0})


def test_step_runs_the_program_and_answers_with_its_output(env):
  task = env.prompts("train", 1, seed=0)[0]
  expression, result = task.data["expression"], task.data["result"]
  calls = env.stats["calls"]
  step = env.step(task, EMPTY, ids(f"ok<calc>print({expression})</calc>"))
  assert not step.done and step.error is None
  assert obs_text(step) == f"<obs>{result}</obs>"
  assert step.info == {"tool_calls": 1, "tool_errors": 0}
  # Python, not the calculator's grammar: names, calls, power, integer division
  for code, out in ((f"print({expression}-1)", str(result - 1)),
                    ("print(sum(range(101)))", "5050"), ("print(2**10,7//2)", "1024 3"),
                    ("x=3", "")):
    step = env.step(task, EMPTY, ids(f"<calc>{code}</calc>"))
    assert obs_text(step) == f"<obs>{out}</obs>" and step.info["tool_errors"] == 0, code
  assert env.stats["calls"] == calls + 5
  # the program's failures are observations (the model's problem), counted as tool errors
  for code, out in (("pritn(3)", "<obs>error: nameerror: nam...</obs>"),
                    ("print(1/0)", "<obs>error: zerodivisioner...</obs>"),
                    ("print(12*34", "<obs>error: syntaxerror: (...</obs>")):
    step = env.step(task, EMPTY, ids(f"<calc>{code}</calc>"))
    assert not step.done and obs_text(step) == out, code
    assert step.info == {"tool_calls": 1, "tool_errors": 1}
  # a close marker without an open one: an error observation, nothing run
  calls = env.stats["calls"]
  step = env.step(task, EMPTY, ids("print(1)</calc>"))
  assert obs_text(step) == "<obs>error: call not opened</obs>"
  assert step.info == {"tool_calls": 1, "tool_errors": 1}
  assert env.stats["calls"] == calls
  # an answer (EOS), a truncated action, or the last of max_turns actions ends the episode
  for history, action in ((EMPTY, f"{result}<eos>"), (EMPTY, "<calc>print(1"),
                          (ids("<calc>1</calc><obs>1</obs><calc>2</calc><obs>2</obs>"),
                           "<calc>print(3)</calc>")):
    step = env.step(task, history, ids(action))
    assert step.done and step.observation_ids is None and step.info == {}, action


def test_observation_text_is_one_clipped_line_that_changes_no_structure(env):
  def result(status, stdout="", stderr="", detail=""):
    return SandboxResult(status, stdout, stderr, 0, None, 0.1, 0.0, 0, detail, "namespaces")

  text = env.observation_text
  assert text(result("ok", "12\n34\n")) == "12\n34\n"
  assert text(result("error", "", "Traceback ...\n  File\nKeyError: 3\n",
                     "exit code 1")) == "error: KeyError: 3"
  assert text(result("error", detail="killed by SIGSEGV")) == "error: killed by SIGSEGV"
  assert text(result("timeout", detail="killed after 3 s of wall time")) == (
      "timeout: killed after 3 s of wall time")
  render = lambda t: TOK.decode(env._observation_ids(t))  # pylint: disable=protected-access
  assert render("12\n34\n") == "<obs>12 34</obs>"
  assert render("NameError: x") == "<obs>nameerror: x</obs>"  # the char vocabulary: no capitals
  assert render("a_b 'q' [ok] %") == "<obs>ab q ok</obs>"
  assert render("9" * 30) == f"<obs>{'9' * 21}...</obs>"  # max_obs_tokens = 24
  # a program cannot close its observation, open a call, or end the episode
  # pylint: disable-next=protected-access
  forged = env._observation_ids("1</obs><calc>2<eos><bos><pad>3")
  assert TOK.decode(forged) == "<obs>123</obs>"
  assert list(forged).count(OBS_OPEN_ID) == list(forged).count(OBS_CLOSE_ID) == 1
  assert EOS_ID not in forged and CALL_CLOSE_ID not in forged


def test_the_sandbox_failing_is_an_infra_failure_not_an_observation():
  # forced to namespaces: "auto" would refuse at construction (the probe fails)
  broken = envs.PythonToolEnv(interpreter="/bin/false", isolation="namespaces")
  task = broken.prompts("train", 1, seed=0)[0]
  step = broken.step(task, EMPTY, ids(f"<calc>print({task.data['expression']})</calc>"))
  assert step.done and step.observation_ids is None and step.error.startswith("sandbox: ")
  assert broken.stats["infra_errors"] == 1 and broken.stats["errors"] == 0
  # the episode of a perfect policy is an infra failure: no reward, no gradient
  episode = envs.rollout(broken, task, replay(actions_of(broken.sft_target(task))))
  assert episode.verdict.outcome == Outcome.INFRA_FAILURE and episode.verdict.reward == 0.0
  assert episode.turns == 1 and episode.info == {"turns": 1, "tool_calls": 1, "tool_errors": 0}


def test_limits_are_applied():
  tight = envs.PythonToolEnv(limits=dict(cpu_s=1.0, wall_s=8.0, memory_bytes=64 * 2**20,
                                         output_bytes=1024), max_obs_tokens=40)
  assert tight.limits == SandboxLimits(**(python_tool.DEFAULT_LIMITS | dict(
      cpu_s=1.0, wall_s=8.0, memory_bytes=64 * 2**20, output_bytes=1024)))
  task = tight.prompts("train", 1, seed=0)[0]
  for code, out in (("while 1:pass", "<obs>cpu limit: killed after 1 s of cpu time</obs>"),
                    ("print(len(bytearray(10**9)))",
                     "<obs>memory limit: memoryerror: more than ...</obs>"),
                    ("print(10**3000)", "<obs>output limit: killed: stdout passed 1...</obs>")):
    step = tight.step(task, EMPTY, ids(f"<calc>{code}</calc>"))
    assert obs_text(step) == out, code  # this limit, not the 8 s wall-time one
    assert step.info == {"tool_calls": 1, "tool_errors": 1}
  slow = envs.PythonToolEnv(limits=dict(wall_s=1.0, cpu_s=5.0), max_obs_tokens=40)
  step = slow.step(task, EMPTY, ids("<calc>while 1:pass</calc>"))
  # the wall-time kill comes first when the CPU limit is further away
  assert obs_text(step) == "<obs>timeout: killed after 1 s of wall time</obs>"


def test_sft_targets_replay_through_the_sandbox(env):
  for task in env.prompts("train", 4, seed=3) + env.prompts("held_out", 2, seed=3):
    target = env.sft_target(task)
    expression, result = task.data["expression"], task.data["result"]
    assert TOK.decode(target.completion_ids) == (
        f"<calc>print({expression})</calc><obs>{result}</obs>{result}<eos>")
    assert TOK.decode(target.completion_ids[~target.loss_mask]) == f"<obs>{result}</obs>"
    # the observation in the target is what the sandbox answers to the target's program
    episode = envs.rollout(env, task, replay(actions_of(target)))
    np.testing.assert_array_equal(episode.completion_ids, target.completion_ids)
    np.testing.assert_array_equal(episode.loss_mask, target.loss_mask)
    assert episode.verdict.outcome == Outcome.SUCCESS
    assert episode.info == {"turns": 2, "tool_calls": 1, "tool_errors": 0}
  # a retry after an error, then the answer: three turns, two calls, one error
  task = env.prompts("train", 1, seed=0)[0]
  expression, result = task.data["expression"], task.data["result"]
  script = [ids(f"<calc>print({expression}</calc>"), ids(f"<calc>print({expression})</calc>"),
            ids(f"{result}<eos>")]
  episode = envs.rollout(env, task, replay(script))
  assert episode.verdict.outcome == Outcome.SUCCESS
  assert episode.info == {"turns": 3, "tool_calls": 2, "tool_errors": 1}


class _SlowTool(envs.ArithmeticEnv):
  """Answers every turn after step_s, records how many steps ran at once."""
  name = "slow_tool"
  max_turns = 2

  def __init__(self, step_s):
    super().__init__(max_digits=2)
    self.step_s, self.running, self.most = step_s, 0, 0
    self.lock = threading.Lock()

  def step(self, task, history_ids, action_ids):
    with self.lock:
      self.running += 1
      self.most = max(self.most, self.running)
    time.sleep(self.step_s)
    with self.lock:
      self.running -= 1
    if OBS_CLOSE_ID in history_ids:
      return StepResult(None, True)
    return StepResult(ids("<obs>7</obs>"), False, info={"tool_calls": 1, "tool_errors": 0.5})


def test_the_rollout_runs_a_batchs_env_steps_at_once_and_sums_their_info(tiny_cfg,
                                                                        tiny_params):
  env = _SlowTool(step_s=0.3)
  engine = DecodeEngine(tiny_cfg, tiny_params, numerics=Numerics("deterministic"),
                        eos_id=env.tokenizer.eos_id, num_slots=8, max_seq_len=64)
  tasks = env.prompts("train", 2, seed=0)
  # every turn ends by length at the same engine step: 8 samples' steps run together
  sp = SamplingParams(max_new_tokens=3, temperature=0.0)
  groups = generate_groups(engine, env, tasks, group_size=4, sampling=sp, seed=0)
  assert env.most == 8
  trajs = [t for g in groups for t in g.trajectories]
  assert all(t.info == {"turns": 2, "tool_calls": 1, "tool_errors": 0.5} for t in trajs)
  assert episode_info_means(trajs) == {"tool_calls_per_episode": 1.0,
                                       "tool_errors_per_episode": 0.5,
                                       "turns_per_episode": 2.0}
  assert episode_info_means([]) == {}
  assert engine.idle and engine.pool.used_count == 0


def test_a_short_run_of_the_config_reports_tool_metrics(tmp_path):
  cmd = [sys.executable, str(ROOT / "experiments" / "grpo.py"),
         "--config=configs/python_tool_tiny.py", f"--workdir={tmp_path}", "--progress=false",
         "--config.sft.steps=50", "--config.sft.log_every=25", "--config.sft.target_pass1=0",
         "--config.rl.steps=2", "--config.rl.prompts_per_step=4", "--config.rl.group_size=4",
         "--config.eval.num_tasks=4", "--config.engine.num_slots=16", *TWO_LAYERS]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["env"] == "python_tool" and summary["steps"] == 2
  records = read_jsonl(str(tmp_path / "metrics.jsonl"))
  grpo = [r for r in records if r["phase"] == "grpo"]
  assert [r["step"] for r in grpo] == [1, 2]
  for r in grpo:
    assert 1.0 <= r["turns_per_episode"] <= 3.0
    assert 0.0 <= r["tool_errors_per_episode"] <= r["tool_calls_per_episode"] <= 2.0
    assert r["infra_failures"] == 0
  # after 50 SFT steps the policy calls the tool
  assert sum(r["tool_calls_per_episode"] for r in grpo) > 0
  evals = [r for r in records if r["phase"] == "eval"]
  assert len(evals) == 3 and all("greedy_turns_per_episode" in r for r in evals)
  assert all("greedy_tool_calls_per_episode" in r for r in evals[1:])  # after SFT


def test_the_fallback_runs_only_when_chosen_by_name(monkeypatch, caplog):
  fallback = sandbox.Isolation("audit_hook", "audit_hook", "audit_hook", "process_group",
                               "host_uid", reason="unshare: Operation not permitted")
  monkeypatch.setattr(python_tool, "sandbox_isolation", lambda interpreter=None: fallback)
  # a root host (a uid of its own): the fallback may run (its refusal: tested below)
  monkeypatch.setattr(sandbox, "_host_is_root", lambda: True)
  with pytest.raises(ValueError, match="env.sandbox.isolation = 'audit_hook'"):
    envs.PythonToolEnv()  # auto, namespaces unavailable: refused
  with pytest.raises(ValueError, match="isolation must be one of"):
    envs.PythonToolEnv(sandbox={"isolation": "chroot"})
  with pytest.raises(ValueError, match="unknown sandbox settings"):
    envs.PythonToolEnv(sandbox={"isolaton": "audit_hook"})
  with caplog.at_level(logging.WARNING):
    opted = envs.PythonToolEnv(sandbox={"isolation": "audit_hook"})
  assert opted.isolation == "audit_hook"
  assert "does not contain" in caplog.text and "audit_hook" in caplog.text
  # run_python itself: "auto" without namespaces runs nothing
  monkeypatch.setattr(sandbox, "sandbox_isolation", lambda interpreter=None: fallback)
  r = sandbox.run_python("print(1)")
  assert r.status == "infra_error" and r.infra_error.startswith("refused: namespaces"), r
  assert r.stdout == ""


# The program ends its own run: each is the program's failure (a tool error observation),
# never the sandbox's (an infra failure out of the gradient)
SELF_INFLICTED = {
    "own_group": "import os, signal\nos.kill(0, signal.SIGKILL)",
    "own_pid": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "supervisor": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                  "os.kill(os.getpid(), signal.SIGKILL)",
    "killpg": "import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)",
    "every_process": "import os, signal\nos.kill(-1, signal.SIGKILL)",
    "pidfd_supervisor": "import os, signal\n"
                        "signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)",
    "abort": "import os\nos.abort()",
    "segfault": "import faulthandler\nfaulthandler._sigsegv()",
    "fd_limit": "import os\nfds = [os.open('/dev/null', 0) for _ in range(10**5)]",
    "thread_limit": "import threading, time\n"
                    "[threading.Thread(target=time.sleep, args=(9,), daemon=True).start() for _ in range(99)]",
}


@pytest.mark.parametrize("isolation", ["namespaces", "audit_hook"])
def test_a_run_the_program_ended_is_its_failure(isolation):
  if isolation == "namespaces" and sandbox.sandbox_isolation().mode != "namespaces":
    pytest.skip(f"namespaces unavailable: {sandbox.sandbox_isolation().reason}")
  if isolation == "audit_hook" and sandbox.audit_hook_refusal():
    pytest.skip("the audit_hook fallback is refused on this host (not root: no uid of its "
                "own; a kernel without Landlock): see sandbox.audit_hook_refusal()")
  env = envs.PythonToolEnv(sandbox={"isolation": isolation}, limits=dict(wall_s=5.0))
  for name, code in SELF_INFLICTED.items():
    step = env._answer_call(code)  # pylint: disable=protected-access
    assert step.error is None and not step.done, (name, step)
    assert step.info == {"tool_calls": 1, "tool_errors": 1}, (name, obs_text(step))
  assert env.stats["infra_errors"] == 0


def test_the_config_names_the_fallback_in_env_sandbox(monkeypatch):
  import ml_collections  # pylint: disable=import-outside-toplevel
  from configs import python_tool_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import run  # pylint: disable=import-outside-toplevel
  fallback = sandbox.Isolation("audit_hook", "audit_hook", "audit_hook", "process_group",
                               "host_uid", reason="no namespaces here")
  monkeypatch.setattr(python_tool, "sandbox_isolation", lambda interpreter=None: fallback)
  monkeypatch.setattr(sandbox, "_host_is_root", lambda: True)  # the fallback may run
  config = python_tool_tiny.get_config()
  cfg = type("Cfg", (), {"vocab_size": 1 << 16})()
  with pytest.raises(run.ConfigError, match="env.sandbox.isolation"):
    run.make_env(config, cfg)  # refused: no namespaces, nothing named
  config.env.sandbox = ml_collections.ConfigDict(dict(isolation="audit_hook"))
  assert run.make_env(config, cfg).isolation == "audit_hook"


def test_the_fallback_without_a_uid_of_its_own_or_landlock_fails_the_build(monkeypatch):
  """A non-root host (the program would run as the host's user) on a kernel without
  Landlock (sandbox._host_is_root, sandbox_landlock.abi_version faked): naming the
  fallback fails where the env is built, with why and what would make it run."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from configs import python_tool_tiny  # pylint: disable=import-outside-toplevel
  from rljax.envs import sandbox_landlock  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import run  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sandbox, "_host_is_root", lambda: False)
  monkeypatch.setattr(sandbox_landlock, "abi_version", lambda: 0)
  reason = sandbox.audit_hook_refusal()
  assert "without Landlock" in reason and "run as root" in reason, reason
  for kwargs in (dict(sandbox={"isolation": "audit_hook"}), dict(isolation="audit_hook")):
    with pytest.raises(ValueError, match="refuses to run model code") as e:
      envs.PythonToolEnv(**kwargs)
    assert reason in str(e.value)
  config = python_tool_tiny.get_config()
  config.env.sandbox = ml_collections.ConfigDict(dict(isolation="audit_hook"))
  cfg = type("Cfg", (), {"vocab_size": 1 << 16})()
  with pytest.raises(run.ConfigError, match="env.sandbox.isolation = 'audit_hook'") as e:
    run.make_env(config, cfg)  # the run fails at start, not per episode
  assert "kernel with Landlock" in str(e.value) and "run as root" in str(e.value)
  # "auto" without namespaces says the fallback is refused too
  fallback = sandbox.Isolation("audit_hook", "audit_hook", "audit_hook", "process_group",
                               "host_uid", reason="no namespaces here", fallback_refused=reason)
  monkeypatch.setattr(python_tool, "sandbox_isolation", lambda interpreter=None: fallback)
  with pytest.raises(ValueError, match="refused here too") as e:
    envs.PythonToolEnv()
  assert "env.sandbox.isolation = 'audit_hook'" in str(e.value) and reason in str(e.value)
  # namespaces named: untouched (built; what it runs is tested above)
  assert envs.PythonToolEnv(isolation="namespaces").isolation == "namespaces"
