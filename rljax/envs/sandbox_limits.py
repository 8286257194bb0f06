"""The sandbox's limits and its result: `SandboxLimits` (what `run_python` enforces,
rljax.envs.sandbox) and `SandboxResult` (what a run did; `as_observation`: what a policy
sees).

Limits (rlimits of P2, the program's process (sandbox_host.py), inherited by whatever it
starts; all enforced by the kernel):
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
"""

from __future__ import annotations

import dataclasses

KiB, MiB = 1024, 1024 * 1024
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "disk_limit",
            "infra_error")
ISOLATIONS = ("auto", "namespaces", "audit_hook")
TRUNCATED = "\n[... output cut at {n} bytes]"


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
