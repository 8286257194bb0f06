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
supervisor reported "started", the program was not started within wall_s, "auto"
found no namespaces, or the audit_hook fallback has neither a uid of its own nor
Landlock here (both refused, below). The supervisor reports "started" just before it
forks the program, so a run that ends after that without the program's wait status was
ended by the program (nothing of the host's runs there but wait4 and one write): it is
status "error", the program's failure. The program cannot write to the status pipe (it
is closed at its exec), so it cannot forge a report.

How a run goes is in `sandbox_host.py`: the launcher (P0), its supervisor (P1) and the
program (P2), the host's reading and kills. The limits (`SandboxLimits`: P2's rlimits, the
disk, the uid of its own a root host runs it as) and the result (`SandboxResult`) are
`sandbox_limits.py`'s; the sandbox's inside is `sandbox_launcher.py`.

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
                unique uid of sandbox_limits.py; otherwise inside a new user namespace
                that maps only the host user's own uid, whose capabilities are gone at
                the exec).
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
                program runs as a uid of its own (sandbox_limits.py; the working directory is
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
                only by the host's polling (sandbox_limits.py). A non-root
                host runs the program as the host's user (RLIMIT_NPROC: that user's
                task count now plus max_processes), seccomp keeping its signals to
                itself and Landlock's scoping keeping it out of that user's other
                processes' /proc/<pid> (mem, fd, environ: EACCES, tested). On a
                kernel without Landlock only the audit hook would guard those (a
                program past it could write the trainer's memory through
                /proc/<pid>/mem; measured: as nobody it opens O_RDWR), so that one
                combination (audit_hook, a non-root host, no Landlock) fails closed:
                `audit_hook_refusal()` says why, `sandbox_isolation().fallback_refused`
                carries it, run_python returns infra_error "refused: ..." without
                starting anything, python_tool refuses to be built (a run fails at
                start), and the launcher refuses it too (a setup error) should a
                caller get past the host's check. It runs as root (the program gets a
                uid of its own) or on a kernel with Landlock (Linux >= 5.13, landlock
                among the active LSMs).
`run_python(..., isolation=...)` forces either mode (the tests run both).

Reading: namespaces mode shows only its minimal root (above); audit_hook mode reads
wherever the program's uid may (world-readable host files included: documented above).
/dev/shm is empty and read-only in namespaces mode, so multiprocessing's semaphores are
unavailable; /dev/null and friends work.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
import time

from rljax.envs import sandbox_landlock
from rljax.envs.sandbox_host import _infra, _remove_tree, _run
from rljax.envs.sandbox_limits import ISOLATIONS, SandboxLimits, SandboxResult


@dataclasses.dataclass(frozen=True)
class Isolation:
  """Which mechanisms `run_python(..., isolation="auto")` uses on this machine."""
  mode: str  # "namespaces" | "audit_hook"
  network: str  # "netns" | "audit_hook"
  filesystem: str  # "read_only_mounts" | "audit_hook"
  processes: str  # "pid_namespace" | "process_group"
  user: str  # "unique_uid" (root host, either mode) | "user_namespace" | "host_uid"
  reason: str = ""  # why namespaces are not used
  fallback_refused: str = ""  # why isolation="audit_hook" is refused here ("": it runs)


def _host_is_root() -> bool:
  """Whether the host runs as root, so that a program gets a uid of its own (the launcher
  decides the same way: its euid, inherited from here)."""
  return os.geteuid() == 0


def audit_hook_refusal() -> str:
  """"" where the audit_hook fallback may run here; otherwise why it is refused: a non-root
  host (the program would run as the host's own user) on a kernel without Landlock
  (nothing but the audit hook between the program and that user's other processes'
  /proc/<pid>/mem and environ). See the module docstring."""
  if _host_is_root() or sandbox_landlock.abi_version() > 0:
    return ""
  return (f"the audit_hook fallback would run the program as this host's own user (uid "
          f"{os.geteuid()}: not root, so there is no uid of its own to drop to) on a kernel "
          "without Landlock (landlock_create_ruleset reports no ABI), leaving only the "
          "audit hook, which is not a security boundary, between it and that user's other "
          "processes' /proc/<pid>/mem and environ (the trainer's memory); to run it, run "
          "as root (the program then gets a uid of its own) or on a kernel with Landlock "
          "(Linux >= 5.13 with landlock among the active LSMs), or use isolation='auto' "
          "where namespaces are available")


@functools.lru_cache(maxsize=None)
def _namespaces_failure(interpreter: str | None) -> str:
  """Probes once per interpreter: "" if a trivial program runs under
  isolation="namespaces", else the probe's error."""
  probe = run_python("pass", SandboxLimits(wall_s=30.0), interpreter=interpreter,
                     isolation="namespaces")
  if probe.status == "ok":
    return ""
  return probe.infra_error or f"{probe.status}: {probe.detail}"


def sandbox_isolation(interpreter: str | None = None) -> Isolation:
  """Namespaces where the (cached) probe runs under them, else the audit-hook fallback
  (with the probe's error); `fallback_refused` says whether the fallback may run here."""
  failure, refused = _namespaces_failure(interpreter), audit_hook_refusal()
  if not failure:
    return Isolation("namespaces", "netns", "read_only_mounts", "pid_namespace",
                     "unique_uid" if _host_is_root() else "user_namespace",
                     fallback_refused=refused)
  return Isolation("audit_hook", "audit_hook", "audit_hook", "process_group",
                   "unique_uid" if _host_is_root() else "host_uid", reason=failure,
                   fallback_refused=refused)


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
        also = (f" (and is refused here: {found.fallback_refused})"
                if found.fallback_refused else "")
        return _infra(f"refused: namespaces are unavailable ({found.reason}); the "
                      f"audit_hook fallback runs only when chosen by name{also}", 0.0, "")
    mode = "namespaces" if isolation == "auto" else isolation
    if mode == "audit_hook":  # fail closed: no uid of its own and no Landlock
      refused = audit_hook_refusal()
      if refused:
        return _infra(f"refused: {refused}", 0.0, "")
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
