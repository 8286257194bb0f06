"""The host side of one sandboxed run (rljax.envs.sandbox.run_python): the launcher process,
its pipes, its kills, and the result, each end attributed to the host or the program.

Processes. `run_python` starts `python -I -S sandbox_launcher.py --launch CONFIG` (the
sandbox's inside, beside this file: a script, stdlib only) in a session and process group
of its own, with a minimal
environment (PATH, LANG, HOME = TMPDIR = the working directory) and only stdin, stdout,
stderr and a status pipe open. That launcher (P0) sets up the isolation, forks a
supervisor (P1) that forks the program (P2); P2 sets its rlimits, drops its privileges,
sets no_new_privs, a parent-death SIGKILL, its Landlock ruleset and seccomp filter
(rljax.envs.sandbox), then execs a fresh `python -I -S -u` (namespaces: the interpreter's real
path, symlinks resolved; no site, no user site, no PYTHON* variables, no script
directory on sys.path) that runs
`main.py` from the working directory (`exit` / `quit` are sys.exit; tracebacks start at
main.py). P1 reaps P2 and reports its wait status and rusage on the status pipe, so
exit codes and signals are the program's own. At `wall_s`, or as soon as stdout or stderr
passes `output_bytes` (the host reads both incrementally and never holds more than that
plus one 64 KiB chunk), the host SIGKILLs the whole process group; with namespaces that
kills P1, the pid namespace's init, and the kernel then kills every process in the
namespace, including ones that left the group with setsid().
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import time

from rljax.envs.sandbox_limits import TRUNCATED, KiB, SandboxLimits, SandboxResult

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
_UID_BASE = 1_600_000_000  # a root host runs each program as _UID_BASE + launcher pid
_PATH = "/usr/local/bin:/usr/bin:/bin"
_CHUNK = 64 * KiB
_KILL_GRACE_S = 5.0  # after a kill, how long to wait for the pipes to close
_EXIT_GRACE_S = 1.0  # after the launcher exited, how long a leftover may hold a pipe


def _infra(error: str, wall_s: float, mode: str, stdout: str = "",
           stderr: str = "") -> SandboxResult:
  return SandboxResult("infra_error", stdout, stderr, None, None, wall_s, None, None,
                       "the sandbox failed", mode, error)


def _remove_tree(path: str) -> None:
  """Removes the working directory even where the program took its permissions away."""
  def retry(fn, p, _):
    try:
      os.chmod(os.path.dirname(p), 0o700)
      os.chmod(p, 0o700)
      fn(p)
    except OSError:
      pass
  shutil.rmtree(path, onerror=retry)


def _kill_uid(uid: int) -> None:
  """SIGKILLs every process of uid (a program's own uid: audit-hook mode as root), by
  kill(-1) from a process of that uid, until none is left."""
  for _ in range(10):
    live = _live_tasks_of(uid)
    if not live:
      return
    try:
      subprocess.run(["kill", "-KILL", "--", "-1"], user=uid, group=uid, extra_groups=[],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                     env={"PATH": _PATH}, timeout=5)
    except (OSError, subprocess.SubprocessError):  # no kill(1): one pid at a time
      for pid in live:
        try:
          os.kill(pid, signal.SIGKILL)
        except OSError:
          pass


def _live_tasks_of(uid: int) -> list[int]:
  """The pids of uid's processes that are not zombies."""
  pids = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
        pids.append(int(pid))
    except (OSError, ValueError, KeyError):
      continue
  return pids


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _run(code: str, limits: SandboxLimits, stdin: str, interpreter: str, mode: str,
         work: str) -> SandboxResult:
  work = os.path.realpath(work)
  with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
    f.write(code)
  config = {"mode": mode, "work": work, "limits": dataclasses.asdict(limits),
            "uid_base": _UID_BASE}
  env = {"PATH": _PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
  status_r, status_w = os.pipe()
  config["status_fd"] = status_w
  argv = [interpreter, "-I", "-S", _LAUNCHER, "--launch", json.dumps(config)]
  start = time.monotonic()
  try:
    try:
      proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, cwd=work,
                              pass_fds=(status_w,), start_new_session=True)
    finally:
      os.close(status_w)
  except OSError as e:
    os.close(status_r)
    return _infra(f"could not start the interpreter {interpreter!r}: {e}",
                  time.monotonic() - start, mode)
  try:
    # audit_hook mode has no tmpfs of disk_bytes: the host measures the directory instead
    disk = (lambda: _disk_use(work, limits.disk_bytes)) if mode == "audit_hook" else None
    out, err, status, killed_for = _communicate(proc, status_r, stdin.encode(), limits, start,
                                                disk)
    if disk is not None and killed_for is None and disk():
      killed_for = "disk_limit"  # over it at the end: written between two polls
  finally:
    # whatever is left of the group goes; the launcher is reaped only now, so until here
    # its pid (the group's id, and the program's uid's offset) cannot name anything else
    _kill_group(proc.pid)
    if mode == "audit_hook" and os.geteuid() == 0:
      _kill_uid(_UID_BASE + proc.pid)  # no pid namespace: leftovers that left the group
    proc.wait()
  wall_s = time.monotonic() - start
  return _result(out, err, status, killed_for, limits, wall_s, mode, proc.returncode)


def _exited(pid: int) -> bool:
  """Whether the child has exited, without reaping it (its pid stays reserved)."""
  try:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:
    return True


_DISK_POLL_S = 0.05
_MAX_ENTRIES = 4096  # audit_hook mode: files and directories the program may create


def _disk_use(root: str, cap: int) -> bool:
  """Whether the tree at root passed cap bytes (allocated blocks) or _MAX_ENTRIES entries;
  stops counting as soon as it did."""
  used, entries, stack = 0, 0, [root]
  while stack:
    try:
      with os.scandir(stack.pop()) as it:
        for entry in it:
          entries += 1
          try:
            st = entry.stat(follow_symlinks=False)
          except OSError:
            continue
          used += st.st_blocks * 512
          if entry.is_dir(follow_symlinks=False):
            stack.append(entry.path)
          if used > cap or entries > _MAX_ENTRIES:
            return True
    except OSError:
      continue
  return False


def _communicate(proc: subprocess.Popen, status_fd: int, stdin: bytes, limits: SandboxLimits,
                 start: float, disk_over=None) -> tuple[bytes, bytes, bytes, str | None]:
  """Feeds stdin and reads stdout, stderr and the status pipe until all three close;
  kills the process group at the wall deadline or when an output stream passes its cap.
  Returns (stdout head, stderr head, status bytes, None | "timeout" | "output_limit"); a
  stream's head is longer than output_bytes exactly when the program wrote more."""
  out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
  bufs = {out_fd: bytearray(), err_fd: bytearray(), status_fd: bytearray()}
  caps = {out_fd: limits.output_bytes + 1, err_fd: limits.output_bytes + 1,
          status_fd: 64 * KiB}
  killed_for, stop_at, launcher_done = None, start + limits.wall_s, False
  next_disk = 0.0
  sel = selectors.DefaultSelector()
  try:
    for fd in bufs:
      sel.register(fd, selectors.EVENT_READ)
    if stdin:
      os.set_blocking(in_fd, False)
      sel.register(in_fd, selectors.EVENT_WRITE)
    else:
      proc.stdin.close()
    sent = 0
    while sel.get_map():
      if not launcher_done and _exited(proc.pid):
        launcher_done = True  # the program was reaped: EOFs are due now
        stop_at = min(stop_at, time.monotonic() + _EXIT_GRACE_S)
      timeout = stop_at - time.monotonic()
      if timeout <= 0:
        if killed_for is not None or launcher_done:
          break  # a leftover (or a process that ignored the kill) holds a pipe: stop
        killed_for = "timeout"
        _kill_group(proc.pid)
        stop_at = time.monotonic() + _KILL_GRACE_S
        continue
      if disk_over is not None and killed_for is None and time.monotonic() >= next_disk:
        next_disk = time.monotonic() + _DISK_POLL_S
        over = disk_over()
      else:
        over = False
      if over:
        killed_for = "disk_limit"
        _kill_group(proc.pid)
        stop_at = time.monotonic() + _KILL_GRACE_S
        continue
      poll = _DISK_POLL_S if disk_over is not None and killed_for is None else 0.25
      for key, _ in sel.select(min(timeout, poll)):
        fd = key.fd
        if fd == in_fd:
          try:
            sent += os.write(fd, stdin[sent:sent + _CHUNK])
          except (BlockingIOError, InterruptedError):
            continue
          except OSError:  # the program closed its stdin
            sent = len(stdin)
          if sent >= len(stdin):
            sel.unregister(fd)
            proc.stdin.close()
          continue
        chunk = os.read(fd, _CHUNK)
        if not chunk:
          sel.unregister(fd)
          continue
        buf = bufs[fd]
        if len(buf) < caps[fd]:
          buf += chunk[:caps[fd] - len(buf)]
        if fd != status_fd and len(buf) > limits.output_bytes and killed_for is None:
          killed_for = "output_limit"
          _kill_group(proc.pid)
          stop_at = time.monotonic() + _KILL_GRACE_S
  finally:
    sel.close()
    if not proc.stdin.closed:
      try:
        proc.stdin.close()
      except OSError:
        pass
    os.close(status_fd)
  return bytes(bufs[out_fd]), bytes(bufs[err_fd]), bytes(bufs[status_fd]), killed_for


def _text(raw: bytes, cap: int) -> str:
  text = raw[:cap].decode("utf-8", "replace")
  return text + TRUNCATED.format(n=cap) if len(raw) > cap else text


def _last_line(text: str) -> str:
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return lines[-1] if lines else ""


def _result(out: bytes, err: bytes, status_bytes: bytes, killed_for: str | None,
            limits: SandboxLimits, wall_s: float, mode: str,
            launcher_code: int | None) -> SandboxResult:
  stdout, stderr = _text(out, limits.output_bytes), _text(err, limits.output_bytes)
  reports = {}
  for line in status_bytes.decode("utf-8", "replace").splitlines():
    try:
      message = json.loads(line)
    except ValueError:
      continue
    if isinstance(message, dict):
      for k, v in message.items():
        reports.setdefault(k, v)
  if "setup_error" in reports:
    return _infra(f"sandbox setup failed: {reports['setup_error']}", wall_s, mode,
                  stdout, stderr)
  cpu_s, rss = reports.get("cpu_s"), reports.get("max_rss_bytes")

  def result(status, exit_code, sig, detail):
    return SandboxResult(status, stdout, stderr, exit_code, sig, wall_s, cpu_s, rss, detail,
                         mode)

  if killed_for == "output_limit":
    which = "stdout" if len(out) > limits.output_bytes else "stderr"
    return result("output_limit", None, signal.SIGKILL,
                  f"killed: {which} passed {limits.output_bytes} bytes")
  if killed_for == "disk_limit":
    return result("disk_limit", None, signal.SIGKILL,
                  f"killed: its files passed {limits.disk_bytes} bytes or {_MAX_ENTRIES} entries")
  if killed_for == "timeout" and "started" not in reports:
    return _infra(f"the sandbox did not start the program within {limits.wall_s:g} s",
                  wall_s, mode, stdout, stderr)
  if killed_for == "timeout":
    return result("timeout", None, signal.SIGKILL,
                  f"killed after {limits.wall_s:g} s of wall time")
  if "wait_status" not in reports and "started" not in reports:
    return _infra("the launcher ended before starting the program "
                  f"(launcher exit code {launcher_code})", wall_s, mode, stdout, stderr)
  if "wait_status" not in reports:
    # the supervisor reported the program started, then ended without its status: nothing
    # of the host's runs there after that report but wait4 and one write, so the program
    # ended it (a signal to its group or its supervisor): the program's failure
    return result("error", None, None, "the program ended its own supervisor "
                  f"(no status reported; launcher exit code {launcher_code})")
  wait_status, cpu_limit = reports["wait_status"], math.ceil(limits.cpu_s)
  if os.WIFSIGNALED(wait_status):
    sig = os.WTERMSIG(wait_status)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (cpu_s or 0.0) >= cpu_limit - 0.05):
      return result("cpu_limit", None, sig, f"killed after {cpu_limit} s of CPU time")
    try:
      name = signal.Signals(sig).name
    except ValueError:
      name = f"signal {sig}"
    return result("error", None, sig, f"killed by {name}")
  code = os.WEXITSTATUS(wait_status)
  if code == 0:
    return result("ok", 0, None, "exit code 0")
  if _last_line(stderr).startswith("MemoryError"):
    return result("memory_limit", code, None,
                  f"MemoryError: more than {limits.memory_bytes} bytes of address space")
  return result("error", code, None, f"exit code {code}")
