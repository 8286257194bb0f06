"""tests/time_budget.py: the run's wall time and each test's time against the budget."""

import os
import pathlib
import subprocess
import sys

from tests.time_budget import BUDGET, over_budget

TESTS = pathlib.Path(__file__).resolve().parent


def test_over_budget_names_the_run_and_each_slow_test():
  budget = {"suite_s": 100.0, "test_s": 10.0}
  assert over_budget({"a": 9.9, "b": 10.0}, 100.0, budget) == []
  assert over_budget({"a": 12.0, "b": 30.5, "c": 1.0}, 101.0, budget) == [
      "the run took 101 s, over 100 s", "b took 30.5 s, over 10 s", "a took 12.0 s, over 10 s"]
  assert BUDGET == {"suite_s": 1200.0, "test_s": 60.0} or "RLJAX_SUITE_BUDGET_S" in os.environ


def _run(tmp_path, **env):
  (tmp_path / "conftest.py").write_text(
      f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
      "from time_budget import (pytest_runtest_logreport, pytest_sessionfinish,\n"
      "                         pytest_sessionstart, pytest_terminal_summary)\n")
  (tmp_path / "test_slow.py").write_text(
      "import time\n\ndef test_fast():\n  pass\n\ndef test_slow():\n  time.sleep(0.3)\n")
  environ = {k: v for k, v in os.environ.items() if not k.startswith("RLJAX_")} | env
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "no:xdist", str(tmp_path)], cwd=tmp_path, env=environ,
                        capture_output=True, text=True, timeout=120)


def test_a_run_over_budget_fails_when_enforced_and_is_reported_otherwise(tmp_path):
  reported = _run(tmp_path, RLJAX_TEST_BUDGET_S="0.2")
  assert reported.returncode == 0, reported.stdout
  assert "OVER BUDGET: test_slow.py::test_slow took 0.3 s, over 0 s" in reported.stdout
  assert "test_fast" not in reported.stdout.split("OVER BUDGET")[-1]
  assert "slowest 10" in reported.stdout
  enforced = _run(tmp_path, RLJAX_TEST_BUDGET_S="0.2", RLJAX_TEST_BUDGET="enforce")
  assert enforced.returncode == 1, enforced.stdout
  assert "FAIL: test_slow.py::test_slow took 0.3 s" in enforced.stdout
  within = _run(tmp_path, RLJAX_TEST_BUDGET="enforce")
  assert within.returncode == 0 and "OVER BUDGET" not in within.stdout + within.stderr
  assert "FAIL:" not in within.stdout
