"""rljax.distributed's guards for a job of several processes, each test a two-process job
of tests/distributed_worker.py on 127.0.0.1 (2 CPU devices each): a process that arrives
late at a program's first run, a process that raises, and the compilation cache every
process of a CPU job shares."""

import os
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


def test_every_process_of_a_cpu_job_loads_the_programs_process_0_cached(tmp_path, monkeypatch):
  # JAX keys a cache entry by the devices' topology fingerprint, which on CPU differs per
  # process, and only process 0 writes: before rljax.distributed keyed CPU entries by the
  # global devices, process 1 never hit and compiled every program on every start
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla"))
  first = run_together(_commands("cached"), timeout_s=120, logs=tmp_path / "first",
                       cwd=str(REPO))
  assert first[0]["hits"] == 0 and os.listdir(tmp_path / "xla")
  again = run_together(_commands("cached"), timeout_s=120, logs=tmp_path / "again",
                       cwd=str(REPO))
  assert [r["sum"] for r in first + again] == [32.0] * 4
  assert again[0]["hits"] > 0 and again[1]["hits"] == again[0]["hits"], again
