"""What a benchmark's numbers depend on besides the code: the CPU and how busy it was.

Timings from two CPU families differ by 2-3x here (AVX-512/AMX vs AVX2) and a loaded
machine slows everything, so every bench puts `machine()` into its last-line JSON.
"""

import os
import platform


def cpu_model() -> str:
  """`lscpu`'s model name, read from /proc/cpuinfo (Linux); platform's string elsewhere."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict:
  """CPU model, cores this process may use, and load averages (1, 5, 15 min) now."""
  cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"cpu_model": cpu_model(), "cpus": cpus,
          "loadavg": [round(x, 2) for x in os.getloadavg()]}
