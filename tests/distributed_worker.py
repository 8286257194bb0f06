"""One process of a two-process jax.distributed job on 127.0.0.1 (2 CPU devices each), for
tests/test_distributed_job.py:

  python tests/distributed_worker.py PORT PROCESS_ID late     process 1 arrives 35 s late
      at a reduce-scatter's first run, the program wrapped by `started_together`
  python tests/distributed_worker.py PORT PROCESS_ID raises   process 1 raises while
      process 0 waits for it in an all-gather
  python tests/distributed_worker.py PORT PROCESS_ID cached   runs the reduce-scatter with
      the persistent compilation cache of JAX_COMPILATION_CACHE_DIR, counting cache hits

Prints one JSON object last.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import monitoring  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from rljax import distributed  # noqa: E402

LATE_S = 35  # past Gloo's 30 s


def reduce_scatter(mesh):
  """A jitted reduce-scatter over every device of the job: Gloo fails it when the
  processes arrive more than 30 s apart."""
  return jax.jit(jax.shard_map(lambda a: jax.lax.psum_scatter(a, "x", tiled=True), mesh=mesh,
                               in_specs=P("x"), out_specs=P("x")))


def main(port: str, process_id: int, mode: str) -> None:
  distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                         local_device_count=2, heartbeat_s=10)
  hits = []
  monitoring.register_event_listener(
      lambda name, **_: hits.append(name) if name.endswith("/cache_hits") else None)
  mesh = Mesh(np.array(jax.devices()), ("x",))
  warm = multihost_utils.process_allgather(np.full(3, process_id))  # both joined, Gloo up
  if mode == "late":
    step = distributed.started_together(reduce_scatter(mesh), "late step", mesh)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                               np.ones(16, np.float32))
    if process_id == 1:
      time.sleep(LATE_S)
    total = float(multihost_utils.process_allgather(step(x), tiled=True).sum())
    print(json.dumps({"process": process_id, "sum": total}), flush=True)
  elif mode == "cached":
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                               np.ones(16, np.float32))
    total = float(multihost_utils.process_allgather(reduce_scatter(mesh)(x), tiled=True).sum())
    print(json.dumps({"process": process_id, "sum": total, "hits": len(hits)}), flush=True)
  elif mode == "raises":
    if process_id == 1:
      raise RuntimeError("process 1 fails here")
    print(json.dumps({"process": 0, "waiting": warm.tolist()}), flush=True)
    multihost_utils.process_allgather(np.ones(4))  # process 1 never comes
    print(json.dumps({"process": 0, "unreachable": True}), flush=True)
  else:
    raise ValueError(mode)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
