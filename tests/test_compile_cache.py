"""The entry points' persistent compilation cache (rljax.compile_cache): a second process
loads what the first compiled; the environment's cache wins; empty turns it off; local
rollout hosts get the trainer's --compile_cache_dir."""

import json
import os
import subprocess
import sys

from rljax.pipeline.launch import host_args

# one process: enable the cache at argv[1] (or not), compile one program, report cache hits
PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from rljax import compile_cache
hits = []
monitoring.register_event_listener(
    lambda name, **_: hits.append(name) if name.endswith("/cache_hits") else None)
where = compile_cache.enable(sys.argv[1])
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))))
print(json.dumps({"dir": where, "hits": len(hits)}))
"""


def _run(directory, env_cache=None):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # this small program too
  if env_cache:
    env["JAX_COMPILATION_CACHE_DIR"] = env_cache
  out = subprocess.run([sys.executable, "-c", PROGRAM, directory], env=env, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  cache = str(tmp_path / "xla")
  assert _run(cache) == {"dir": cache, "hits": 0}
  assert os.listdir(cache)
  second = _run(cache)
  assert second["dir"] == cache and second["hits"] > 0  # every program of the first run
  # the environment's cache (the test suite's) is kept; empty turns the cache off
  other = str(tmp_path / "env")
  assert _run(cache, env_cache=other)["dir"] == other and os.listdir(other)
  assert _run("") == {"dir": None, "hits": 0}


def test_local_hosts_get_the_trainers_config_and_cache_flags():
  argv = ["pipeline.py", "--config=configs/arith_tiny.py", "--config.seed", "3",
          "--compile_cache_dir=/c", "--workdir=/w", "--hosts=2"]
  assert host_args(argv) == ["--config=configs/arith_tiny.py", "--config.seed=3",
                             "--compile_cache_dir=/c"]
