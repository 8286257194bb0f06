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
"""

from __future__ import annotations

from absl import app, flags, logging
import jax

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0's coordinator (jax.distributed)")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "trainer processes in the job (one per host); 1/unset = single")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index in [0, N)")
_AUTO = flags.DEFINE_bool(
    "distributed", False, "jax.distributed.initialize() with JAX's cluster auto-detection")
_LOCAL_DEVICES = flags.DEFINE_integer(
    "local_device_count", None, "CPU devices per process (jax_num_cpu_devices; simulation)")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               local_device_count: int | None = None) -> bool:
  """Joins the multi-process job when asked to; returns whether it did.

  A no-op (False) when nothing is given or `num_processes == 1`. Arguments left None are
  filled in by JAX from the environment (cluster auto-detection).
  """
  if local_device_count:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  explicit = coordinator_address is not None or process_id is not None or (
      num_processes is not None and num_processes > 1)
  if num_processes == 1 or not (explicit or auto):
    return False
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def initialize_from_flags() -> bool:
  """`initialize` with the absl flags above (call after absl parsed them, in `main`)."""
  return initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                    auto=_AUTO.value, local_device_count=_LOCAL_DEVICES.value)


def require_one_process(why: str) -> None:
  """Stops an entry point that is not wired for several processes yet (absl UsageError)."""
  if jax.process_count() > 1:
    raise app.UsageError(
        f"not multi-process yet: {why}; tests/test_multihost.py runs the multi-process "
        "pieces (sharded GRPO step, per-process stream publishing and orbax checkpoint)")


def is_primary() -> bool:
  """Process 0: the one that writes single-writer outputs (summaries, queue, run/done)."""
  return jax.process_index() == 0
