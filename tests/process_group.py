"""Runs the processes of one jax.distributed job to the end and returns the JSON object
each printed last.

Each process writes stdout and stderr to its own file, never to a pipe: a pipe is read
only when the test waits on that process, so the other could block on a full one while the
test waits. All processes share one deadline, and a failure reports every process's stderr
(the one that failed first may only say that its peer died). A process still running at
the deadline first writes every thread's Python stack to its stderr (faulthandler, on
SIGABRT), so a hang in CI says where it waited."""

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_together(commands: list[list[str]], timeout_s: float, logs: pathlib.Path | None = None,
                 **popen_kwargs) -> list[dict]:
  """Starts every command at once, waits for all (one deadline for the group), and returns
  the JSON object each printed last. A process that fails or outlives the deadline fails
  the call with every process's stderr tail; the others are then killed, since they would
  wait for it in a collective. Logs go to `logs` (a fresh temporary folder if None)."""
  with _started(commands, logs, popen_kwargs) as (procs, logs):
    _wait(procs, logs, timeout_s, fail_fast=True)
    return [last_json((logs / f"process{i}.out").read_text()) for i in range(len(procs))]


def exit_codes(commands: list[list[str]], timeout_s: float, logs: pathlib.Path | None = None,
               **popen_kwargs) -> list[int]:
  """Like `run_together`, but a process that fails does not end the wait: returns every
  process's exit code once all have exited. One still running at the deadline fails the
  call (the group hung)."""
  with _started(commands, logs, popen_kwargs) as (procs, logs):
    _wait(procs, logs, timeout_s, fail_fast=False)
    return [p.returncode for p in procs]


@contextlib.contextmanager
def _started(commands: list[list[str]], logs: pathlib.Path | None, popen_kwargs: dict):
  logs = pathlib.Path(logs or tempfile.mkdtemp(prefix="process_group_"))
  logs.mkdir(parents=True, exist_ok=True)
  popen_kwargs["env"] = {**popen_kwargs.get("env", os.environ), "PYTHONFAULTHANDLER": "1"}
  procs, files = [], []
  try:
    for i, command in enumerate(commands):
      out = open(logs / f"process{i}.out", "w+", encoding="utf-8")
      err = open(logs / f"process{i}.err", "w+", encoding="utf-8")
      files.append((out, err))
      procs.append(subprocess.Popen(command, stdout=out, stderr=err, text=True,
                                    **popen_kwargs))
    yield procs, logs
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for out, err in files:
      out.close()
      err.close()


def _wait(procs: list[subprocess.Popen], logs: pathlib.Path, timeout_s: float, *,
          fail_fast: bool) -> None:
  deadline = time.monotonic() + timeout_s
  while any(p.poll() is None for p in procs):
    failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    if (failed and fail_fast) or time.monotonic() > deadline:
      late = time.monotonic() > deadline
      i = next(i for i, p in enumerate(procs) if p.poll() is None) if late else failed[0]
      why = f"still running after {timeout_s} s" if late else f"exited {procs[i].returncode}"
      if late:
        dump_stacks(procs)
      raise AssertionError(f"process {i} {why}\n{_tails(logs, len(procs))}")
    time.sleep(0.2)
  if fail_fast:
    for i, p in enumerate(procs):
      assert p.returncode == 0, f"process {i} exited {p.returncode}\n{_tails(logs, len(procs))}"


def dump_stacks(procs: list[subprocess.Popen], wait_s: float = 10.0) -> None:
  """Every process still running writes its threads' Python stacks to its stderr and
  exits: SIGABRT, which faulthandler (PYTHONFAULTHANDLER=1) answers before the default
  action. For the report of a process that outlived its deadline."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    p.send_signal(signal.SIGABRT)
  for p in alive:
    try:
      p.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
      pass


def last_json(stdout: str) -> dict:
  """The last line of `stdout` that is a JSON object: native libraries write to the same
  stdout (Gloo reports its connections, from its own threads, even after the process's
  last print)."""
  for line in reversed(stdout.splitlines()):
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        continue
  raise AssertionError(f"no JSON object in the process's stdout:\n{stdout[-3000:]}")


def _tails(logs: pathlib.Path, count: int, chars: int = 3000) -> str:
  """Every process's stderr tail: the one that failed may only report the other's death."""
  return "\n".join(f"--- process {i} stderr:\n"
                   + (logs / f"process{i}.err").read_text(errors="replace")[-chars:]
                   for i in range(count))
