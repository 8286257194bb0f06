"""The sandbox's inside: launcher (P0), supervisor (P1) and program (P2) of `run_python`.

`rljax/envs/sandbox_host.py` (the host side) runs this file as a script,
`python -I -S sandbox_launcher.py --launch CONFIG`: stdlib only, no sys.path; its guard
modules (`sandbox_seccomp.py`, `sandbox_landlock.py`, and `sandbox_root.py`: the minimal
root of namespaces mode) are loaded by path before the mounts. What each process does
and the reports on the status pipe are described in sandbox_host.py's module docstring,
the isolation in sandbox.py's; CONFIG is the JSON `sandbox_host._run` writes
(mode, work, limits, status_fd, uid_base). The launcher's PATH is the host's minimal one.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys

# The program's interpreter runs this with -c before main.py:
# argv = [-c, mode, working directory, may_fork ("1" | "0")].
_BOOTSTRAP = r'''
import sys


def _guard(root, may_fork):
  import os
  realpath, fsdecode, AF_UNIX = os.path.realpath, os.fsdecode, 1
  me, writes = os.getpid(), os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  deny_always = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.forkpty",
                 "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
                 "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                 "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                 "socket.getnameinfo", "socket.gethostbyname_ex"}
  path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,),
                 "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,), "os.chflags": (0,),
                 "os.lchflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
                 "shutil.rmtree": (0,)}
  blocked_imports = {"_posixsubprocess", "_ctypes", "ctypes", "_xxsubinterpreters"}
  if not may_fork:
    deny_always.add("os.fork")

  def inside(path):
    if isinstance(path, int):
      return True  # an open descriptor
    p = realpath(fsdecode(path))
    return p == root or p.startswith(root + "/")

  def deny(event):
    raise PermissionError(f"sandbox: {event} is not allowed here")

  def hook(event, args):
    if event == "open":
      path, mode, flags = args
      wants = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
          isinstance(flags, int) and flags > 0 and flags & writes)
      if wants and path is not None and not inside(path):
        deny(f"writing {fsdecode(path)!r}")
    elif event in path_events:
      for i in path_events[event]:
        if args[i] is not None and not inside(args[i]):
          deny(f"{event} of {fsdecode(args[i])!r}")
    elif event in deny_always:
      deny(event)
    elif event == "import" and args[0] in blocked_imports:
      deny(f"import {args[0]}")
    elif event == "socket.__new__" and args[1] != AF_UNIX:
      deny("a network socket")
    elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
      address = args[1]
      if not (isinstance(address, (str, bytes)) and address[:1] not in ("\0", b"\0", "", b"")
              and inside(address)):
        deny(f"{event} to {address!r}")
    elif (event == "os.kill" and args[0] != me) or event == "os.killpg":
      deny(f"{event} of another process")

  sys.addaudithook(hook)


def _main(mode, root, may_fork):
  import builtins
  if mode == "audit_hook":
    _guard(root, may_fork == "1")
  builtins.exit = builtins.quit = sys.exit
  with open("main.py", "rb") as f:
    source = f.read()
  main = type(sys)("__main__")
  main.__file__, main.__builtins__ = "main.py", builtins
  sys.modules["__main__"], sys.argv = main, ["main.py"]
  try:
    exec(compile(source, "main.py", "exec"), main.__dict__)
  except SystemExit:
    raise
  except BaseException as e:
    frames, tb = [], e.__traceback__  # from main.py's first frame on, without this file's
    while tb is not None:
      if tb.tb_frame.f_code.co_filename != "<sandbox>" and (
          frames or tb.tb_frame.f_code.co_filename == "main.py"):
        frames.append(tb)
      tb = tb.tb_next
    for a, b in zip(frames, frames[1:] + [None]):
      a.tb_next = b
    sys.excepthook(type(e), e, e.with_traceback(frames[0] if frames else None).__traceback__)
    sys.exit(1)


_main(*sys.argv[1:4])
'''

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38


class _Libc:
  """The few system calls the launcher needs that the os module lacks (via ctypes)."""

  def __init__(self):
    import ctypes  # pylint: disable=import-outside-toplevel
    self._ctypes = ctypes
    self._libc = ctypes.CDLL(None, use_errno=True)

  def _check(self, rc: int, what: str) -> None:
    if rc != 0:
      errno = self._ctypes.get_errno()
      raise OSError(errno, f"{what}: {os.strerror(errno)}")

  def unshare(self, flags: int) -> None:
    self._check(self._libc.unshare(flags), "unshare")

  def prctl(self, option: int, value: int) -> None:
    self._check(self._libc.prctl(option, self._ctypes.c_ulong(value), 0, 0, 0), "prctl")


def _report(fd: int, **message) -> None:
  try:
    os.write(fd, (json.dumps(message) + "\n").encode())
  except OSError:
    pass


def _quiet_stdio() -> None:
  """Lets go of the program's pipes: EOF on them is then up to the program alone."""
  null = os.open(os.devnull, os.O_RDWR)
  for fd in (0, 1, 2):
    os.dup2(null, fd)
  os.close(null)


