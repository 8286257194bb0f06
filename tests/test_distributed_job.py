"""rljax.distributed's guards for a job of several processes, each test a two-process job
of tests/distributed_worker.py on 127.0.0.1 (2 CPU devices each): a process that arrives
late at a program's first run, and a process that raises."""

import pathlib
import sys

from tests.process_group import exit_codes, free_port, run_together

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
WORKER = HERE.parent / "distributed_worker.py"


def _commands(mode: str) -> list[list[str]]:
  port = free_port()
  return [[sys.executable, str(WORKER), str(port), str(i), mode] for i in range(2)]


def test_a_process_35_s_late_at_a_reduce_scatter_started_together_still_runs_it(tmp_path):
  # unwrapped, the early process fails after 30 s ("Gloo ReduceScatter failed ... Read
  # timeout") and the late one with it ("Connection closed by peer")
  results = run_together(_commands("late"), timeout_s=240, logs=tmp_path, cwd=str(REPO))
  # 32 ones over 4 devices, 8 each, summed over the 4: each device keeps 2 elements of 4.0
  assert [r["sum"] for r in results] == [32.0, 32.0]


def test_a_process_that_raises_ends_the_job_instead_of_hanging_it(tmp_path):
  # before: process 1 waited in JAX's 300 s shutdown barrier, heartbeating, while process 0
  # waited for it in the all-gather, which has no timeout: the job hung for minutes
  codes = exit_codes(_commands("raises"), timeout_s=120, logs=tmp_path, cwd=str(REPO))
  assert codes[0] != 0 and codes[1] == 1, codes
  err1 = (tmp_path / "process1.err").read_text()
  assert "RuntimeError: process 1 fails here" in err1, err1[-3000:]
  assert "unreachable" not in (tmp_path / "process0.out").read_text()
