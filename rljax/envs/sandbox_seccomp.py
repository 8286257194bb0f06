"""The sandbox's seccomp filter: system calls the program may not make, whatever it runs.

`install(mode, pid)` loads a filter into the calling process (the sandbox's P2, after its
rlimits and uid change, before it execs the program's interpreter); every process and
thread the program starts inherits it, and nothing can remove it. It is built with
libseccomp (`libseccomp.so.2`, the library behind systemd's and Docker's filters) through
ctypes: stdlib only, so the launcher (`python -I -S sandbox_launcher.py`, no
site-packages) can load this file by path. libseccomp resolves the syscall numbers of the machine's own
architecture; a call from another ABI (x86's int 0x80, x32) kills the process, so
32-bit `socketcall` cannot go around the rules.

Refused with EPERM in both isolation modes (default: allow):
  socket(AF_UNIX, ...)  a unix socket could reach host listeners by path (a read-only
                        mount does not stop connect()) and, outside a new network
                        namespace, by abstract name. socketpair() stays allowed: it
                        reaches nothing but itself. Audit-hook mode refuses every
                        socket() family (its host network is the host's).
  io_uring_*            io_uring runs socket/connect/openat without these rules seeing them
  ptrace, process_vm_readv/writev, pidfd_open, pidfd_getfd, pidfd_send_signal, kcmp
                        reaching into or signalling other processes (within a pid
                        namespace only its own, but no program needs them)
  fcntl F_SETOWN / F_SETOWN_EX, ioctl FIOSETOWN / SIOCSPGRP
                        SIGIO / SIGURG delivered to a pid the program names
  unshare, setns, clone with CLONE_NEWUSER, clone3 (ENOSYS: glibc then uses clone),
  mount, umount2, pivot_root, chroot, bpf, perf_event_open, userfaultfd, keyctl,
  add_key, request_key, open_by_handle_at, name_to_handle_at, personality
                        kernel attack surface: new namespaces (capabilities in a new user
                        namespace), handles that bypass paths, kernel keys
  shmget, semget, msgget, mq_open
                        System V and POSIX IPC objects outlive the program: without an IPC
                        namespace (audit_hook mode) the next episode could find them
Audit-hook mode only (no pid namespace: the host's processes share the pid space):
  kill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo to any pid but the program's own (so
  no signal to its process group (0, -pgid), its supervisor or -1), tkill entirely.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

AF_UNIX = 1
CLONE_NEWUSER = 0x10000000
_ALLOW = 0x7FFF0000
_CMP_NE, _CMP_EQ, _CMP_MASKED_EQ = 1, 4, 7

DENIED = ("io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace",
          "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd",
          "pidfd_send_signal", "kcmp", "unshare", "setns", "mount", "umount2", "pivot_root",
          "chroot", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key",
          "request_key", "open_by_handle_at", "name_to_handle_at", "personality",
          "shmget", "semget", "msgget", "mq_open")
F_SETOWN = (8, 15)  # F_SETOWN, F_SETOWN_EX
SETOWN_IOCTLS = (0x8901, 0x8902)  # FIOSETOWN, SIOCSPGRP
SIGNALS_TO_SELF_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")


def _errno(code: int) -> int:
  return 0x00050000 | (code & 0xFFFF)


class _Arg(ctypes.Structure):
  _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
              ("datum_b", ctypes.c_uint64)]


_LIB: list[ctypes.CDLL] = []  # loaded once (the launcher's forks inherit it)


def _library() -> ctypes.CDLL:
  if _LIB:
    return _LIB[0]
  try:  # the soname first: find_library runs ldconfig in a subprocess
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
  except OSError:
    name = ctypes.util.find_library("seccomp")
    try:
      lib = ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
      lib = None
    if lib is None:
      raise OSError("libseccomp (libseccomp.so.2) is unavailable; the sandbox needs it "
                    "(apt-get install libseccomp2)") from None
  lib.seccomp_init.restype = ctypes.c_void_p
  lib.seccomp_init.argtypes = [ctypes.c_uint32]
  lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
  lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                         ctypes.c_uint, ctypes.POINTER(_Arg)]
  lib.seccomp_load.argtypes = [ctypes.c_void_p]
  lib.seccomp_release.argtypes = [ctypes.c_void_p]
  _LIB.append(lib)
  return lib


def install(mode: str, pid: int) -> None:
  """Loads the filter for `mode` ("namespaces" | "audit_hook") into this process; `pid` is
  the program's own pid (audit-hook mode: the one pid signals may name). Raises OSError
  when libseccomp or the kernel refuses."""
  lib = _library()
  ctx = lib.seccomp_init(_ALLOW)
  if not ctx:
    raise OSError("seccomp_init failed")
  try:
    def rule(name, action, *args):
      nr = lib.seccomp_syscall_resolve_name(name.encode())
      if nr < 0:
        return  # not a system call on this architecture
      array = (_Arg * max(len(args), 1))(*[_Arg(*a) for a in args])
      rc = lib.seccomp_rule_add_array(ctx, action, nr, len(args), array)
      if rc < 0:
        raise OSError(-rc, f"seccomp rule for {name}: {errno.errorcode.get(-rc, rc)}")

    eperm = _errno(errno.EPERM)
    for name in DENIED:
      rule(name, eperm)
    rule("clone3", _errno(errno.ENOSYS))
    rule("clone", eperm, (0, _CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    for name, commands in (("fcntl", F_SETOWN), ("ioctl", SETOWN_IOCTLS)):
      for command in commands:  # SIGIO / SIGURG to a process of its choosing
        rule(name, eperm, (1, _CMP_EQ, command, 0))
    if mode == "namespaces":
      rule("socket", eperm, (0, _CMP_EQ, AF_UNIX, 0))
    else:
      rule("socket", eperm)
      rule("tkill", eperm)
      for name in SIGNALS_TO_SELF_ONLY:
        # pid_t is 32 bits: compare the low word only (a negative pid is sign-extended)
        rule(name, eperm, (0, _CMP_NE, pid, 0))
    rc = lib.seccomp_load(ctx)
    if rc < 0:
      raise OSError(-rc, f"seccomp_load: {errno.errorcode.get(-rc, rc)}")
  finally:
    lib.seccomp_release(ctx)
