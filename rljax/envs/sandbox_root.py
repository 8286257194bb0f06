"""The sandbox's minimal root (namespaces mode): the only files the program can see.

`enter(work, uid, gid, disk_bytes)` runs in the sandbox's P1 (in the new mount and pid
namespaces, before it forks the program). On an empty tmpfs it builds a root that holds
only, each host object bound at its own path (the symlinks on the way recreated as
symlinks, the directories on the way empty ones of the new root):
  - the interpreter at its real path (symlinks resolved: the program runs that path, so a
    venv's bin/ and pyvenv.cfg are not there), its dynamic loader (PT_INTERP) and the
    shared libraries it and the stdlib's extension modules need, transitively (read from
    their ELF DT_NEEDED / RPATH / RUNPATH; resolved in those, the loader's default
    directories, the directories of the libraries mapped now, /etc/ld.so.conf's), plus
    libgcc_s (glibc loads it for pthread_exit): each a file of its own, not its directory;
  - the stdlib directory (os.py's; lib-dynload too where it lies elsewhere), its
    site-packages and dist-packages covered by an empty tmpfs;
  - the C.UTF-8 locale (/usr/lib/locale/C.utf8) where the host has it;
  - /etc/ld.so.cache only where a library lies outside the loader's default directories
    and the RUNPATHs (the loader then finds it through the cache alone); else no /etc;
  - /dev: null, zero, full, random, urandom (the host's devices, bound), fd, stdin,
    stdout, stderr (links into /proc/self/fd) and an empty /dev/shm;
  - /proc: a fresh proc of the pid namespace (an empty directory where it cannot mount);
  - the working directory: a fresh tmpfs of disk_bytes owned by uid, main.py copied in.
Every mount but the working directory is read-only (plus nosuid, and whatever the host's
mount had locked). Then pivot_root into it and the old root is detached: nothing else of
the host is in the namespace, so every other path is ENOENT, however it is named (`..`,
symlinks, /proc/*/root, /proc/*/cwd, descriptors: the program inherits none but its
pipes). Stdlib only (ctypes, struct); the launcher loads it by path before the mounts.
Returns the interpreter's path, for the program's exec.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_BIND, _MS_REC, _MS_PRIVATE, _MS_STRICTATIME = 4096, 16384, 1 << 18, 1 << 24
_MNT_DETACH = 2
# statvfs f_flag bit -> mount flag: what a read-only remount must keep (a user namespace
# may not clear the flags the host's mount had locked)
_KEPT = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21), (8192, 256))
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_DEVICES = ("null", "zero", "full", "random", "urandom")
_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
          ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"))


class _Sys:
  def __init__(self):
    self._libc = ctypes.CDLL(None, use_errno=True)

  def _check(self, rc: int, what: str) -> None:
    if rc != 0:
      errno = ctypes.get_errno()
      raise OSError(errno, f"{what}: {os.strerror(errno)}")

  def mount(self, source, target, fstype, flags, data=None):
    def enc(s):
      return None if s is None else os.fsencode(s)
    self._check(self._libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags),
                                 enc(data)), f"mount {target}")

  def read_only(self, point: str) -> None:
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID
    kept = os.statvfs(point).f_flag
    for bit, flag in _KEPT:
      flags |= flag if kept & bit else 0
    if not kept & (1024 | 4096):  # neither noatime nor relatime: keep strictatime
      flags |= _MS_STRICTATIME
    self.mount(None, point, None, flags)

  def pivot_root_here(self) -> None:
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
      raise OSError(f"pivot_root: no system call number known for {os.uname().machine}")
    self._check(self._libc.syscall(number, b".", b"."), "pivot_root")
    self._check(self._libc.umount2(b".", _MNT_DETACH), "umount the old root")


def _elf(path: str) -> tuple[str | None, list[str], list[str]]:
  """(PT_INTERP, DT_NEEDED names, DT_RPATH and DT_RUNPATH entries) of an ELF file."""
  try:
    f = open(path, "rb")  # pylint: disable=consider-using-with
  except OSError:
    return None, [], []
  with f:
    def read(offset, n):
      f.seek(offset)
      return f.read(n)
    head = f.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF":
      return None, [], []
    e = "<" if head[5] == 1 else ">"
    # ELF64 / ELF32: e_phoff, e_phentsize's place, a program header, where its (type,
    # offset, vaddr, filesz) are, a dynamic entry
    wide = head[4] == 2
    (phoff,) = struct.unpack_from(e + ("Q" if wide else "I"), head, 32 if wide else 28)
    size, count = struct.unpack_from(e + "HH", head, 54 if wide else 42)
    ph, order, dyn = ((e + "IIQQQQQQ", (0, 2, 3, 5), e + "qQ") if wide else
                      (e + "IIIIIIII", (0, 1, 2, 4), e + "iI"))
    table = read(phoff, size * count)
    segments = [tuple(struct.unpack_from(ph, table, i * size)[j] for j in order)
                for i in range(count)]
    interp, dynamic = None, b""
    for kind, offset, _, filesz in segments:
      if kind == 3:
        interp = os.fsdecode(read(offset, filesz).split(b"\0")[0])
      elif kind == 2:
        dynamic = read(offset, filesz)
    step = struct.calcsize(dyn)
    entries = []
    for tag, value in struct.iter_unpack(dyn, dynamic[:len(dynamic) - len(dynamic) % step]):
      if tag == 0:
        break
      entries.append((tag, value))
    strtab = next((v for t, v in entries if t == 5), None)
    base = next((off + strtab - va for kind, off, va, sz in segments
                 if strtab is not None and kind == 1 and va <= strtab < va + sz), None)
    if base is None:
      return interp, [], []
    def string(offset):
      return os.fsdecode(read(base + offset, 4096).split(b"\0")[0])
    needed = [string(v) for t, v in entries if t == 1]
    paths = [p for t, v in entries if t in (15, 29) for p in string(v).split(":") if p]
    return interp, needed, paths


def _conf_dirs(conf: str = "/etc/ld.so.conf", depth: int = 0) -> list[str]:
  """The directories /etc/ld.so.conf names (with its includes)."""
  import glob  # pylint: disable=import-outside-toplevel
  dirs = []
  try:
    with open(conf, encoding="utf-8", errors="replace") as f:
      lines = [line.split("#")[0].strip() for line in f]
  except OSError:
    return dirs
  for line in lines:
    if line.startswith("include") and depth < 4:
      pattern = line.split(None, 1)[1] if " " in line or "\t" in line else ""
      pattern = os.path.join(os.path.dirname(conf), pattern)
      for included in sorted(glob.glob(pattern)):
        dirs += _conf_dirs(included, depth + 1)
    elif line.startswith("/"):
      dirs.append(line)
  return dirs


def _libraries(executable: str, extensions: list[str]) -> tuple[set[str], bool]:
  """The loader and every shared library that executable and extensions need,
  transitively, at the paths the loader finds them; and whether it needs ld.so.cache."""
  arch = getattr(sys.implementation, "_multiarch", "")
  defaults = [d for d in (f"/lib/{arch}" if arch else "", f"/usr/lib/{arch}" if arch else "",
                          "/lib64", "/usr/lib64", "/lib", "/usr/lib") if d]
  mapped = []
  try:
    with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
      for line in f:
        fields = line.split(None, 5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if path.startswith("/") and ".so" in path:
          mapped.append(os.path.dirname(path))
  except OSError:
    pass
  extra: list[str] | None = None
  found, seen, needs_cache = set(), set(), False
  # (object, whether it is a bare name: one the loader resolves at run time, dlopen)
  queue = [(executable, False)] + [(x, False) for x in extensions] + [("libgcc_s.so.1", True)]
  exe_paths: list[str] = []
  while queue:
    obj, bare = queue.pop(0)
    if bare:
      names, own = [obj], []
    else:
      real = os.path.realpath(obj)
      if real in seen:
        continue
      seen.add(real)
      interp, names, paths = _elf(obj)
      if interp:
        found.add(interp)
      origin = os.path.dirname(real if obj == executable else obj)
      own = [p.replace("${ORIGIN}", origin).replace("$ORIGIN", origin) for p in paths]
      if obj == executable:
        exe_paths = own
    for name in names:
      path, where = (name, "") if "/" in name else (None, "")
      for group, dirs in (("run", own + exe_paths), ("default", defaults), ("maps", mapped)):
        for d in dirs if path is None else ():
          if os.path.isfile(os.path.join(d, name)):
            path, where = os.path.join(d, name), group
            break
      if path is None:
        extra = _conf_dirs() if extra is None else extra
        path = next((os.path.join(d, name) for d in extra
                     if os.path.isfile(os.path.join(d, name))), None)
        where = "conf"
      if path is None:
        continue  # the loader cannot find it either: the program's start says so
      needs_cache |= where in ("maps", "conf")
      found.add(path)
      queue.append((path, False))
  return found, needs_cache


class _Root:
  """A new root being built at `new` (a tmpfs)."""

  def __init__(self, sys_: _Sys, new: str):
    self.sys, self.new, self.bound = sys_, new, set()

  def mkdirs(self, path: str) -> None:
    inside = self.new
    for name in [p for p in path.split("/") if p]:
      inside = os.path.join(inside, name)
      if not os.path.lexists(inside):
        os.mkdir(inside, 0o755)

  def place(self, path: str, hops: int = 0) -> None:
    """Binds host `path` at the same path in the new root (read-only), recreating each
    symlink on the way; a path the host lacks is left out."""
    parts, current = [p for p in path.split("/") if p not in ("", ".")], "/"
    for i, name in enumerate(parts):
      if name == "..":
        current = os.path.dirname(current)
        continue
      host = os.path.join(current, name)
      if host in self.bound:
        return
      inside = self.new + host
      if os.path.islink(host):
        target = os.readlink(host)
        if not os.path.lexists(inside):
          os.symlink(target, inside)
        if hops > 40:
          raise OSError(40, f"too many levels of symbolic links: {path}")
        return self.place(os.path.join(current, target, *parts[i + 1:]), hops + 1)
      if not os.path.exists(host):
        return
      if i < len(parts) - 1:
        if not os.path.lexists(inside):
          os.mkdir(inside, 0o755)
        current = host
        continue
      if os.path.isdir(host):
        os.mkdir(inside, 0o755)
      else:
        os.close(os.open(inside, os.O_CREAT | os.O_WRONLY, 0o644))
      self.sys.mount(host, inside, None, _MS_BIND)  # not MS_REC: nothing mounted below
      self.sys.read_only(inside)
      self.bound.add(host)
    return None

  def cover(self, path: str) -> None:
    """An empty read-only tmpfs over path (in the new root), where it is a directory."""
    inside = self.new + path
    if os.path.isdir(inside) and not os.path.islink(inside):
      self.sys.mount("tmpfs", inside, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                     "mode=0755,size=4k")
      self.sys.read_only(inside)


def _stdlib() -> tuple[str, list[str]]:
  """The stdlib directory (os.py's) and its extension modules' directories."""
  stdlib = os.path.dirname(os.path.realpath(os.__file__))
  dirs = {os.path.join(stdlib, "lib-dynload")}
  for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None) or ""
    if path.endswith(".so"):
      dirs.add(os.path.dirname(os.path.realpath(path)))
  return stdlib, sorted(d for d in dirs if os.path.isdir(d))


def enter(work: str, uid: int, gid: int, disk_bytes: int) -> str:
  """Builds the minimal root and moves into it (see the module docstring); returns the
  interpreter's path there."""
  sys_ = _Sys()
  sys_.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
  executable = os.path.realpath(sys.executable)
  stdlib, dynload = _stdlib()
  extensions = [os.path.join(d, n) for d in dynload for n in sorted(os.listdir(d))
                if n.endswith(".so")]
  libraries, needs_cache = _libraries(executable, extensions)
  with open(os.path.join(work, "main.py"), "rb") as f:
    source = f.read()
  new = work  # the new root's tmpfs goes over the (host's) working directory
  sys_.mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
  root = _Root(sys_, new)
  for path in [stdlib, *dynload, executable, *sorted(libraries), "/usr/lib/locale/C.utf8"] + (
      ["/etc/ld.so.cache"] if needs_cache else []):
    root.place(path)
  for name in ("site-packages", "dist-packages"):
    root.cover(os.path.join(stdlib, name))
  root.mkdirs("/dev/shm")
  for name in _DEVICES:
    if os.path.exists(f"/dev/{name}"):
      root.place(f"/dev/{name}")
  for name, target in _LINKS:
    os.symlink(target, f"{new}/dev/{name}")
  root.mkdirs("/proc")
  try:  # the pid namespace's own; without it (a kernel's refusal) /proc stays empty
    sys_.mount("proc", f"{new}/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    sys_.read_only(f"{new}/proc")
  except OSError:
    pass
  root.mkdirs(work)
  os.chmod(new + work, 0o700)
  sys_.mount("tmpfs", new + work, "tmpfs", _MS_NOSUID | _MS_NODEV,
             f"size={disk_bytes},mode=0700,uid={uid},gid={gid}")
  main = os.path.join(new + work, "main.py")
  with open(main, "wb") as f:
    f.write(source)
  os.chown(main, uid, gid)
  os.chdir(new)
  sys_.pivot_root_here()
  os.chdir("/")
  sys_.read_only("/")
  return executable
