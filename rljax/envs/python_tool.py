"""Python tool: a multi-turn env whose tool runs model-written code in the sandbox.

Prompt "<bos>123*456?" (the calculator env's tasks: a flat chain of operands, here by
default two 3-digit operands multiplied, too long for a tiny policy to do in its head).
The policy writes a program between the tool-call markers; the env runs it with
`rljax.envs.sandbox.run_python` and appends what it printed:

  action 1   <calc>print(123*456)</calc>   policy tokens (loss_mask 1); the close marker
                                           ends a turn
  obs        <obs>56088</obs>              env tokens (loss_mask 0), appended by `step`
  action 2   56088<eos>                    policy tokens; EOS ends the episode

The char tokenizer has one pair of tool-call markers (`<calc>`, `</calc>`); this env uses
them for code. Its vocabulary has no newline, semicolon or quote, so a char-level policy's
programs are one line (`print(...)`); a real tokenizer may write anything.

What the observation says (one line; past `max_obs_tokens` tokens it is cut and ends in
"..."):
  ok           the program's stdout (empty when it printed nothing)
  error        "error: " + the last line of its stderr (the exception, e.g.
               "NameError: name 'x' is not defined"), or the sandbox's detail
               ("exit code 3", "killed by SIGSEGV") when stderr is empty
  timeout, cpu_limit, memory_limit, output_limit, disk_limit
               the status and the sandbox's detail ("timeout: killed after 2 s of wall
               time", "cpu limit: killed after 1 s of CPU time")
A program's failure is an observation (the model's problem, `tool_errors` counts it). A
failure of the sandbox itself (`infra_error`: the interpreter did not start, a namespace
could not be set up) ends the episode with `StepResult.error` set, which the rollout makes
an infra_failure: never in a gradient or a baseline. An action that ends with the close
marker but has no open marker is a tool error too ("error: call not opened"), answered
without running anything.

Observation text goes through `_observation_ids`: whitespace runs become one space;
characters the tokenizer cannot encode are lowercased or dropped (the char tokenizer has
no capitals); ids that would change the episode's structure (stop ids, the tool-call and
observation markers, BOS, pad) are dropped, so a program that prints "<obs>" or "<eos>"
can neither close its observation nor end the episode.

Each tool call starts a sandbox: two interpreter starts (launcher and program) and the
namespace setup, ~120 ms of CPU on a 2-core machine (measured; ~100 ms of it the
launcher, which runs sandbox_launcher.py as a script), ~60 ms of wall per call in a batch of 64.
The rollout runs the env steps of every sample that ended a turn in the same engine step
concurrently (`rljax.pipeline.rollout`), and this env bounds how many sandboxes run at
once (`max_concurrent`, default 2 x CPU count): more only queue on the CPUs, and the
wall-time limit counts from the sandbox's start, not from the wait. `stats` counts calls and their seconds (the per-call cost a run reports).
`limits` (a `SandboxLimits` or a dict over DEFAULT_LIMITS), `isolation` and `interpreter`
go to `run_python` as they are. The env fails closed: with `isolation="auto"` (the
default) where the sandbox's namespaces are unavailable it refuses to be built; the weaker
audit-hook fallback runs only when named (`sandbox={"isolation": "audit_hook"}`, from
`config.env.sandbox`, or `isolation="audit_hook"`), and logs a warning at start saying
what it does not contain; where the fallback itself is refused (a non-root host on a
kernel without Landlock: `sandbox.audit_hook_refusal()`), naming it fails the build too,
with the reason and what would make it run. A run the program itself ended (a signal to
itself, its group or its supervisor, a limit, a crash of its interpreter) is an error
observation (a tool error; the episode scored like any failure, in the gradient); only
the sandbox's own failures, which the host proves (`SandboxResult.infra_error`), end the
episode as an infra failure.

The `info` of each answered action's step: {"tool_calls": 1, "tool_errors": 0 | 1}; the
rollout sums them per episode (with the episode's turns) into `Trajectory.info`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any, Mapping

import numpy as np

from rljax.envs.base import SFTTarget, StepResult, Task
from rljax.envs.calculator import CalculatorEnv
from rljax.envs.sandbox import audit_hook_refusal, run_python, sandbox_isolation
from rljax.envs.sandbox_limits import ISOLATIONS, SandboxLimits, SandboxResult
from rljax.envs.tokenizer import CALL_CLOSE, CALL_OPEN, OBS_CLOSE, OBS_OPEN

# Tight limits for one-line arithmetic programs: the sandbox's defaults allow 10 s of wall
# time, and a step must answer well within the rollout's step timeout (10 s) even when
# every sample of a batch waits for a sandbox.
DEFAULT_LIMITS = dict(cpu_s=1.0, wall_s=3.0, memory_bytes=256 * 1024 * 1024,
                      output_bytes=4096, max_processes=8, max_open_files=32,
                      max_file_bytes=1024 * 1024, disk_bytes=4 * 1024 * 1024)
_SPACE = re.compile(r"\s+")
AUDIT_HOOK_WARNING = (
    "python_tool runs model-written code in the audit_hook fallback (chosen by name): no "
    "namespaces, so it does not contain reads of host files other users may read or of "
    "the host's /proc (no pid namespace), writes outside its directory on a kernel "
    "without Landlock, disk use between the host's 50 ms polls, or a setsid() leftover "
    "of a non-root host; it does contain sockets and signals to other processes "
    "(seccomp), root (the program runs as a uid of its own) and the process limit")


def program_of(task: Task) -> str:
  """The program a demonstration writes for `task`."""
  return f"print({task.data['expression']})"


class PythonToolEnv(CalculatorEnv):
  name = "python_tool"

  def __init__(self, *, min_digits: int = 3, max_digits: int = 3, max_obs_tokens: int = 24,
               limits: SandboxLimits | Mapping[str, Any] | None = None,
               isolation: str = "auto", interpreter: str | None = None,
               max_concurrent: int = 0, sandbox: Mapping[str, Any] | None = None,
               **kwargs):
    super().__init__(min_digits=min_digits, max_digits=max_digits, **kwargs)
    if max_obs_tokens < 8:
      raise ValueError(f"max_obs_tokens must be >= 8, got {max_obs_tokens}")
    if isinstance(limits, SandboxLimits):
      self.limits = limits
    else:
      self.limits = SandboxLimits(**(DEFAULT_LIMITS | dict(limits or {})))
    if isinstance(sandbox, Mapping):
      isolation = sandbox.get("isolation", isolation)
      unknown = set(sandbox) - {"isolation"}
      if unknown:
        raise ValueError(f"unknown sandbox settings {sorted(unknown)} (known: isolation)")
    if isolation not in ISOLATIONS:
      raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, not {isolation!r}")
    if isolation == "auto":  # fail closed: the fallback only by name
      found = sandbox_isolation(interpreter)
      if found.mode != "namespaces":
        also = (f" (refused here too: {found.fallback_refused})"
                if found.fallback_refused else "")
        raise ValueError(
            f"the sandbox's namespaces are unavailable here ({found.reason}); python_tool "
            "refuses to run model code without them unless the config chooses the weaker "
            f"fallback by name: env.sandbox.isolation = 'audit_hook'{also}")
    elif isolation == "audit_hook":
      refused = audit_hook_refusal()  # fail closed: no uid of its own, no Landlock
      if refused:
        raise ValueError("python_tool refuses to run model code in the fallback chosen "
                         f"by env.sandbox.isolation = 'audit_hook' here: {refused}")
      logging.warning(AUDIT_HOOK_WARNING)
    self.max_obs_tokens, self.isolation, self.interpreter = max_obs_tokens, isolation, interpreter
    self.max_concurrent = max_concurrent or 2 * (os.cpu_count() or 1)
    self._slots = threading.BoundedSemaphore(self.max_concurrent)
    tok = self.tokenizer
    self._dropped = set(tok.stop_ids) | {tok.token_to_id(m) for m in (
        CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE)} | {tok.bos_id, tok.pad_id}
    self._stats_lock = threading.Lock()
    self.stats = {"calls": 0, "seconds": 0.0, "errors": 0, "infra_errors": 0}

  # ------------------------------------------------------------------------ the tool

  def run(self, code: str) -> SandboxResult:
    """The program in a fresh sandbox (at most max_concurrent at once)."""
    with self._slots:
      t0 = time.perf_counter()
      result = run_python(code, self.limits, isolation=self.isolation,
                          interpreter=self.interpreter)
      seconds = time.perf_counter() - t0
    with self._stats_lock:
      self.stats["calls"] += 1
      self.stats["seconds"] += seconds
      self.stats["errors"] += result.status not in ("ok", "infra_error")
      self.stats["infra_errors"] += result.status == "infra_error"
    return result

  @staticmethod
  def observation_text(result: SandboxResult) -> str:
    """What the policy is told about a program that ran (see the module docstring)."""
    if result.status == "ok":
      return result.stdout
    if result.status == "error":
      lines = [line for line in result.stderr.splitlines() if line.strip()]
      return f"error: {lines[-1] if lines else result.detail}"
    return f"{result.status.replace('_', ' ')}: {result.detail}"

  def _encodable(self, text: str) -> str:
    """text, or (when the tokenizer cannot encode it) each char that it can encode, as
    it is or lowercased; the others dropped."""
    try:
      self.tokenizer.encode(text)
      return text
    except ValueError:
      pass
    kept = []
    for ch in text:
      for candidate in (ch, ch.lower()):
        try:
          self.tokenizer.encode(candidate)
        except ValueError:
          continue
        kept.append(candidate)
        break
    return "".join(kept)

  def _observation_ids(self, text: str) -> np.ndarray:
    """<obs>text</obs> as ids: one line, at most max_obs_tokens between the markers, no
    id that changes the episode's structure."""
    tok = self.tokenizer
    text = _SPACE.sub(" ", self._encodable(_SPACE.sub(" ", text))).strip()
    ids = [i for i in tok.encode(text) if i not in self._dropped]
    if len(ids) > self.max_obs_tokens:
      more = list(tok.encode("..."))
      ids = ids[:self.max_obs_tokens - len(more)] + more
    return np.concatenate([tok.encode(OBS_OPEN), np.asarray(ids, np.int32),
                           tok.encode(OBS_CLOSE)]).astype(np.int32)

  # ------------------------------------------------------------------------- the env

  # `step` is CalculatorEnv's (the turn protocol); a call's answer runs the program

  def _malformed_call(self) -> StepResult:
    return StepResult(self._observation_ids("error: call not opened"), False,
                      info={"tool_calls": 1, "tool_errors": 1})

  def _answer_call(self, code: str) -> StepResult:
    result = self.run(code)
    if result.infra_error is not None:  # the sandbox failed, not the program
      return StepResult(None, True, error=f"sandbox: {result.infra_error}",
                        info={"tool_calls": 1, "tool_errors": 0})
    return StepResult(self._observation_ids(self.observation_text(result)), False,
                      info={"tool_calls": 1, "tool_errors": int(not result.ok)})

  def sft_target(self, task: Task) -> SFTTarget:
    """One program that prints the expression, its output (loss_mask 0; what the sandbox
    prints, computed here: SFT batches run no sandbox), then the answer."""
    tok = self.tokenizer
    call = tok.encode(f"{CALL_OPEN}{program_of(task)}{CALL_CLOSE}")
    obs = self._observation_ids(f"{task.data['result']}\n")
    answer = np.concatenate([tok.encode(task.answer), [tok.eos_id]])
    ids = np.concatenate([call, obs, answer]).astype(np.int32)
    mask = np.concatenate([np.ones(len(call)), np.zeros(len(obs)), np.ones(len(answer))])
    return SFTTarget(ids, mask.astype(bool))