def _write_file(path: str, text: str) -> None:
  with open(path, "w", encoding="ascii") as f:
    f.write(text)


def _tasks_of(uid: int) -> int:
  """How many tasks (threads) the user runs now: RLIMIT_NPROC's count."""
  count = 0
  for pid in os.listdir("/proc"):
    try:
      with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      if int(fields["Uid"].split()[0]) == uid:
        count += int(fields["Threads"])
    except (OSError, ValueError, KeyError):
      continue
  return count


def _program_interpreter(uid: int) -> str:
  """audit_hook: the launcher's interpreter where the program's uid may run it; else (as
  root, a Python under /root, say) the system's Python of the same version, which the
  program's bootstrap (stdlib only) runs as well. (namespaces: the minimal root's.)"""
  if os.access(sys.executable, os.X_OK):
    return sys.executable
  version = f"{sys.version_info[0]}.{sys.version_info[1]}"
  for candidate in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
    if os.access(candidate, os.X_OK):
      return candidate
  raise OSError(f"the interpreter {sys.executable} is not reachable by the program's "
                f"unprivileged uid {uid}, nor is a system python{version} (audit_hook mode "
                "cannot hide the directories above it: use a Python other users may run)")


def _exec_program(libc: _Libc, config: dict, status_fd: int, uid: int, gid: int,
                  drop: bool, ns: bool, guards: dict, python: str | None) -> None:
  """P2: limits, identity, then the program's interpreter (`python`: the minimal root's;
  None: audit_hook's choice). Never returns."""
  try:
    limits = config["limits"]
    if drop or not ns:
      nproc = limits["max_processes"] + (0 if drop else _tasks_of(os.getuid()))
    else:  # a user namespace: P0 and P1 count too
      nproc = limits["max_processes"] + 2
    cpu = math.ceil(limits["cpu_s"])
    for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, limits["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, min(limits["max_file_bytes"],
                                                     limits["disk_bytes"])),
                         (resource.RLIMIT_NPROC, nproc),
                         (resource.RLIMIT_NOFILE, limits["max_open_files"]),
                         (resource.RLIMIT_CORE, 0)):
      resource.setrlimit(which, value if isinstance(value, tuple) else (value, value))
    if drop:
      os.setgroups([])
      os.setresgid(gid, gid, gid)
      os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0:
      raise OSError("refusing to run the program as root")
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
    work = config["work"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work,
           "TMPDIR": work}
    bootstrap = f"exec(compile({_BOOTSTRAP!r}, '<sandbox>', 'exec'))"
    # never root, so RLIMIT_NPROC holds: the program may fork
    python = python or _program_interpreter(uid)
    landlock = guards["landlock"].restrict(work)  # writes only beneath work
    if not landlock and not drop and config["mode"] == "audit_hook":
      # the host's uid, no Landlock: only the audit hook would keep the program out of
      # that user's /proc/<pid>/mem (sandbox.audit_hook_refusal refuses this first)
      raise OSError("refusing the audit_hook fallback as the host's own user on a kernel "
                    "without Landlock (run as root or on a kernel with Landlock)")
    guards["seccomp"].install(config["mode"], os.getpid())  # last: execve stays allowed
    os.execve(python, [python, "-I", "-S", "-u", "-c", bootstrap, config["mode"], work, "1"],
              env)
  except BaseException as e:  # pylint: disable=broad-except
    _report(status_fd, setup_error=f"starting the program: {type(e).__name__}: {e}")
  os._exit(127)  # pylint: disable=protected-access


