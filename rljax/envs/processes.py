"""Functions that may hang, run in worker processes that are killed at a deadline.

A thread cannot be killed (`base.call_with_timeout` abandons it); a process can.
`ProcessPool(fn_path, processes=N, timeout_s=T)` keeps up to N workers, each a child
process that imports `fn_path` ("package.module:function") once and then calls it for one
request at a time. `call(*args, **kwargs)` waits for a free worker, sends it the arguments
and waits at most T seconds for the result; past that the worker's process group (the
worker and whatever it started) is killed with SIGKILL, `CallTimeout` (a TimeoutError) is
raised, and a fresh worker takes the slot at its next call. An exception in the function
comes back as `CallFailed` with its type and message (and the worker's traceback:
`error_type`, `remote_traceback`), as does a worker that died.
Arguments and results are pickled. `call` is thread-safe.

A worker is a fresh interpreter (`python -c`, with the caller's sys.path), never a fork of
the caller: JAX's threads do not survive a fork, and unlike multiprocessing's spawn and
forkserver starts it does not re-import the caller's main script. It runs in its own
session (so the kill reaches its children, and a terminal's Ctrl-C does not) and exits
when the caller's end of its socket closes or the caller dies.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from rljax.envs.importing import import_object


class CallTimeout(TimeoutError):
  """No result within the deadline; the worker was killed."""


class CallFailed(RuntimeError):
  """The function raised, could not be imported, or its worker died. `error_type`: the
  function's exception's type name (None otherwise); `remote_traceback`: its traceback as
  the worker formatted it ("" otherwise)."""

  def __init__(self, message: str, *, error_type: str | None = None,
               remote_traceback: str = ""):
    super().__init__(message)
    self.error_type, self.remote_traceback = error_type, remote_traceback


def _describe(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"


def _exit_with_parent(parent_pid: int) -> None:
  """A worker's watchdog: exits the worker when its parent is gone, even mid-call."""
  while os.getppid() == parent_pid:
    time.sleep(1.0)
  os._exit(1)  # pylint: disable=protected-access


def serve(fn_path: str, fd: int, parent_pid: int) -> None:
  """A worker's life (run by `python -c`): import the function, say "ready", then answer
  calls on the socket `fd` until the parent closes it."""
  threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
  conn = Connection(fd)
  try:
    fn = import_object(fn_path)
  except BaseException as e:  # pylint: disable=broad-except
    conn.send(("error", _describe(e)))
    return
  conn.send(("ready", None))
  while True:
    try:
      args, kwargs = conn.recv()
    except (EOFError, OSError):
      return
    try:
      reply = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # pylint: disable=broad-except
      reply = ("raised", (_describe(e), type(e).__name__,
                          "".join(traceback.format_exception(type(e), e, e.__traceback__))))
    try:
      conn.send(reply)
    except Exception as e:  # pylint: disable=broad-except  (an unpicklable result)
      conn.send(("error", f"the result cannot be sent back: {_describe(e)}"))


@dataclasses.dataclass(eq=False)
class _Worker:
  process: subprocess.Popen
  conn: Connection


class ProcessPool:
  """Up to `processes` workers calling `fn_path`; see the module docstring."""

  def __init__(self, fn_path: str, *, processes: int, timeout_s: float,
               start_timeout_s: float = 120.0):
    if processes < 1 or timeout_s <= 0 or start_timeout_s <= 0:
      raise ValueError(f"need processes >= 1 and positive timeouts, got processes={processes}, "
                       f"timeout_s={timeout_s}, start_timeout_s={start_timeout_s}")
    self.fn_path, self.timeout_s, self.start_timeout_s = fn_path, timeout_s, start_timeout_s
    # a free slot holds its idle worker, or None until a call starts one
    self._free: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
    for _ in range(processes):
      self._free.put(None)
    self._live: set[_Worker] = set()
    self._lock = threading.Lock()
    self._closed = False

  @property
  def pids(self) -> list[int]:
    """The live workers' process ids."""
    with self._lock:
      return [w.process.pid for w in self._live]

  def call(self, *args, **kwargs) -> Any:
    """fn(*args, **kwargs) in a worker; raises CallTimeout or CallFailed."""
    worker = self._free.get()
    try:
      if self._closed:
        raise CallFailed("the process pool is closed")
      if worker is None:
        worker = self._start()
      try:
        worker.conn.send((args, kwargs))
        answered = worker.conn.poll(self.timeout_s)
        status, value = worker.conn.recv() if answered else ("timeout", None)
      except (EOFError, OSError):
        status = "died"
      if status in ("timeout", "died"):
        self._kill(worker)
        value, worker = worker.process.returncode, None
    finally:
      self._free.put(worker)
    if status == "timeout":
      raise CallTimeout(f"{self.fn_path} gave no result within {self.timeout_s}s; its worker "
                        "process was killed")
    if status == "died":
      raise CallFailed(f"{self.fn_path}: its worker process died (exit code {value})")
    if status == "error":
      raise CallFailed(f"{self.fn_path} raised {value}")
    if status == "raised":
      message, error_type, remote = value
      raise CallFailed(f"{self.fn_path} raised {message}", error_type=error_type,
                       remote_traceback=remote)
    return value

  def close(self) -> None:
    """Kills every worker; later calls raise CallFailed."""
    self._closed = True
    with self._lock:
      workers = list(self._live)
    for worker in workers:
      self._kill(worker)

  def _start(self) -> _Worker:
    ours, theirs = socket.socketpair()
    code = (f"from rljax.envs.processes import serve; "
            f"serve({self.fn_path!r}, {theirs.fileno()}, {os.getpid()})")
    path = os.pathsep.join(p or os.getcwd() for p in sys.path)
    try:
      process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                 env={**os.environ, "PYTHONPATH": path},
                                 start_new_session=True)
    finally:
      theirs.close()
    worker = _Worker(process, Connection(ours.detach()))
    with self._lock:
      self._live.add(worker)
    try:
      if not worker.conn.poll(self.start_timeout_s):
        raise CallFailed(f"{self.fn_path}: a worker did not start within "
                         f"{self.start_timeout_s}s")
      status, value = worker.conn.recv()
    except EOFError:
      status, value = "error", f"the worker exited with code {process.wait()} on start"
    except CallFailed:
      self._kill(worker)
      raise
    if status != "ready":
      self._kill(worker)
      raise CallFailed(f"{self.fn_path}: {value}")
    return worker

  def _kill(self, worker: _Worker) -> None:
    if worker.process.poll() is None:  # not reaped: its pid still names it and its group
      try:
        os.killpg(worker.process.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        worker.process.kill()
    worker.process.wait()
    worker.conn.close()
    with self._lock:
      self._live.discard(worker)
