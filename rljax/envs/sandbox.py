"""A sandboxed Python tool: model-written code in a throwaway process with hard limits.

  result = run_python("print(6 * 7)", SandboxLimits(wall_s=5))
  result.status, result.stdout             # "ok", "42\\n"
  observation = result.as_observation()    # the compact text a policy sees

`run_python(code, limits, stdin)` never raises on anything the code does. The program's
own failures (it raised, exited non-zero, ran out of time, CPU, memory or output, crashed
its interpreter, signalled itself, its group or its supervisor) are observations:
`status` says which, `stdout` / `stderr` (each cut at `output_bytes`, with a marker) and
`detail` say the rest. `infra_error` (status "infra_error", an env's failed step: an
infra_failure episode, kept out of gradients and baselines) is set only for failures the
host proves its own, each with its reason: no working directory (host resources), the
interpreter could not start, the launcher or supervisor reported a setup error (a
namespace, mount, rlimit, uid, seccomp or exec step), the launcher ended before its
supervisor reported "started", the program was not started within wall_s, or "auto"
found no namespaces (refused, below). The supervisor reports "started" just before it
forks the program, so a run that ends after that without the program's wait status was
ended by the program (nothing of the host's runs there but wait4 and one write): it is
status "error", the program's failure. The program cannot write to the status pipe (it
is closed at its exec), so it cannot forge a report.

Processes. `run_python` starts `python -I -S sandbox_launcher.py --launch CONFIG` (the
sandbox's inside, beside this file: a script, stdlib only) in a session and process group
of its own, with a minimal
environment (PATH, LANG, HOME = TMPDIR = the working directory) and only stdin, stdout,
stderr and a status pipe open. That launcher (P0) sets up the isolation, forks a
supervisor (P1) that forks the program (P2); P2 sets its rlimits, drops its privileges,
sets no_new_privs, a parent-death SIGKILL, its Landlock ruleset and seccomp filter
(below), then execs a fresh `python -I -S -u` (namespaces: the interpreter's real
path, symlinks resolved; no site, no user site, no PYTHON* variables, no script
directory on sys.path) that runs
`main.py` from the working directory (`exit` / `quit` are sys.exit; tracebacks start at
main.py). P1 reaps P2 and reports its wait status and rusage on the status pipe, so
exit codes and signals are the program's own. At `wall_s`, or as soon as stdout or stderr
passes `output_bytes` (the host reads both incrementally and never holds more than that
plus one 64 KiB chunk), the host SIGKILLs the whole process group; with namespaces that
kills P1, the pid namespace's init, and the kernel then kills every process in the
namespace, including ones that left the group with setsid().

Limits (rlimits of P2, inherited by whatever it starts; all enforced by the kernel):
  RLIMIT_CPU     cpu_s rounded up to whole seconds: SIGXCPU, and SIGKILL one second later
                 for a program that handles SIGXCPU (status "cpu_limit")
  RLIMIT_AS      memory_bytes of address space per process. RLIMIT_AS, not RLIMIT_DATA:
                 it bounds every mapping (brk, anonymous and file mmaps, thread stacks),
                 so an allocation past it fails at once and Python raises MemoryError
                 (status "memory_limit") instead of the host running short; it counts
                 reserved, not touched, memory, so the limit is generous. It is per
                 process: the total is bounded by max_processes x memory_bytes.
  RLIMIT_FSIZE   min(max_file_bytes, disk_bytes) per file (a write past it: EFBIG)
  RLIMIT_NPROC   max_processes (Linux counts threads too). It is per user, and not
                 enforced at all for root, so the program never runs as root (either
                 mode; P2 refuses to exec as uid 0): on a root host it gets a uid of its
                 own (1,600,000,000 + the launcher's pid, unique among live runs), whose
                 count starts at zero; a fork bomb then fails to fork past the limit, the
                 host's user is not charged, and the wall-time kill ends it. Without
                 root, a user namespace counts the program's processes apart from the
                 host user's.
  RLIMIT_NOFILE  max_open_files;  RLIMIT_CORE 0 (no core dumps)
  disk           namespaces: the working directory is a tmpfs of disk_bytes (ENOSPC past
                 it). audit_hook: RLIMIT_FSIZE is at most disk_bytes, and the host
                 measures the working directory every 50 ms: past disk_bytes of
                 allocated blocks or 4096 entries it kills the run (status
                 "disk_limit"), and measures it once more at the end (a run over it
                 then is "disk_limit" too); the host's disk may hold, for a moment, what
                 the program writes in 50 ms beyond it

Isolation, chosen once per interpreter by `sandbox_isolation()` (a probe run: the
namespace setup either works or is reported as unavailable, with the reason). It fails
closed: `isolation="auto"` runs only with namespaces; where they are unavailable it
refuses (infra_error "refused: ...") and the fallback runs only when a caller names
"audit_hook" (python_tool: `env.sandbox.isolation = "audit_hook"`, with a warning).
Both modes load a seccomp filter into P2 before its exec (`sandbox_seccomp.py`,
libseccomp through ctypes; inherited by every process and thread the program starts):
no AF_UNIX socket() (host unix sockets by path or abstract name; socketpair stays), no
io_uring, ptrace, process_vm_*, pidfd_open/getfd/send_signal, F_SETOWN (SIGIO to a
pid of its choosing), System V / POSIX IPC objects (they outlive the program), new
namespaces or mounts; audit_hook mode also no socket() of any family and no kill/tgkill/rt_sig*queueinfo to a
pid but the program's own (its group, supervisor, -1 included), no tkill. Without
libseccomp the run is an infra_error (so the probe reports namespaces unavailable).
Both modes also restrict P2 by Landlock where the kernel has it (`sandbox_landlock.py`):
write-kind access (write, truncate, create, remove, rename, link) only beneath the
working directory (and /dev/null), however the path is reached (dir_fd, symlinks); with
ABI >= 6 signals and abstract unix sockets scoped to the program's own processes.
  "namespaces"  new mount, network, pid, IPC and UTS namespaces (root: directly, with the
                unique uid above; otherwise inside a new user namespace that maps only
                the host user's own uid, whose capabilities are gone at the exec).
                Network: a fresh network namespace holds only a loopback device that is
                down, so every connect, to 127.0.0.1 included, fails with ENETUNREACH,
                and DNS lookups fail; abstract unix names are per network namespace.
                Host unix sockets at file paths are not network endpoints (a read-only
                mount does not stop connect()): seccomp refuses socket(AF_UNIX), and
                no host socket path exists in the program's root besides (below).
                Files: a minimal root (`sandbox_root.py`). P1 builds a new root on an
                empty tmpfs, pivot_roots into it and detaches the old one, so nothing
                else of the host's filesystem is in the namespace: every other path is
                ENOENT however it is named (`..`, symlinks, /proc/self/root,
                /proc/1/root, /proc/self/cwd, /dev/fd, dir_fd; the host's /proc/<pid>
                is not in the pid namespace). The root holds only: the interpreter at
                its real path; its stdlib directory (os.py's, lib-dynload included),
                with site-packages / dist-packages covered by an empty tmpfs; the
                dynamic loader and the shared libraries the interpreter and the stdlib's
                extension modules need (from their ELF DT_NEEDED / RPATH / RUNPATH,
                transitively, plus libgcc_s), each file bound alone at its path with
                the symlinks on the way (/lib -> usr/lib, say) recreated; the C.UTF-8
                locale (/usr/lib/locale/C.utf8) where the host has it;
                /etc/ld.so.cache only where a library lies outside the loader's default
                directories and the RUNPATHs (else there is no /etc at all); /dev with
                null, zero, full, random, urandom (the host's, bound), fd, stdin,
                stdout, stderr (links into /proc/self/fd) and an empty /dev/shm; /proc,
                mounted anew for the pid namespace (the program is pid 2 and sees only
                its own processes; where the kernel refuses the mount, an empty
                directory, never the host's); and the working directory, a fresh tmpfs
                of disk_bytes owned by the program's uid (its parent, the host's temp
                directory, holds nothing else). No repository, dataset, venv, /home,
                /root (but the directories on the way to an interpreter there), /etc,
                /opt, /var, /srv, /run, /tmp of the host's; no other program (a
                subprocess of anything but the interpreter: FileNotFoundError). With a
                pyenv interpreter under /root, `/` lists dev, lib, lib64, proc, root,
                tmp, usr. Every mount but the working directory is read-only (plus
                nosuid): writes anywhere else fail with EROFS, whatever the program
                does, and the tmpfs disappears with the namespace; episodes see no one
                else's files and nothing persists to the next. The directories the
                root adds on the way are its own (0755), so a unique uid reaches an
                interpreter under /root without anything else there being shown.
  "audit_hook"  the fallback where namespaces are unavailable (a container without
                CAP_SYS_ADMIN or user namespaces), by name only. On a root host the
                program runs as a uid of its own (as above; the working directory is
                chowned to it), so it cannot signal or ptrace host processes, read
                others' private files (other episodes' directories are 0700, each its
                own uid's) or write root's (the stdlib); RLIMIT_NPROC holds; and after
                the run every process of that uid is SIGKILLed (kill -1 as that uid),
                so a setsid() leftover dies too. Its interpreter must be one that other
                users may run: where the given one is not (a Python under /root), the
                system's python of the same version (/usr/bin, /usr/local/bin) runs the
                program, and without one the run is an infra_error naming it. A
                `sys.addaudithook` hook, installed
                by the bootstrap before the program's first line (a hook cannot be
                removed), refuses: sockets other than AF_UNIX, AF_UNIX addresses outside
                the working directory, name lookups; opening for writing, creating,
                removing, renaming, linking, chmod/chown/utime/truncate of paths outside
                the working directory (symlinks resolved); starting programs (exec,
                spawn, system, subprocess, _posixsubprocess), ctypes, gc's object walks,
                and signals to other processes. PEP 578 hooks are not a security
                boundary: this stops ordinary code, not a determined adversary; what
                holds against one is the uid, seccomp and Landlock (writes outside the
                working directory, dir_fd-relative ones included, fail with EACCES;
                on a kernel without Landlock such writes to world-writable host
                directories (/tmp, /dev/shm) are not contained). Not contained: reads
                of world-readable host files and of /proc (no pid namespace); disk use
                only by the host's polling (above). A non-root
                host runs the program as the host's user (RLIMIT_NPROC: that user's
                task count now plus max_processes), seccomp keeping its signals to
                itself.
`run_python(..., isolation=...)` forces either mode (the tests run both).

Reading: namespaces mode shows only its minimal root (above); audit_hook mode reads
wherever the program's uid may (world-readable host files included: documented above).
/dev/shm is empty and read-only in namespaces mode, so multiprocessing's semaphores are
unavailable; /dev/null and friends work.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

KiB, MiB = 1024, 1024 * 1024
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "disk_limit",
            "infra_error")
ISOLATIONS = ("auto", "namespaces", "audit_hook")
TRUNCATED = "\n[... output cut at {n} bytes]"

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
_UID_BASE = 1_600_000_000  # a root host runs each program as _UID_BASE + launcher pid
_PATH = "/usr/local/bin:/usr/bin:/bin"
_CHUNK = 64 * KiB
_KILL_GRACE_S = 5.0  # after a kill, how long to wait for the pipes to close
_EXIT_GRACE_S = 1.0  # after the launcher exited, how long a leftover may hold a pipe


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  cpu_s: float = 5.0  # RLIMIT_CPU (rounded up to whole seconds)
  wall_s: float = 10.0  # the host kills everything at this deadline
  memory_bytes: int = 512 * MiB  # RLIMIT_AS, per process
  output_bytes: int = 64 * KiB  # per stream (stdout, stderr); past it: killed
  max_processes: int = 32  # RLIMIT_NPROC (processes and threads)
  max_open_files: int = 64  # RLIMIT_NOFILE
  max_file_bytes: int = 16 * MiB  # RLIMIT_FSIZE
  disk_bytes: int = 64 * MiB  # the working directory's tmpfs (namespaces only)

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"SandboxLimits.{field.name} must be positive, got "
                         f"{getattr(self, field.name)!r}")
    if self.max_open_files < 16 or self.memory_bytes < 32 * MiB:
      raise ValueError("an interpreter needs max_open_files >= 16 and memory_bytes >= 32 MiB")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  status: str  # one of STATUSES
  stdout: str  # cut at output_bytes (then TRUNCATED is appended)
  stderr: str  # likewise
  exit_code: int | None  # None when a signal ended the program (or it never ran)
  signal: int | None  # the signal that ended it; SIGKILL when the host killed it
  wall_s: float
  cpu_s: float | None  # user + system CPU time of the program (with reaped children)
  max_rss_bytes: int | None
  detail: str  # one line: why this status
  isolation: str  # "namespaces", "audit_hook", or "" when nothing started
  infra_error: str | None = None  # the sandbox's own failure; None when it worked

  @property
  def ok(self) -> bool:
    return self.status == "ok"

  def as_observation(self, max_chars: int = 2000) -> str:
    """What a policy sees: stdout (its head), stderr (its tail: the traceback's last line
    is what matters), and for anything but a clean exit a last line "[status: detail]"."""
    if self.infra_error is not None:
      return "[sandbox unavailable]"
    out, err = self.stdout, self.stderr
    room = max(max_chars - 100, 100)  # the rest is for the status line
    if len(out) + len(err) > room:
      err_room = min(len(err), room // 2)
      if len(out) > room - err_room:
        out = out[:room - err_room] + "\n[...]"
      else:
        err_room = room - len(out)
      if len(err) > err_room:
        err = "[...]\n" + err[-err_room:]
    parts = [out.rstrip("\n")] if out else []
    if err:
      parts.append(err.rstrip("\n"))
    if self.status != "ok":
      parts.append(f"[{self.status}: {self.detail}]")
    elif not parts:
      parts.append("[no output]")
    return "\n".join(parts)


@dataclasses.dataclass(frozen=True)
class Isolation:
  """Which mechanisms `run_python(..., isolation="auto")` uses on this machine."""
  mode: str  # "namespaces" | "audit_hook"
  network: str  # "netns" | "audit_hook"
  filesystem: str  # "read_only_mounts" | "audit_hook"
  processes: str  # "pid_namespace" | "process_group"
  user: str  # "unique_uid" (root host, either mode) | "user_namespace" | "host_uid"
  reason: str = ""  # why namespaces are not used


@functools.lru_cache(maxsize=None)
def sandbox_isolation(interpreter: str | None = None) -> Isolation:
  """Probes once per interpreter: a trivial program under isolation="namespaces"; if it
  runs, namespaces are used, else the audit-hook fallback (with the probe's error)."""
  probe = run_python("pass", SandboxLimits(wall_s=30.0), interpreter=interpreter,
                     isolation="namespaces")
  if probe.status == "ok":
    return Isolation("namespaces", "netns", "read_only_mounts", "pid_namespace",
                     "unique_uid" if os.geteuid() == 0 else "user_namespace")
  return Isolation("audit_hook", "audit_hook", "audit_hook", "process_group",
                   "unique_uid" if os.geteuid() == 0 else "host_uid",
                   reason=probe.infra_error or f"{probe.status}: {probe.detail}")


def sandbox_network_isolation(interpreter: str | None = None) -> str:
  """"netns" (kernel-enforced) or "audit_hook" (best effort): see the module docstring."""
  return sandbox_isolation(interpreter).network


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "", *,
               interpreter: str | None = None, isolation: str = "auto") -> SandboxResult:
  """Runs `code` as main.py in a fresh sandbox (see the module docstring); stdin is its
  standard input. Never raises on the program's or the sandbox's failures."""
  if isolation not in ISOLATIONS:
    raise ValueError(f"isolation must be one of {ISOLATIONS}, not {isolation!r}")
  interpreter = interpreter or sys.executable
  start = time.monotonic()
  mode, box = "", None
  try:
    if isolation == "auto":
      found = sandbox_isolation(interpreter)
      if found.mode != "namespaces":  # fail closed: the fallback only by name
        return _infra(f"refused: namespaces are unavailable ({found.reason}); the "
                      "audit_hook fallback runs only when chosen by name", 0.0, "")
    mode = "namespaces" if isolation == "auto" else isolation
    box = tempfile.mkdtemp(prefix="rljax-sandbox-")
    return _run(code, limits, stdin, interpreter, mode, box)
  except Exception as e:  # pylint: disable=broad-except  (the sandbox's failure)
    return _infra(f"{type(e).__name__}: {e}", time.monotonic() - start, mode)
  finally:
    if box is not None:
      try:
        _remove_tree(box)
      except Exception:  # pylint: disable=broad-except  (a tree too deep for rmtree)
        subprocess.run(["rm", "-rf", "--", box], check=False)


# ------------------------------------------------------------------------------- the host


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
