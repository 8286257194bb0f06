"""Multi-host JAX: `jax.distributed.initialize` from absl flags, once per trainer process.

One trainer process per host (TPU VM worker, GPU node); every process runs the same
program on its local devices, and `jax.devices()` then lists the devices of all of them,
so `config.mesh` spans hosts. Call `initialize_from_flags()` at the top of `main`, before
anything touches a device.

  --coordinator_address=HOST:PORT --num_processes=N --process_id=I   explicit
  --distributed                   JAX's own auto-detection (TPU pod slices, SLURM, Open MPI,
                                  or the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
                                  JAX_PROCESS_ID environment variables)
  (none of them, or --num_processes=1)   single process: nothing is called

`--local_device_count=N` simulates N CPU devices per process (tests, laptops).
`--distributed_timeout_s` (default 300) bounds the wait for the job to assemble: a process
other than 0 first waits that long for the coordinator's port to accept a connection and
fails with an error naming `--coordinator_address` if it never does; then JAX's own
registration gets the same limit (past it, JAX aborts the process with DEADLINE_EXCEEDED).
A process that dies (kill -9, a lost host) stops sending heartbeats; after
`--distributed_heartbeat_s` (default 100) every other process of the job aborts (SIGABRT,
"another task died"), so a job never hangs on a dead peer: restart every process with
`--resume` and the run goes on from its last checkpoint. A process that raises dies the
same way: it prints the traceback and exits at once (`os._exit(1)`), never entering JAX's
shutdown barrier, where it would wait up to 5 minutes while its peers wait for it in a
device collective that has no timeout.

Gloo, XLA:CPU's collectives across processes, fails a reduce-scatter whose processes
arrive more than 30 s apart (hard-coded: it ignores `--xla_cpu_collective_timeout_seconds`),
and a process that compiles a train step more slowly than its peer arrives that much
later; a program's first run sets up its Gloo communicator with the same 30 s limit.
`started_together` wraps such a jitted program: its first call (per argument signature) is
compiled ahead on each process, then all meet at a barrier of the coordination service,
then run it; a train step's every call starts so.

Helpers for the loops that run on several processes (rljax.pipeline.async_loop,
.lockstep): `is_primary` (process 0 writes the single-writer outputs), `check_mesh` (the
trainer's mesh must be every device of the job), `broadcast_bytes` (process 0's bytes to
every process: the plan of each async update; a barrier) and `gather` (a pytree of global
arrays as numpy on every process: a full copy, for checks at small scale).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from typing import Any, Callable, Mapping

from absl import flags, logging
import jax
import numpy as np

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0's coordinator (jax.distributed)")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "trainer processes in the job (one per host); 1/unset = single")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index in [0, N)")
_AUTO = flags.DEFINE_bool(
    "distributed", False, "jax.distributed.initialize() with JAX's cluster auto-detection")
_LOCAL_DEVICES = flags.DEFINE_integer(
    "local_device_count", None, "CPU devices per process (jax_num_cpu_devices; simulation)")
_TIMEOUT_S = flags.DEFINE_float(
    "distributed_timeout_s", 300.0, "seconds to wait for the coordinator and for every "
    "process to join before failing")
_HEARTBEAT_S = flags.DEFINE_integer(
    "distributed_heartbeat_s", 100, "seconds without a heartbeat after which a process "
    "counts as dead and every other process of the job aborts (restart them all with "
    "--resume)")

BARRIER_TIMEOUT_S = 3600  # a peer still compiling (a real model's step: minutes), or writing
_barriers = 0  # barriers met so far: every process meets the same ones in the same order


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               local_device_count: int | None = None, timeout_s: float = 300.0,
               heartbeat_s: int = 100) -> bool:
  """Joins the multi-process job when asked to; returns whether it did.

  A no-op (False) when nothing is given or `num_processes == 1`. Arguments left None are
  filled in by JAX from the environment (cluster auto-detection). A process other than 0
  with an explicit coordinator address raises TimeoutError if the coordinator does not
  accept a connection within `timeout_s`.
  """
  if local_device_count:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  explicit = coordinator_address is not None or process_id is not None or (
      num_processes is not None and num_processes > 1)
  if num_processes == 1 or not (explicit or auto):
    return False
  if coordinator_address is not None and process_id not in (None, 0):
    wait_for_coordinator(coordinator_address, timeout_s)
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=max(1, math.ceil(timeout_s)),
                             heartbeat_timeout_seconds=heartbeat_s)
  sys.excepthook = _exit_at_once(sys.excepthook)
  if jax.default_backend() == "cpu":
    _share_cpu_compile_cache()
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def _share_cpu_compile_cache() -> None:
  """Lets every process of a CPU job load what process 0 wrote to JAX's persistent
  compilation cache. JAX keys an entry by its devices' topology fingerprint, which on CPU
  differs per process (the only part of the key that differs: measured), and only process
  0 writes, so the others never hit and compile every program on every start (a GRPO
  step: 10 s per start of a 2-process test job). On CPU the key takes the global ids and
  kinds of the devices instead, the same in every process of the job. TPU and GPU keep
  JAX's key. It replaces a private JAX function: if that moves, a warning says so and the
  job runs as before (tests/test_distributed_job.py fails)."""
  from jax._src import cache_key  # pylint: disable=g-import-not-at-top

  jax_hash = getattr(cache_key, "_hash_accelerator_config", None)
  if jax_hash is None:
    logging.warning("jax._src.cache_key._hash_accelerator_config is gone: processes other "
                    "than 0 compile every program (they miss process 0's cache entries)")
    return
  if getattr(jax_hash, "rljax_cpu", False):
    return

  def hash_devices(hash_obj, accelerators) -> None:
    devices = list(accelerators.flat)
    if not devices or any(d.platform != "cpu" for d in devices):
      return jax_hash(hash_obj, accelerators)
    for d in devices:
      hash_obj.update(f"{d.id}/{d.process_index}/{d.device_kind};".encode())

  hash_devices.rljax_cpu = True
  cache_key._hash_accelerator_config = hash_devices  # pylint: disable=protected-access


def _exit_at_once(print_exception: Callable) -> Callable:
  """sys.excepthook of a process in a job: prints the exception, then exits without JAX's
  graceful shutdown (its barrier would keep this process alive, heartbeating, while its
  peers wait for it in a collective). Peers blocked in a collective with it see their
  connections close and fail; the rest abort when its heartbeats stop."""
  def hook(kind, value, tb):
    try:
      print_exception(kind, value, tb)
      logging.flush()
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(1)
  return hook


def wait_for_coordinator(address: str, timeout_s: float, retry_s: float = 0.5) -> None:
  """Returns once HOST:PORT accepts a TCP connection; TimeoutError after `timeout_s`."""
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise ValueError(f"--coordinator_address must be HOST:PORT, not {address!r}")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)),
                                    timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        return
    except OSError as e:
      if time.monotonic() + retry_s >= deadline:
        raise TimeoutError(
            f"--coordinator_address {address}: no coordinator answered within "
            f"{timeout_s:g} s ({e}); is process 0 running, and its port reachable from "
            "here? (--distributed_timeout_s sets the wait)") from None
      time.sleep(retry_s)


def initialize_from_flags() -> bool:
  """`initialize` with the absl flags above (call after absl parsed them, in `main`)."""
  return initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                    auto=_AUTO.value, local_device_count=_LOCAL_DEVICES.value,
                    timeout_s=_TIMEOUT_S.value, heartbeat_s=_HEARTBEAT_S.value)


def check_mesh(mesh_shape: Mapping[str, int]) -> None:
  """Under several processes the trainer's mesh must hold every device of the job (a mesh
  of the first devices would leave other processes' devices out of the update)."""
  size = math.prod(int(v) for v in mesh_shape.values())
  if jax.process_count() > 1 and size != jax.device_count():
    raise ValueError(
        f"config.mesh {dict(mesh_shape)} has {size} devices but the {jax.process_count()} "
        f"processes hold {jax.device_count()} ({jax.local_device_count()} here): with several "
        "processes the mesh must span all of them (set --config.mesh.* so the product is "
        f"{jax.device_count()})")


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's `data` on every process (the others pass None). A collective: every
  process calls it, and waits in it until process 0 does. Two broadcasts: the length,
  then the bytes padded to a power of two (few distinct shapes, few compilations)."""
  if jax.process_count() == 1:
    if data is None:
      raise ValueError("process 0 has no data to broadcast")
    return data
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  primary = is_primary()
  if primary and data is None:
    raise ValueError("process 0 has no data to broadcast")
  n = int(multihost_utils.broadcast_one_to_all(
      np.array(len(data) if primary else 0, np.int32)))
  padded = np.zeros(1 << max(n - 1, 0).bit_length(), np.uint8)
  if primary:
    padded[:n] = np.frombuffer(data, np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(padded))[:n].tobytes()


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Every process reaches this point before any goes on: the coordination service's
  barrier, not a device collective (no compiled program, no Gloo). `name` says where, in
  the error of a barrier that times out; every process must meet the same barriers in the
  same order. Nothing to wait for under one process."""
  global _barriers
  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  _barriers += 1
  jax_distributed.global_state.client.wait_at_barrier(f"rljax {_barriers}: {name}",
                                                      int(timeout_s * 1000))