def _supervise(libc: _Libc, config: dict, status_fd: int, uid: int, gid: int, drop: bool,
               ns: bool, guards: dict) -> None:
  """P1 (the pid namespace's init with namespaces): mounts, then the program; reports
  its wait status and rusage. Never returns."""
  try:
    python = None
    if ns:  # the minimal root (sandbox_root.py): the program sees nothing else
      python = guards["root"].enter(config["work"], uid, gid, config["limits"]["disk_bytes"])
    elif drop:  # audit_hook as root: the working directory becomes the program's uid's
      for path in (config["work"], os.path.join(config["work"], "main.py")):
        os.chown(path, uid, gid)
    os.chdir(config["work"])
    # before the fork: from here on the program may exist, and whatever ends this process
    # without a setup_error or a wait status is the program's doing (see _result)
    _report(status_fd, started=True)
    program = os.fork()
  except BaseException as e:  # pylint: disable=broad-except
    _report(status_fd, setup_error=f"{type(e).__name__}: {e}")
    os._exit(1)  # pylint: disable=protected-access
  if program == 0:
    _exec_program(libc, config, status_fd, uid, gid, drop, ns, guards, python)
  _quiet_stdio()
  while True:  # reaps orphans too (in a pid namespace they come to its init)
    try:
      pid, wait_status, usage = os.wait4(-1, 0)
    except ChildProcessError:
      break
    if pid == program:
      _report(status_fd, wait_status=wait_status, cpu_s=usage.ru_utime + usage.ru_stime,
              max_rss_bytes=usage.ru_maxrss * 1024)
      break
  os._exit(0)  # pylint: disable=protected-access


def _load_sibling(name: str):
  """rljax/envs/<name>.py, beside this file (the launcher runs with -I -S: no sys.path)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"rljax_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _launch(config: dict) -> None:
  """P0, run as `python -I -S sandbox.py --launch CONFIG` by run_python."""
  status_fd = config["status_fd"]
  os.set_inheritable(status_fd, False)  # the program's exec closes it
  try:
    libc = _Libc()
    # loaded now: the minimal root leaves this directory out
    guards = {name: _load_sibling(f"sandbox_{name}") for name in ("seccomp", "landlock", "root")}
    guards["seccomp"]._library()  # pylint: disable=protected-access  (missing: setup_error)
    ns, root = config["mode"] == "namespaces", os.geteuid() == 0
    drop = root  # never root: a uid of its own (see the module docstring)
    uid, gid = ((config["uid_base"] + os.getpid(),) * 2 if drop else
                (os.getuid(), os.getgid()))
    if ns:
      flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
      libc.unshare(flags if root else flags | _CLONE_NEWUSER)
      if not root:
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    supervisor = os.fork()
  except BaseException as e:  # pylint: disable=broad-except
    _report(status_fd, setup_error=f"{type(e).__name__}: {e}")
    os._exit(1)  # pylint: disable=protected-access
  if supervisor == 0:
    _supervise(libc, config, status_fd, uid, gid, drop, ns, guards)
  _quiet_stdio()
  os.waitpid(supervisor, 0)
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__" and sys.argv[1:2] == ["--launch"]:
  _launch(json.loads(sys.argv[2]))
