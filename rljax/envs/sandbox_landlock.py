"""The sandbox's Landlock ruleset: filesystem writes only beneath the working directory.

`restrict(work)` (the sandbox's P2, after no_new_privs, before its exec; inherited by all
the program starts, irremovable) makes every write-kind access (write or truncate a file,
create, remove, rename or link anything) fail with EACCES outside `work` (and /dev/null
for writing), however the path is reached: a dir_fd-relative open, a symlink, a hard
link. Reading is left as it was. Where the kernel's Landlock ABI is 6 or newer it also
scopes signals and abstract unix sockets to the program's own processes. It is what
holds the audit-hook fallback's writes to world-writable host directories (/tmp,
/dev/shm), which the audit hook cannot see through a descriptor; in namespaces mode it
sits behind the read-only mounts. Stdlib only (ctypes, raw system calls: x86_64 and
aarch64 share Landlock's numbers).

Returns the ABI version used, or 0 where the kernel has no Landlock (the caller decides:
the audit_hook fallback as the host's own user, no root to drop from, is then refused;
`abi_version()` is the probe, `sandbox.audit_hook_refusal()` the decision).
"""

from __future__ import annotations

import ctypes
import os

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2  # ABI 6


class _RulesetAttr(ctypes.Structure):
  _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
              ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi_version() -> int:
  libc = ctypes.CDLL(None, use_errno=True)
  version = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0),
                         ctypes.c_uint32(_CREATE_RULESET_VERSION))
  return max(version, 0)


def restrict(work: str) -> int:
  """Restricts this process (see the module docstring); returns the ABI used (0: none)."""
  abi = abi_version()
  if abi < 1:
    return 0
  libc = ctypes.CDLL(None, use_errno=True)

  def check(rc, what):
    if rc < 0:
      errno = ctypes.get_errno()
      raise OSError(errno, f"landlock {what}: {os.strerror(errno)}")
    return rc

  writes = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE
  writes |= (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
  attr = _RulesetAttr(writes, 0, (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0)
  size = 24 if abi >= 6 else 16 if abi >= 4 else 8
  ruleset = check(libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                               ctypes.c_uint32(0)), "create_ruleset")
  try:
    for path, access in ((work, writes), (os.devnull, WRITE_FILE | (TRUNCATE if abi >= 3 else 0))):
      fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
      try:
        rule = _PathBeneath(access, fd)
        check(libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule),
                           ctypes.c_uint32(0)), f"add_rule {path}")
      finally:
        os.close(fd)
    check(libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "restrict_self")
  finally:
    os.close(ruleset)
  return abi