def spans_processes(mesh: jax.sharding.Mesh | None) -> bool:
  """Whether a mesh holds devices of several processes (its programs' collectives cross
  them)."""
  if not isinstance(mesh, jax.sharding.Mesh):  # None, or an AbstractMesh (no devices)
    return False
  return len({d.process_index for d in mesh.devices.flat}) > 1


def started_together(jitted: Callable, name: str, mesh: jax.sharding.Mesh | None, *,
                     every_call: bool = True) -> Callable:
  """`jitted` (a `jax.jit` function on `mesh`) whose calls start on every process at once:
  the first call of each argument signature is compiled ahead of time (the call then finds
  it compiled), every process meets at `barrier`, then all run it; later calls meet there
  too (`every_call`) or just run. So no process reaches a program's collectives 30 s after
  another for having compiled it (or, `every_call`, done its own host work) more slowly.
  Every process must make the same calls in the same order. `jitted` itself when `mesh`
  does not span processes (None, abstract, or one process's devices). `jitted` may also be
  a program compiled ahead of time (`jax.stages.Compiled`): then only the barrier."""
  if not spans_processes(mesh):
    return jitted
  compiled: set = set()
  ahead_of_time = isinstance(jitted, jax.stages.Compiled)

  def call(*args):
    leaves, treedef = jax.tree.flatten(args)
    signature = (treedef, tuple((np.shape(x), np.result_type(x), getattr(x, "sharding", None))
                                for x in leaves))
    first = signature not in compiled
    if first:
      if not ahead_of_time:
        jitted.lower(*args).compile()
      compiled.add(signature)
    if first or every_call:
      barrier(f"{name} starts")
    return jitted(*args)

  if not ahead_of_time:
    call.lower, call.trace = jitted.lower, jitted.trace  # ahead-of-time use (rljax.aot)
  return call


def gather(tree: Any) -> Any:
  """Every leaf of a pytree of (global) arrays as one numpy array, on every process (a
  collective under several processes; a device_get for one)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                      tree)


def is_primary() -> bool:
  """Process 0: the one that writes single-writer outputs (summaries, queue, run/done)."""
  return jax.process_index() == 0
