"""The suite's time budget, held by the suite itself (pytest hooks, imported by conftest).

Every run ends with the slowest tests (setup + call + teardown of each, across xdist
workers) and the run's wall time against `BUDGET`. With RLJAX_TEST_BUDGET=enforce a run
over budget fails (exit status 1) even when every test passed; otherwise it is reported.
Timing depends on the machine and its load, so no test asserts on it; this is a check of
the whole run, made once, by the process that reports it (the xdist controller).
"""

from __future__ import annotations

import collections
import os
import time

BUDGET = {"suite_s": float(os.environ.get("RLJAX_SUITE_BUDGET_S", 20 * 60)),  # make test, 2 cores
          "test_s": float(os.environ.get("RLJAX_TEST_BUDGET_S", 60))}
SLOWEST = 10
ENFORCE_ENV = "RLJAX_TEST_BUDGET"  # "enforce": over budget fails the run

_seconds: collections.Counter = collections.Counter()  # nodeid -> setup + call + teardown
_start = {"t": None}


def _is_worker(config) -> bool:
  return hasattr(config, "workerinput")


def pytest_sessionstart(session):
  _start["t"] = time.monotonic()


def pytest_runtest_logreport(report):
  _seconds[report.nodeid] += report.duration


def over_budget(seconds: dict[str, float], wall_s: float,
                budget: dict[str, float] = BUDGET) -> list[str]:
  """What broke the budget, one line each (empty: within it)."""
  problems = [f"the run took {wall_s:.0f} s, over {budget['suite_s']:.0f} s"] if (
      wall_s > budget["suite_s"]) else []
  problems += [f"{nodeid} took {s:.1f} s, over {budget['test_s']:.0f} s"
               for nodeid, s in sorted(seconds.items(), key=lambda kv: -kv[1])
               if s > budget["test_s"]]
  return problems


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  if _is_worker(config) or _start["t"] is None or not _seconds:
    return
  wall = time.monotonic() - _start["t"]
  write = terminalreporter.write_line
  terminalreporter.section("time budget")
  write(f"wall {wall:.0f} s (budget {BUDGET['suite_s']:.0f} s); sum of test times "
        f"{sum(_seconds.values()):.0f} s over {len(_seconds)} tests; slowest {SLOWEST} "
        f"(setup + call + teardown, budget {BUDGET['test_s']:.0f} s each):")
  for nodeid, s in _seconds.most_common(SLOWEST):
    write(f"  {s:7.1f} s  {nodeid}")
  problems = over_budget(dict(_seconds), wall)
  enforce = os.environ.get(ENFORCE_ENV) == "enforce"
  for line in problems:
    write(f"{'FAIL' if enforce else 'OVER BUDGET'}: {line}")


def pytest_sessionfinish(session, exitstatus):
  # terminal_summary runs after sessionfinish: decide here, report there
  config = session.config
  if _is_worker(config) or _start["t"] is None or os.environ.get(ENFORCE_ENV) != "enforce":
    return
  if over_budget(dict(_seconds), time.monotonic() - _start["t"]) and exitstatus == 0:
    session.exitstatus = 1
