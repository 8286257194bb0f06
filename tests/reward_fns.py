"""Reward functions for the dataset-env tests, imported by path in verifier worker
processes (kept apart from the test modules so a worker imports nothing heavy)."""

import os
import subprocess
import time


def length_reward(prompt, completion, **fields):
  """1.0 for an answer of the expected length (the row's `n`), else a fraction."""
  del prompt
  return min(len(completion), fields["n"]) / fields["n"]


def echo_fields(prompt, completion, **fields):
  """Raises with everything it was given, so a test can read the call back."""
  raise AssertionError(repr((prompt, completion, sorted(fields.items()))))


def hang_with_a_child(prompt, completion, pid_file, **fields):
  """Starts a child process, writes "<own pid> <child pid>" to pid_file, never returns."""
  del prompt, completion, fields
  child = subprocess.Popen(["sleep", "300"])
  with open(pid_file + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
  os.replace(pid_file + ".tmp", pid_file)
  while True:
    time.sleep(1)


def not_a_number(prompt, completion, **fields):
  del prompt, completion, fields
  return "1.0"


def broken(prompt, completion, kind, **fields):
  """A reward function broken in the way the row's `kind` says: "raise" (a KeyError),
  "string" (returns "1.0"), "nan" (returns NaN); anything else scores 1.0."""
  del prompt, completion
  if kind == "raise":
    return fields["no_such_field"]
  if kind == "string":
    return "1.0"
  if kind == "nan":
    return float("nan")
  return 1.0
