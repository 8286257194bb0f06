"""The sandboxed Python tool: every limit contained and reported, the host unharmed.

Each test runs in every isolation this machine offers (`namespaces` where the probe
succeeds, and always the `audit_hook` fallback); a root host also runs the sandbox as an
unprivileged user (the user-namespace path)."""

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from rljax.envs import sandbox, sandbox_host, sandbox_landlock, sandbox_limits
from rljax.envs.sandbox import run_python, sandbox_isolation
from rljax.envs.sandbox_limits import SandboxLimits, SandboxResult

ISOLATION = sandbox_isolation()
MODES = ["namespaces", "audit_hook"] if ISOLATION.mode == "namespaces" else ["audit_hook"]
ROOT = os.geteuid() == 0
LANDLOCK = sandbox_landlock.abi_version() > 0
# a non-root host on a kernel without Landlock refuses the fallback (sandbox.py): its
# tests skip there, saying why
FALLBACK_REFUSED = ISOLATION.fallback_refused
SKIP_REFUSED = ("the audit_hook fallback is refused on this host (not root: no uid of its "
                "own; a kernel without Landlock): see sandbox.audit_hook_refusal()")
MODE_PARAMS = [pytest.param(m, marks=pytest.mark.skipif(
    m == "audit_hook" and bool(FALLBACK_REFUSED), reason=SKIP_REFUSED)) for m in MODES]


def run(code, limits=SandboxLimits(), stdin="", *, isolation="auto", interpreter=None):
  # audit_hook as root: the program's own uid cannot reach a Python under /root; the
  # sandbox then runs the system's python of the same version (or fails naming it)
  if isolation == "audit_hook" and FALLBACK_REFUSED:
    pytest.skip(SKIP_REFUSED)
  return run_python(code, limits, stdin, isolation=isolation, interpreter=interpreter)


def last_line(text: str) -> str:
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return lines[-1] if lines else ""


def tasks_of(uid: int) -> int:
  """Live processes of uid on the host."""
  count = 0
  for pid in os.listdir("/proc"):
    try:
      with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        uids = next(line for line in f if line.startswith("Uid:"))
      count += int(uids.split()[1]) == uid
    except (OSError, StopIteration, ValueError):
      continue
  return count


def wait_until_gone(uid: int, timeout_s: float = 10.0) -> int:
  """The pid namespace is torn down asynchronously after its init dies."""
  deadline = time.monotonic() + timeout_s
  while tasks_of(uid) and time.monotonic() < deadline:
    time.sleep(0.05)
  return tasks_of(uid)


def test_isolation_is_detected_and_active():
  assert ISOLATION.mode in ("namespaces", "audit_hook")
  assert sandbox.sandbox_network_isolation() == ISOLATION.network
  if ISOLATION.mode == "audit_hook":
    assert ISOLATION.network == ISOLATION.filesystem == "audit_hook" and ISOLATION.reason
    pytest.skip(f"namespaces unavailable here: {ISOLATION.reason}")
  assert (ISOLATION.network, ISOLATION.filesystem, ISOLATION.processes) == (
      "netns", "read_only_mounts", "pid_namespace")
  assert ISOLATION.user == ("unique_uid" if ROOT else "user_namespace")
  code = ("import os, socket\n"
          "print(os.getpid(), os.getuid())\n"
          "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
          "print([name for _, name in socket.if_nameindex()])\n"
          "print(sorted(os.environ))\n")
  r = run(code)
  assert r.status == "ok" and r.isolation == "namespaces", r
  pid_uid, procs, links, env = r.stdout.splitlines()
  pid, uid = map(int, pid_uid.split())
  assert pid == 2 and procs == "[1, 2]"  # a pid namespace of its own, a fresh /proc
  assert links == "['lo']"  # a network namespace of its own
  assert uid != 0 and (uid >= 1_600_000_000 if ROOT else uid == os.getuid())
  assert env == str(sorted(["PATH", "LANG", "LC_ALL", "HOME", "TMPDIR"]))


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_normal_program_stdin_and_exit_codes(mode):
  r = run("import sys\nprint(sum(range(10)))\nprint(sys.stdin.read().upper(), end='')",
                 stdin="hello\nworld\n", isolation=mode)
  assert (r.status, r.exit_code, r.signal, r.infra_error) == ("ok", 0, None, None), r
  assert r.stdout == "45\nHELLO\nWORLD\n" and r.stderr == "" and r.ok
  assert r.isolation == mode and r.cpu_s is not None and r.max_rss_bytes > 0
  big = "x" * (1 << 20)  # more than a pipe holds: fed as the program reads
  r = run("import sys\nprint(len(sys.stdin.read()))", stdin=big, isolation=mode)
  assert r.stdout == f"{len(big)}\n", r
  r = run("print('bye')\nexit(3)", isolation=mode)  # exit/quit exist without site
  assert (r.status, r.exit_code, r.stdout) == ("error", 3, "bye\n"), r


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_raising_program_is_an_observation(mode):
  r = run("def f():\n  raise ValueError('boom')\nf()", isolation=mode)
  assert (r.status, r.exit_code, r.infra_error) == ("error", 1, None), r
  assert last_line(r.stderr) == "ValueError: boom"
  assert r.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
  assert "<sandbox>" not in r.stderr  # the bootstrap's frames are cut
  obs = r.as_observation()
  assert "ValueError: boom" in obs and obs.endswith("[error: exit code 1]")
  r = run("x = (", isolation=mode)
  assert r.status == "error" and last_line(r.stderr).startswith("SyntaxError"), r


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_infinite_loop_hits_the_wall_and_the_cpu_limits(mode):
  r = run("while True:\n  pass", SandboxLimits(cpu_s=60, wall_s=1), isolation=mode)
  assert (r.status, r.signal, r.exit_code) == ("timeout", signal.SIGKILL, None), r
  assert r.wall_s >= 1.0  # not before its deadline
  assert r.as_observation().endswith("[timeout: killed after 1 s of wall time]")
  r = run("import time\ntime.sleep(600)", SandboxLimits(wall_s=1), isolation=mode)
  assert r.status == "timeout", r  # no CPU used: only the wall clock ends it
  r = run("while True:\n  pass", SandboxLimits(cpu_s=1, wall_s=20), isolation=mode)
  assert (r.status, r.signal) == ("cpu_limit", signal.SIGXCPU) and r.cpu_s > 0.9, r
  # a program that catches SIGXCPU is killed by the hard limit a second later
  r = run("import signal\nsignal.signal(signal.SIGXCPU, lambda *a: None)\n"
                 "while True:\n  pass", SandboxLimits(cpu_s=1, wall_s=20), isolation=mode)
  assert (r.status, r.signal) == ("cpu_limit", signal.SIGKILL), r


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_memory_hog(mode):
  limits = SandboxLimits(memory_bytes=256 * sandbox_limits.MiB)
  for code in ("b = bytearray(4 << 30)", "a = []\nwhile True:\n  a.append(bytearray(10**7))"):
    r = run(code, limits, isolation=mode)
    assert (r.status, r.exit_code) == ("memory_limit", 1), r
    assert last_line(r.stderr) == "MemoryError" and r.max_rss_bytes < 300 * sandbox_limits.MiB
  assert run("print(1)", isolation=mode).stdout == "1\n"  # the host carries on
  r = run("open('f', 'wb').write(b'x' * (2 << 20))",
                 SandboxLimits(max_file_bytes=1 << 20), isolation=mode)  # RLIMIT_FSIZE
  assert r.status == "error" and "File too large" in last_line(r.stderr), r


FORK_BOMB = """import os
print(os.getuid(), flush=True)
while True:
  try:
    if os.fork() == 0:
      os.setsid()  # leave the process group: only a pid namespace still holds them
  except OSError:
    pass
"""


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_fork_bomb_is_contained(mode):
  r = run(FORK_BOMB, SandboxLimits(max_processes=16, wall_s=2), isolation=mode)
  assert r.status == "timeout" and r.infra_error is None, r
  assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
  if ROOT:  # a uid of its own in both modes: none of its processes is left
    assert int(r.stdout.split()[0]) >= sandbox_host._UID_BASE  # pylint: disable=protected-access
    assert wait_until_gone(int(r.stdout.split()[0])) == 0


def test_concurrent_runs_do_not_share_a_process_limit():
  if ISOLATION.mode != "namespaces":
    pytest.skip("needs namespaces")
  results = {}
  bomb = threading.Thread(target=lambda: results.update(
      bomb=run(FORK_BOMB, SandboxLimits(max_processes=16, wall_s=3))))
  bomb.start()
  time.sleep(1.0)  # the bomb is at its limit now
  code = "import threading\nt = threading.Thread(target=print, args=('forked',))\n" \
         "t.start(); t.join()"
  results["neighbour"] = run(code, SandboxLimits(max_processes=16))
  bomb.join()
  assert results["bomb"].status == "timeout"
  assert (results["neighbour"].status, results["neighbour"].stdout) == ("ok", "forked\n")


def test_leftover_processes_end_with_the_run():
  # a daemon that outlives the program: the namespace (or the process group) ends it
  code = ("import os, time\nchild = os.fork()\nif child == 0:\n  {setsid}time.sleep(60)\n"
          "print(os.getuid(), child, flush=True)\n")
  for mode in MODES:
    setsid = "os.setsid(); " if mode == "namespaces" or ROOT else ""
    r = run(code.format(setsid=setsid), SandboxLimits(wall_s=20), isolation=mode)
    assert r.status == "ok", r  # not "timeout": the run did not wait for the daemon
    uid, child = map(int, r.stdout.split())
    if ROOT:  # the pid namespace, or (audit_hook) a kill(-1) as the program's uid
      assert wait_until_gone(uid) == 0
    if mode == "audit_hook":  # a host pid: killed with the process group at the end
      deadline = time.monotonic() + 10
      while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        with open(f"/proc/{child}/stat", encoding="ascii", errors="replace") as f:
          if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
            break  # dead, waiting for init to reap it
        time.sleep(0.05)
      else:
        assert not os.path.exists(f"/proc/{child}")


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_network_is_cut(mode):
  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  port = listener.getsockname()[1]
  try:
    code = ("import socket\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
            "s.settimeout(3)\n"
            f"s.connect(('127.0.0.1', {port}))\n"
            "print('connected')\n")
    r = run(code, isolation=mode)
    assert r.status == "error" and "connected" not in r.stdout, r
    if mode == "namespaces":
      assert last_line(r.stderr) == "OSError: [Errno 101] Network is unreachable"
    else:
      assert last_line(r.stderr).startswith("PermissionError: sandbox: a network socket")
    udp = ("import socket\n"
           f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))")
    assert run(udp, isolation=mode).status == "error"
    lookup = "import socket\nprint(socket.getaddrinfo('example.com', 80))"  # DNS
    assert run(lookup, isolation=mode).status == "error"
    listener.settimeout(0.5)
    with pytest.raises(socket.timeout):
      listener.accept()  # nothing ever reached the listener
  finally:
    listener.close()


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_huge_output_is_cut_and_the_host_holds_little(mode):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  limits = SandboxLimits(output_bytes=100_000)
  r = run("import sys\nsys.stdout.write('x' * 10**8)\nwhile True:\n  print('y' * 999)",
                 limits, isolation=mode)
  grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
  assert (r.status, r.signal) == ("output_limit", signal.SIGKILL), r
  assert r.stdout == "x" * 100_000 + sandbox_limits.TRUNCATED.format(n=100_000)
  assert grown < 50 * sandbox_limits.MiB  # 100 MB were written; the host kept 100 kB of it
  r = run("import sys\nwhile True:\n  sys.stderr.write('e' * 999)", limits,
                 isolation=mode)
  assert r.status == "output_limit" and len(r.stderr) < 100_100 and r.stdout == "", r
  assert r.detail == "killed: stderr passed 100000 bytes"


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_writes_outside_the_working_directory_fail(mode, tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("intact")
  escapes = [tmp_path / "escaped.txt", f"/tmp/rljax-sandbox-escape-{uuid.uuid4().hex}.txt"]
  code = f"""import os, tempfile
def attempt(name, fn):
  try:
    fn()
    print(name, "done")
  except OSError as e:
    print(name, "refused", e.errno)
attempt("write-tmp-path", lambda: open({str(escapes[0])!r}, "w").write("x"))
attempt("write-tmp", lambda: open({escapes[1]!r}, "w").write("x"))
attempt("os-open", lambda: os.open({escapes[1]!r}, os.O_WRONLY | os.O_CREAT))
attempt("remove", lambda: os.remove({str(victim)!r}))
attempt("rename", lambda: os.rename({str(victim)!r}, {str(victim) + ".moved"!r}))
attempt("append", lambda: open({str(victim)!r}, "a").write("x"))
attempt("mkdir", lambda: os.mkdir("/tmp/rljax-sandbox-escape-dir-{uuid.uuid4().hex}"))
attempt("symlink-out", lambda: (os.symlink({escapes[1]!r}, "link"), open("link", "w")))
attempt("inside", lambda: open("inside.txt", "w").write("kept"))
attempt("inside-dir", lambda: os.makedirs("a/b"))
attempt("tempfile", lambda: tempfile.mkstemp())
print(open("inside.txt").read(), sorted(os.listdir(".")))
"""
  r = run(code, isolation=mode)
  assert r.status == "ok", r
  lines = dict(line.split(" ", 1) for line in r.stdout.splitlines()[:-1])
  outside = ["write-tmp-path", "write-tmp", "os-open", "remove", "rename", "append", "mkdir",
             "symlink-out"]
  assert all(lines[k].startswith("refused") for k in outside), lines
  assert lines["inside"] == lines["inside-dir"] == lines["tempfile"] == "done", lines
  if mode == "namespaces":  # the kernel says no: a read-only mount
    assert lines["write-tmp"] == "refused 30"  # EROFS
  assert r.stdout.splitlines()[-1].startswith("kept ['a', 'inside.txt', 'link', 'main.py'")
  assert victim.read_text() == "intact" and not any(os.path.lexists(p) for p in escapes)
  assert not os.path.exists(str(victim) + ".moved")


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_the_working_directory_is_removed(mode):
  r = run("import os\nprint(os.getcwd())\nopen('left.txt', 'w').write('x')\n"
                 "os.chmod('.', 0)", isolation=mode)
  assert r.status == "ok" and os.path.basename(r.stdout.strip()).startswith("rljax-sandbox-")
  assert not os.path.exists(r.stdout.strip())
  r = run("import os\nprint(os.getcwd())\nwhile True:\n  pass", SandboxLimits(wall_s=1),
                 isolation=mode)
  assert r.status == "timeout" and not os.path.exists(r.stdout.strip())


def test_infra_failures_are_reported_not_raised(monkeypatch):
  r = run("print(1)", interpreter="/nonexistent/python3")
  assert (r.status, r.stdout, r.ok) == ("infra_error", "", False)
  assert "could not start the interpreter" in r.infra_error
  assert r.as_observation() == "[sandbox unavailable]"
  if not FALLBACK_REFUSED:  # (where it is refused, nothing starts: tested below)
    r = run("print(1)", interpreter=shutil.which("false"), isolation="audit_hook")
    assert r.status == "infra_error" and "before starting the program" in r.infra_error, r

  def no_temp_dir(**_):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(sandbox.tempfile, "mkdtemp", no_temp_dir)
  r = run("print(1)")
  assert r.status == "infra_error" and "No space left" in r.infra_error, r
  with pytest.raises(ValueError):
    run("print(1)", isolation="chroot")  # a caller's bug, not the sandbox's
  with pytest.raises(ValueError):
    SandboxLimits(wall_s=0)


def test_the_fallback_is_refused_without_a_uid_of_its_own_or_landlock(monkeypatch):
  """audit_hook on a non-root host (no uid of its own to drop to) on a kernel without
  Landlock: only the audit hook would stand between the program and the trainer's
  /proc/<pid>/mem, so nothing starts (infra_error "refused: ..."), and
  sandbox_isolation() says so. The two probes (sandbox._host_is_root,
  sandbox_landlock.abi_version) are faked; every other combination runs as before."""
  started = []
  real_run = sandbox._run  # pylint: disable=protected-access
  monkeypatch.setattr(sandbox, "_run", lambda *a: started.append(a[4]) or real_run(*a))
  monkeypatch.setattr(sandbox, "_host_is_root", lambda: False)
  monkeypatch.setattr(sandbox_landlock, "abi_version", lambda: 0)
  reason = sandbox.audit_hook_refusal()
  assert "without Landlock" in reason and "run as root" in reason, reason
  assert "/proc/<pid>/mem" in reason and "kernel with Landlock" in reason, reason
  r = run_python("print(1)", isolation="audit_hook")
  assert (r.status, r.stdout, r.isolation) == ("infra_error", "", ""), r
  assert r.infra_error == f"refused: {reason}" and started == [], r
  found = sandbox_isolation()
  assert found.fallback_refused == reason and found.mode == ISOLATION.mode, found
  # namespaces are untouched; "auto" without them names both refusals
  if ISOLATION.mode == "namespaces":
    assert run_python("print(1)").stdout == "1\n" and started == ["namespaces"]
  monkeypatch.setattr(sandbox, "_namespaces_failure", lambda interpreter: "unshare: EPERM")
  found = sandbox_isolation()
  assert (found.mode, found.user, found.reason) == ("audit_hook", "host_uid", "unshare: EPERM")
  assert found.fallback_refused == reason
  r = run_python("print(1)")
  assert r.status == "infra_error" and r.infra_error.startswith("refused: namespaces"), r
  assert f"(and is refused here: {reason})" in r.infra_error, r
  # a root host (a uid of its own) or a kernel with Landlock: the fallback runs
  for root, abi in ((True, 0), (False, 7)):
    monkeypatch.setattr(sandbox, "_host_is_root", lambda root=root: root)
    monkeypatch.setattr(sandbox_landlock, "abi_version", lambda abi=abi: abi)
    assert sandbox.audit_hook_refusal() == sandbox_isolation().fallback_refused == ""
  if not FALLBACK_REFUSED:  # (the real probes allow it here: the launcher runs it)
    r = run_python("print(1)", isolation="audit_hook")
    assert (r.status, r.stdout) == ("ok", "1\n") and started[-1] == "audit_hook", r


def test_as_observation():
  def result(status, stdout="", stderr="", detail=""):
    return SandboxResult(status, stdout, stderr, 0, None, 0.1, 0.1, 1, detail, "namespaces")

  assert result("ok", "42\n").as_observation() == "42"
  assert result("ok").as_observation() == "[no output]"
  obs = result("timeout", "partial\n", "", "killed after 1 s of wall time").as_observation()
  assert obs == "partial\n[timeout: killed after 1 s of wall time]"
  long = result("error", "o" * 5000, "e" * 5000 + "\nValueError: x\n", "exit code 1")
  obs = long.as_observation(max_chars=500)
  assert len(obs) <= 500 and obs.startswith("ooo") and "ValueError: x" in obs, obs
  assert obs.endswith("[error: exit code 1]")


# setpriv may exec a binary its new user cannot reach: check that the prefix is reachable
REACHABLE = "import os, sys, ctypes; os.stat(os.path.realpath(sys.executable)); os.listdir(sys.prefix)"
USER_NS_CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[1])  # the copy of the sandbox's modules, not the repository's
from rljax.envs import sandbox as sb, sandbox_limits as lim
port, escape = int(sys.argv[2]), sys.argv[3]
bomb = sys.argv[4]
# the fallback on a non-root host: the program runs as the host's user (never root); this
# process (same uid) must stay out of its reach: signals, and /proc/<pid> (Landlock's
# ptrace scoping: the audit hook lets reads through)
host = f'''import os
print(os.getuid(), os.geteuid(), os.getgid())
for name, fn in [("kill", lambda: os.kill({os.getpid()}, 0)),
                 ("environ", lambda: open("/proc/{os.getpid()}/environ", "rb").read()),
                 ("mem", lambda: open("/proc/{os.getpid()}/mem", "r+b")),
                 ("fd", lambda: open("/proc/{os.getpid()}/fd/1", "wb"))]:
  try:
    fn()
    print(name, "done")
  except OSError as e:
    print(name, "refused", e.errno)
'''
out = {"isolation": sb.sandbox_isolation().user,
       "fallback_refused": sb.sandbox_isolation().fallback_refused}
for name, code, limits, isolation in [
    ("facts", "import os; print(os.getpid(), os.getuid())", lim.SandboxLimits(), "auto"),
    ("connect", f"import socket; socket.socket().connect(('127.0.0.1', {port}))",
     lim.SandboxLimits(), "auto"),
    ("write", f"open({escape!r}, 'w')", lim.SandboxLimits(), "auto"),
    ("bomb", bomb, lim.SandboxLimits(max_processes=16, wall_s=2), "auto"),
    ("fallback", host, lim.SandboxLimits(), "audit_hook")]:
  r = sb.run_python(code, limits, isolation=isolation)
  out[name] = [r.status, r.stdout, r.stderr.strip().splitlines()[-1:], r.infra_error]
print(json.dumps(out))
"""
# the same non-root host on a kernel without Landlock (the copy's sandbox_landlock.py a
# stub: no ABI, nothing restricted): run_python refuses the fallback without starting
# anything, and the launcher refuses it too when the host's check is bypassed
NO_LANDLOCK_CHILD = """
import json, os, shutil, sys, tempfile
sys.path.insert(0, sys.argv[1])
from rljax.envs import sandbox as sb, sandbox_host as host, sandbox_limits as lim
out = {"euid": os.geteuid(), "refused": sb.audit_hook_refusal()}
r = sb.run_python("print(1)", isolation="audit_hook")
out["run_python"] = [r.status, r.stdout, r.infra_error]
work = tempfile.mkdtemp(prefix="rljax-sandbox-")
try:
  r = host._run("print(1)", lim.SandboxLimits(), "", sys.executable, "audit_hook", work)
finally:
  shutil.rmtree(work)
out["launcher"] = [r.status, r.stdout, r.infra_error]
print(json.dumps(out))
"""
NO_LANDLOCK_STUB = "def abi_version():\n  return 0\n\n\ndef restrict(work):\n  return 0\n"
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def _sandbox_copy(copy_dir, landlock_stub=None):
  """The sandbox's modules as a package of their own: readable by nobody wherever the
  repo is; returns a Python interpreter nobody may run (or skips)."""
  package = os.path.join(copy_dir, "rljax", "envs")
  os.makedirs(package)
  for folder in (os.path.join(copy_dir, "rljax"), package):
    open(os.path.join(folder, "__init__.py"), "w", encoding="utf-8").close()
  for sibling in ("sandbox.py", "sandbox_limits.py", "sandbox_host.py", "sandbox_launcher.py",
                  "sandbox_seccomp.py", "sandbox_landlock.py", "sandbox_root.py"):
    shutil.copy(os.path.join(os.path.dirname(sandbox.__file__), sibling), package)
  if landlock_stub is not None:
    with open(os.path.join(package, "sandbox_landlock.py"), "w", encoding="utf-8") as f:
      f.write(landlock_stub)
  for folder, _, names in os.walk(copy_dir):
    os.chmod(folder, 0o755)
    for name in names:
      os.chmod(os.path.join(folder, name), 0o644)
  python = next((p for p in (sys.executable, "/usr/bin/python3", shutil.which("python3"))
                 if p and subprocess.run(AS_NOBODY + [p, "-I", "-S", "-c", REACHABLE],
                                         capture_output=True, check=False).returncode == 0),
                None)
  if python is None:
    pytest.skip("no Python interpreter that an unprivileged user may run")
  return python


def test_unprivileged_host_without_landlock_refuses_the_fallback():
  """A real non-root host (nobody; only Landlock faked away): the fallback is refused
  by run_python before anything starts, and by the launcher when that check is
  bypassed: as the host's own user, nothing but the audit hook would be left."""
  if not ROOT or not shutil.which("setpriv"):
    pytest.skip("needs a root host (to become an unprivileged user)")
  copy_dir = tempfile.mkdtemp(prefix="rljax-sandbox-test-")
  try:
    python = _sandbox_copy(copy_dir, NO_LANDLOCK_STUB)
    child = subprocess.run(AS_NOBODY + [python, "-I", "-c", NO_LANDLOCK_CHILD, copy_dir],
                           capture_output=True, text=True, timeout=60, check=False, cwd="/",
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
  finally:
    shutil.rmtree(copy_dir)
  assert child.returncode == 0, child.stderr
  out = json.loads(child.stdout)
  assert out["euid"] == 65534 and "without Landlock" in out["refused"], out
  assert out["run_python"] == ["infra_error", "", f"refused: {out['refused']}"], out
  status, stdout, error = out["launcher"]
  assert (status, stdout) == ("infra_error", ""), out
  assert "starting the program" in error and "without Landlock" in error, out


def test_unprivileged_host_uses_a_user_namespace():
  if not ROOT or ISOLATION.mode != "namespaces" or not shutil.which("setpriv"):
    pytest.skip("needs a root host (to become an unprivileged user) with namespaces")
  copy_dir = tempfile.mkdtemp(prefix="rljax-sandbox-test-")
  try:
    _unprivileged_host(copy_dir)
  finally:
    shutil.rmtree(copy_dir)


def _unprivileged_host(copy_dir):
  python = _sandbox_copy(copy_dir)
  nobody_before = tasks_of(65534)
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  escape = f"/tmp/rljax-sandbox-escape-{uuid.uuid4().hex}"
  try:
    child = subprocess.run(
        AS_NOBODY + [python, "-I", "-c", USER_NS_CHILD, copy_dir,
                     str(listener.getsockname()[1]), escape, FORK_BOMB],
        capture_output=True, text=True, timeout=60, check=False, cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    listener.settimeout(0.2)
    with pytest.raises(socket.timeout):
      listener.accept()
  finally:
    listener.close()
  assert out["isolation"] == "user_namespace", out
  assert out["facts"][:2] == ["ok", "2 65534\n"], out
  assert out["connect"][0] == "error" and "Network is unreachable" in out["connect"][2][0]
  assert out["write"][0] == "error" and "Read-only file system" in out["write"][2][0]
  assert out["bomb"][0] == "timeout" and not os.path.exists(escape)
  status, stdout, _, error = out["fallback"]
  if not LANDLOCK:  # the host's uid and no Landlock: refused, nothing started
    assert "without Landlock" in out["fallback_refused"], out
    assert (status, stdout, error) == ("infra_error", "", f"refused: {out['fallback_refused']}")
  else:
    assert out["fallback_refused"] == "", out
    ids, *tries = stdout.splitlines()
    assert status == "ok" and ids == "65534 65534 65534", out["fallback"]
    reached = {line.split()[0]: line.split()[1] for line in tries}
    assert reached == dict.fromkeys(("kill", "environ", "mem", "fd"), "refused"), reached
  deadline = time.monotonic() + 10
  while tasks_of(65534) > nobody_before and time.monotonic() < deadline:
    time.sleep(0.05)
  assert tasks_of(65534) <= nobody_before


# ------------------------------------------------------------------ escapes, host-side evidence

ESCAPES = r'''
import os, signal, socket, sys, threading
VICTIM, PATHS, ABSTRACT, SECRETS, HOST_TMP = {victim}, {paths!r}, {abstract!r}, {secrets!r}, {host_tmp!r}
def attempt(name, fn):
  try:
    fn()
    print(name, "done")
  except BaseException as e:
    print(name, "refused", type(e).__name__)
def send_unix(address, kind=socket.SOCK_STREAM):
  s = socket.socket(socket.AF_UNIX, kind)
  if kind == socket.SOCK_STREAM:
    s.connect(address)
    s.sendall(b"escaped")
  else:
    s.sendto(b"escaped", address)
for i, path in enumerate(PATHS):
  attempt(f"unix-path-{{i}}", lambda: send_unix(path))
  attempt(f"unix-dgram-{{i}}", lambda: send_unix(path + ".dgram", socket.SOCK_DGRAM))
attempt("unix-abstract", lambda: send_unix("\0" + ABSTRACT))
attempt("kill", lambda: os.kill(VICTIM, signal.SIGKILL))
attempt("pidfd", lambda: signal.pidfd_send_signal(os.pidfd_open(VICTIM), signal.SIGKILL))
attempt("victim-proc", lambda: open(f"/proc/{{VICTIM}}/environ", "rb").read())
for i, path in enumerate(SECRETS):
  attempt(f"read-{{i}}", lambda: open(path).read())
attempt("write-host-tmp", lambda: open(os.path.join(HOST_TMP, "planted.txt"), "w").write("x"))
attempt("write-dirfd-tmp", lambda: os.open("planted-dirfd.txt", os.O_CREAT | os.O_WRONLY,
                                          dir_fd=os.open(HOST_TMP, os.O_RDONLY)))
attempt("write-stdlib", lambda: open(os.path.join(os.path.dirname(os.__file__), "planted_rljax.py"), "w").write("x"))
try:
  if os.uname().machine != "x86_64":
    raise ImportError("the syscall numbers below are x86_64's")
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)
  def syscall(*args):
    if libc.syscall(*args) != 0:
      raise OSError(ctypes.get_errno(), "refused")
  # x86_64 numbers: tgkill 234, tkill 200, ptrace 101 (PTRACE_ATTACH 16), io_uring_setup
  # 425, unshare 272 (CLONE_NEWUSER), process_vm_readv 310
  attempt("tgkill", lambda: syscall(234, VICTIM, VICTIM, 9))
  attempt("tkill", lambda: syscall(200, VICTIM, 9))
  attempt("ptrace", lambda: syscall(101, 16, VICTIM, 0, 0))
  attempt("io_uring", lambda: syscall(425, 8, ctypes.create_string_buffer(120)))
  attempt("unshare-user", lambda: syscall(272, 0x10000000))
except (ImportError, PermissionError):  # audit_hook: ctypes refused (seccomp is tested below)
  pass
count = [0]
def spawn():
  for _ in range(200):
    try:
      threading.Thread(target=threading.Event().wait, args=(3,), daemon=True).start()
      count[0] += 1
    except RuntimeError:
      break
spawn()
print("threads", count[0])
written = 0
try:
  for i in range(100):
    with open(f"fill{{i}}", "wb") as f:
      f.write(b"x" * (1 << 20))
    written += 1
except OSError:
  pass
print("disk_mib", written)
'''


@pytest.fixture(scope="module")
def host():
  """Host-side witnesses: unix listeners (stream and datagram) at paths with mode 0777
  in the host's temp directory and in /dev/shm, an abstract one, a victim process of the
  host's uid, files the sandbox must not read; each records what reached it."""
  tmp = tempfile.mkdtemp(prefix="rljax-test-host-")
  os.chmod(tmp, 0o777)
  dirs = [tmp] + ([tempfile.mkdtemp(prefix="rljax-test-host-", dir="/dev/shm")]
                  if os.path.isdir("/dev/shm") else [])
  received, listeners, paths = [], [], []
  abstract = f"rljax-sandbox-test-{uuid.uuid4().hex}"
  for d in dirs:
    os.chmod(d, 0o777)
    path = os.path.join(d, "host.sock")
    stream = socket.socket(socket.AF_UNIX)
    stream.bind(path)
    stream.listen(8)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(path + ".dgram")
    for p in (path, path + ".dgram"):
      os.chmod(p, 0o777)
    listeners += [stream, dgram]
    paths.append(path)
  ab = socket.socket(socket.AF_UNIX)
  ab.bind("\0" + abstract)
  ab.listen(8)
  listeners.append(ab)
  stop = threading.Event()

  def watch():
    for s in listeners:
      s.settimeout(0.05)
    while not stop.is_set():
      for s in listeners:
        try:
          if s.type == socket.SOCK_DGRAM:
            received.append(s.recv(64))
          else:
            conn, _ = s.accept()
            received.append(conn.recv(64) or b"<connected>")
        except (socket.timeout, OSError):
          pass

  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  victim = subprocess.Popen(["sleep", "600"], env={"SECRET": "host-environ"})
  secret_dir = tempfile.mkdtemp(prefix="rljax-test-secret-")  # 0700, the host's
  secrets = [os.path.join(secret_dir, "secret.txt")] + [
      os.path.join(d, "readable.txt") for d in dirs]  # world-readable, host tmp and shm
  for p in secrets:
    with open(p, "w", encoding="ascii") as f:
      f.write("host secret")
  for p in secrets[1:]:
    os.chmod(p, 0o644)
  try:
    yield dict(victim=victim, paths=paths, abstract=abstract, secrets=secrets, tmp=tmp,
               received=received)
  finally:
    stop.set()
    watcher.join()
    victim.kill()
    victim.wait()
    for s in listeners:
      s.close()
    for d in dirs + [secret_dir]:
      shutil.rmtree(d, ignore_errors=True)


def escape_report(host, mode, limits):
  code = ESCAPES.format(victim=host["victim"].pid, paths=host["paths"],
                        abstract=host["abstract"], secrets=host["secrets"],
                        host_tmp=host["tmp"])
  r = run(code, limits, isolation=mode)
  # audit_hook: the host's disk poll may end the run while it fills its directory
  assert r.status == "ok" or (mode, r.status) == ("audit_hook", "disk_limit"), r
  lines = [line.split(" ", 1) for line in r.stdout.splitlines() if " " in line]
  return {k: v for k, v in lines}, r


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_no_escape_from_inside(mode, host):
  """Every escape class from inside the sandbox, each with the host's evidence: the
  listeners received nothing, the victim lives, nothing was planted or read."""
  limits = SandboxLimits(max_processes=8, disk_bytes=4 * sandbox_limits.MiB, wall_s=8)
  report, r = escape_report(host, mode, limits)
  time.sleep(0.2)  # the watcher's last round
  assert host["received"] == [], (host["received"], report)
  assert host["victim"].poll() is None, report  # alive
  denied = [k for k in report if k not in ("threads", "disk_mib")]
  expected = {"unix-path-0", "unix-dgram-0", "unix-abstract", "kill", "pidfd", "victim-proc",
              "read-0", "write-host-tmp", "write-dirfd-tmp", "write-stdlib"}
  if mode == "namespaces":
    expected |= {"read-1"} | ({"tgkill", "tkill", "ptrace", "io_uring", "unshare-user"}
                              if os.uname().machine == "x86_64" else set())
  assert expected <= set(report), report
  # audit_hook: world-readable host files stay readable; without Landlock, so do
  # dir_fd-relative writes to world-writable host directories (documented)
  open_here = {"read-1", "read-2"} | (set() if LANDLOCK else {"write-dirfd-tmp"})
  leaked = {k: report[k] for k in denied
            if not report[k].startswith("refused") and not (mode == "audit_hook" and k in open_here)}
  assert leaked == {}, report
  for planted in ("planted.txt", "planted-dirfd.txt"):
    if mode == "namespaces" or LANDLOCK or planted == "planted.txt":
      assert not os.path.exists(os.path.join(host["tmp"], planted))
  assert not os.path.exists(os.path.join(os.path.dirname(os.__file__), "planted_rljax.py"))
  # the thread limit holds (RLIMIT_NPROC of a uid of its own: the main thread counts)
  assert int(report["threads"]) < 8, report
  if mode == "namespaces":  # the working directory's tmpfs is disk_bytes
    assert int(report["disk_mib"]) < 4, report
  else:  # no tmpfs: the host's measure (during the run or at its end) ends it
    assert r.status == "disk_limit", (r, report)


def test_episodes_do_not_see_each_other_or_persist():
  """Two episodes at once: neither reads nor writes the other's files; nothing one writes
  outlives it for the next."""
  for mode in MODES:
    if mode == "audit_hook" and FALLBACK_REFUSED:  # here: not in the thread below
      pytest.skip(SKIP_REFUSED)
    first = threading.Thread(target=lambda: results.update(a=run(
        "import os, time\nopen('mine.txt', 'w').write('a')\nprint(os.getcwd(), flush=True)\n"
        "time.sleep(1.2)\nprint(open('mine.txt').read())", isolation=mode)))
    results = {}
    first.start()
    time.sleep(0.6)
    probe = ("import glob, os, tempfile\n"
             "mine = os.getcwd()\n"
             "seen = [p for p in glob.glob('/tmp/rljax-sandbox-*/*') + "
             "glob.glob(os.path.dirname(mine) + '/rljax-sandbox-*/*') "
             "if not p.startswith(mine)]\n"
             "got = []\n"
             "for p in seen:\n"
             "  try:\n"
             "    got.append(open(p).read()); open(p, 'w').write('b')\n"
             "  except OSError:\n"
             "    pass\n"
             "print(got)\n")
    r = run(probe, isolation=mode)
    first.join()
    assert r.status == "ok" and r.stdout == "[]\n", (mode, r)
    a = results["a"]
    assert a.status == "ok" and a.stdout.splitlines()[-1] == "a", (mode, a)
    # the next episode starts clean
    r = run("import os\nprint(sorted(os.listdir('.')))", isolation=mode)
    assert r.stdout == "['main.py']\n", (mode, r)


def test_attribution_route_by_route():
  """Which ends of a run are the host's (infra_error, with its reason) and which the
  program's: decided from the launcher's and supervisor's reports."""
  limits, started = SandboxLimits(), b'{"started": true}\n'
  result = sandbox_host._result  # pylint: disable=protected-access

  def of(status, killed_for=None, code=0):
    return result(b"", b"", status, killed_for, limits, 0.1, "namespaces", code)

  # host: setup failed, or the program never started
  r = of(b'{"setup_error": "mount /tmp: EPERM"}\n', code=1)
  assert r.status == "infra_error" and "mount /tmp" in r.infra_error
  r = of(started + b'{"setup_error": "starting the program: OSError: x"}\n')
  assert r.status == "infra_error" and "starting the program" in r.infra_error
  r = of(b"", code=1)
  assert r.status == "infra_error" and "before starting the program" in r.infra_error
  r = of(b"", killed_for="timeout")
  assert r.status == "infra_error" and "did not start" in r.infra_error
  # the program: it started and its supervisor ended without a report (killed by it)
  r = of(started, code=-9)
  assert (r.status, r.infra_error) == ("error", None) and "own supervisor" in r.detail
  r = of(started, killed_for="timeout")
  assert r.status == "timeout"
  wait = lambda sig: started + json.dumps({"wait_status": sig, "cpu_s": 0.1}).encode()
  for sig, name in ((signal.SIGKILL, "SIGKILL"), (signal.SIGSEGV, "SIGSEGV"),
                    (signal.SIGABRT, "SIGABRT"), (signal.SIGTERM, "SIGTERM")):
    r = of(wait(sig))
    assert (r.status, r.signal, r.infra_error) == ("error", sig, None), r
    assert r.detail == f"killed by {name}"


SECCOMP_CHILD = r"""
import ctypes, os, signal, socket, sys
sys.path.insert(0, sys.argv[1])
import sandbox_seccomp
victim = int(sys.argv[2])
os.setpgid(0, 0)  # a group of its own: kill(0) would hit nothing of the test's
libc = ctypes.CDLL(None, use_errno=True)
prctl = libc.prctl(38, 1, 0, 0, 0)  # no_new_privs: what lets an unprivileged process filter
sandbox_seccomp.install(sys.argv[3], os.getpid())
out = {}
def attempt(name, fn):
  try:
    fn()
    out[name] = "done"
  except OSError as e:
    out[name] = e.errno
def syscall(*args):
  if libc.syscall(*args) != 0:
    raise OSError(ctypes.get_errno(), "refused")
attempt("socket-unix", lambda: socket.socket(socket.AF_UNIX))
attempt("socketpair", lambda: socket.socketpair())
attempt("kill-victim", lambda: os.kill(victim, 0))
attempt("kill-group", lambda: os.kill(0, 0))
attempt("kill-all", lambda: os.kill(-1, 0))
attempt("kill-parent", lambda: os.kill(os.getppid(), 0))
attempt("kill-self", lambda: os.kill(os.getpid(), 0))
attempt("pidfd", lambda: os.pidfd_open(victim))
attempt("tgkill", lambda: syscall(234, victim, victim, 0))
attempt("tkill", lambda: syscall(200, victim, 0))
attempt("rt_sigqueueinfo", lambda: syscall(129, victim, 0, ctypes.create_string_buffer(128)))
attempt("ptrace", lambda: syscall(101, 16, victim, 0, 0))
attempt("process_vm_readv", lambda: syscall(310, victim, 0, 0, 0, 0, 0))
attempt("io_uring", lambda: syscall(425, 8, ctypes.create_string_buffer(120)))
attempt("unshare-user", lambda: syscall(272, 0x10000000))
attempt("clone3", lambda: syscall(435, 0, 0))
attempt("f_setown", lambda: __import__("fcntl").fcntl(os.pipe()[0], 8, victim))
attempt("fiosetown", lambda: __import__("fcntl").ioctl(socket.socketpair()[0], 0x8901,
                                                       ctypes.c_int(victim)))
attempt("shmget", lambda: syscall(29, 0, 4096, 0o1666))  # IPC_PRIVATE, IPC_CREAT | 0666
attempt("msgget", lambda: syscall(68, 0, 0o1666))
attempt("thread", lambda: __import__("threading").Thread(target=print).start())
attempt("rt_tgsigqueueinfo", lambda: syscall(297, victim, victim, 0,
                                              ctypes.create_string_buffer(128)))
# the rest of the refused list (x86_64 numbers), each with zero arguments
for name, nr in (("pidfd_getfd", 438), ("process_vm_writev", 311), ("kcmp", 312),
                 ("setns", 308), ("mount", 165), ("umount2", 166), ("pivot_root", 155),
                 ("chroot", 161), ("bpf", 321), ("perf_event_open", 298),
                 ("userfaultfd", 323), ("keyctl", 250), ("add_key", 248),
                 ("request_key", 249), ("open_by_handle_at", 304),
                 ("name_to_handle_at", 303), ("personality", 135), ("semget", 64),
                 ("mq_open", 240), ("io_uring_enter", 426), ("io_uring_register", 427)):
  attempt(name, lambda: syscall(nr, 0, 0, 0, 0, 0))
print(__import__("json").dumps(out))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers are x86_64's")
@pytest.mark.parametrize("mode", ["namespaces", "audit_hook"])
def test_seccomp_filter_refuses_what_no_hook_sees(mode, host):
  """The filter on its own (as if the audit hook were bypassed, ctypes allowed): a
  process that installed it cannot open unix sockets or reach other processes; in
  audit_hook mode (no pid namespace) not even its group, parent or pid -1."""
  victim = host["victim"].pid
  child = subprocess.run([sys.executable, "-I", "-c", SECCOMP_CHILD,
                          os.path.dirname(sandbox.__file__), str(victim), mode],
                         capture_output=True, text=True, timeout=30, check=False)
  assert child.returncode == 0, child.stderr
  out = json.loads(child.stdout)
  eperm, enosys = 1, 38
  refused = ["socket-unix", "pidfd", "ptrace", "process_vm_readv", "io_uring",
             "unshare-user", "f_setown", "fiosetown", "shmget", "msgget", "pidfd_getfd",
             "process_vm_writev", "kcmp", "setns", "mount", "umount2", "pivot_root", "chroot",
             "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
             "open_by_handle_at", "name_to_handle_at", "personality", "semget", "mq_open",
             "io_uring_enter", "io_uring_register"]
  if mode == "audit_hook":
    refused += ["kill-victim", "kill-group", "kill-all", "kill-parent", "tgkill", "tkill",
                "rt_sigqueueinfo", "rt_tgsigqueueinfo"]
  assert {k: out[k] for k in refused} == dict.fromkeys(refused, eperm), out
  assert out["clone3"] == enosys  # glibc falls back to clone, whose flags are checked
  assert out["socketpair"] == out["kill-self"] == out["thread"] == "done", out
  assert host["victim"].poll() is None and host["received"] == []


def test_fallback_disk_use_is_bounded():
  """audit_hook has no tmpfs: bytes past disk_bytes, or too many files, end the run
  (disk_limit, the program's failure) within the host's 50 ms poll."""
  limits = SandboxLimits(disk_bytes=4 * sandbox_limits.MiB, max_file_bytes=16 * sandbox_limits.MiB,
                         wall_s=8)
  big = ("import os\nfor i in range(64):\n  with open(f'f{i}', 'wb') as f:\n"
         "    f.write(b'x' * (1 << 20))\nimport time\ntime.sleep(5)")
  r = run(big, limits, isolation="audit_hook")
  assert (r.status, r.infra_error) == ("disk_limit", None) and r.wall_s < 4, r
  many = "import os, time\nfor i in range(10**6):\n  open(f'e{i}', 'w').close()\ntime.sleep(5)"
  r = run(many, limits, isolation="audit_hook")
  assert r.status == "disk_limit", r  # not the wall-time kill
  r = run("open('x', 'wb').write(b'x' * (5 << 20))", limits, isolation="audit_hook")
  # RLIMIT_FSIZE <= disk_bytes: the write stops at 4 MiB (EFBIG), unless the poll saw the
  # file's 4 MiB (and a block of metadata) first; the program's failure either way
  assert r.status in ("error", "disk_limit") and r.infra_error is None, r
  assert r.status == "disk_limit" or "File too large" in r.stderr, r


# ------------------------------------------------------------------ the minimal root (namespaces)

ROOT_PROBE = r"""
import json, os, socket, sys
PATHS, SKIP = {paths!r}, {skip!r}
out = {{}}
def look(name, fn):
  try:
    out[name] = ["seen", repr(fn())[:120]]
  except OSError as e:
    out[name] = ["refused", e.errno]
for name, path in PATHS.items():
  look("stat:" + name, lambda: os.stat(path).st_mode)
  look("read:" + name, lambda: open(path, "rb").read(64))
  look("dotdot:" + name, lambda: open("../" * 12 + path.lstrip("/"), "rb").read(64))
  for via in ("/proc/self/root", "/proc/1/root", "/proc/self/cwd/../..", "/dev/fd/../root"):
    look(via + ":" + name, lambda: open(via + path, "rb").read(64))
  look("dirfd:" + name, lambda: os.open(path.lstrip("/"), os.O_RDONLY,
                                        dir_fd=os.open("/", os.O_RDONLY | os.O_DIRECTORY)))
  os.symlink(path, "link-" + str(len(out)))
  look("symlink:" + name, lambda: open("link-" + str(len(out) - 1), "rb").read(64))
files = []  # every file outside the stdlib, /proc, /dev and the working directory
for top, dirs, names in os.walk("/"):
  dirs[:] = [d for d in dirs if os.path.join(top, d) not in SKIP]
  files += [os.path.join(top, n) for n in names]
here = os.path.dirname(os.path.realpath(sys.executable))
print(json.dumps({{"top": sorted(os.listdir("/")), "out": out, "files": sorted(files),
                  "bin": sorted(os.listdir(here)),
                  "site": sorted(os.listdir(os.path.join(os.path.dirname(os.__file__),
                                                         "site-packages"))),
                  "cwd": os.getcwd()}}))
"""


@pytest.fixture
def host_files(tmp_path):
  """World-readable host files the program must not see: in the repository (a planted one
  and its datasets), in a 0755 directory under /var/lib and /opt, /etc's, the venv's and
  the base interpreter's site-packages, this process through /proc."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  planted, made = [], []
  fd, repo_file = tempfile.mkstemp(prefix=".rljax-root-probe-", dir=os.path.dirname(__file__))
  os.write(fd, b"answer: 42")
  os.close(fd)
  planted.append(repo_file)
  paths = {"repo-file": repo_file, "repo-root": os.path.join(repo, "README.md"),
           "dataset": os.path.join(repo, "examples", "gsm_tiny", "train.jsonl"),
           "etc-passwd": "/etc/passwd", "etc-hostname": "/etc/hostname",
           "host-proc": f"/proc/{os.getpid()}/environ",
           "host-proc-root": f"/proc/{os.getpid()}/root{repo_file}",
           "site-packages": os.path.dirname(pytest.__file__),
           "venv-cfg": os.path.join(sys.prefix, "pyvenv.cfg"),
           "pytest-tmp": str(tmp_path / "secret.txt")}
  (tmp_path / "secret.txt").write_text("host secret")
  for parent in ("/var/lib", "/opt"):
    if os.path.isdir(parent) and os.access(parent, os.W_OK):
      d = tempfile.mkdtemp(prefix="rljax-root-probe-", dir=parent)
      os.chmod(d, 0o755)
      with open(os.path.join(d, "readable.txt"), "w", encoding="ascii") as f:
        f.write("host secret")
      made.append(d)
      paths[parent] = os.path.join(d, "readable.txt")
  for p in planted + [v for k, v in paths.items() if k in ("/var/lib", "/opt", "pytest-tmp")]:
    os.chmod(p, 0o644)
  try:
    yield paths
  finally:
    for p in planted:
      os.remove(p)
    for d in made:
      shutil.rmtree(d)


def test_minimal_root_shows_only_what_the_program_needs(host_files):
  """namespaces: the program's / holds the interpreter, its stdlib and shared libraries,
  /dev's few devices, its /proc and its working directory; every host file that the
  host's other users could read is absent however it is named."""
  if ISOLATION.mode != "namespaces":
    pytest.skip("needs namespaces")
  exe = os.path.realpath(sys.executable)
  stdlib = os.path.dirname(os.path.realpath(os.__file__))
  skip = ["/proc", "/dev", stdlib, os.path.realpath(tempfile.gettempdir())]
  code = ROOT_PROBE.format(paths=host_files, skip=skip)
  r = run(code)
  assert r.status == "ok", r
  seen = json.loads(r.stdout)
  # every path, every route: ENOENT (the host's /proc is not this pid namespace's);
  # /proc/1/root (the supervisor's root, the same minimal one): EACCES where it is root's
  leaked = {k: v for k, v in seen["out"].items()
            if v != ["refused", 2] and not (k.startswith("/proc/1/") and v == ["refused", 13])}
  assert leaked == {}, leaked
  tops = {p.split("/")[1] for p in (exe, stdlib, tempfile.gettempdir())}
  assert set(seen["top"]) <= tops | {"dev", "proc", "usr", "lib", "lib64", "lib32", "libx32"}
  assert not {"work", "home", "etc", "opt", "var", "srv", "mnt", "media", "run", "sys",
              "boot", "root"} - tops & set(seen["top"]), seen["top"]
  # the files outside the stdlib: the interpreter, shared libraries, the C.UTF-8 locale
  others = [p for p in seen["files"] if p != exe and ".so" not in os.path.basename(p)
            and not p.startswith("/usr/lib/locale/C.utf8/")]
  assert others == [], others
  assert seen["bin"] == [os.path.basename(exe)], seen["bin"]  # nothing beside it
  assert seen["site"] == []  # the base interpreter's site-packages: covered, empty


def test_minimal_root_runs_the_stdlib():
  if ISOLATION.mode != "namespaces":
    pytest.skip("needs namespaces")
  code = ("import datetime, decimal, hashlib, json, math, re, sqlite3, subprocess, sys, zlib\n"
          "import threading, tempfile, os\n"
          "print(json.dumps({'pi': round(math.pi, 3)}), re.sub('a+', 'b', 'caat'))\n"
          "print(decimal.Decimal(1) / 4, datetime.date(2024, 2, 29).isoformat())\n"
          "print(hashlib.sha256(b'x').hexdigest()[:8], len(zlib.compress(b'x' * 99)) < 99)\n"
          "print(sqlite3.connect(':memory:').execute('select 6 * 7').fetchone()[0])\n"
          "print(os.path.basename(tempfile.mkstemp()[1])[:3], 'é')\n"
          "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
          "for argv in (['ls', '/'], ['/bin/sh', '-c', 'cat /etc/passwd']):\n"
          "  try:\n"
          "    subprocess.run(argv)\n"
          "  except OSError as e:\n"
          "    print(type(e).__name__)\n"
          "print(open('/dev/urandom', 'rb').read(4).__len__(), open('/dev/null', 'w').write('x'))\n")
  r = run(code)
  assert r.status == "ok", r
  assert r.stdout.splitlines() == [
      '{"pi": 3.142} cbt', "0.25 2024-02-29", "2d711642 True", "42", "tmp é", "thread",
      "FileNotFoundError", "FileNotFoundError", "4 1"], r


def test_a_library_only_ld_so_cache_finds_brings_the_cache(tmp_path, monkeypatch):
  """sandbox_root: a DT_NEEDED library found in /etc/ld.so.conf's directories only (not a
  RUNPATH, not the loader's defaults) is bound with /etc/ld.so.cache, which the loader
  needs to find it; one in the defaults needs no cache (then there is no /etc)."""
  from rljax.envs import sandbox_root  # pylint: disable=import-outside-toplevel
  conf = tmp_path / "ld.so.conf"
  (tmp_path / "conf.d").mkdir()
  (tmp_path / "conf.d" / "a.conf").write_text("/opt/a  # a comment\n")
  conf.write_text(f"include {tmp_path}/conf.d/*.conf\n/usr/local/lib\n")
  assert sandbox_root._conf_dirs(str(conf)) == ["/opt/a", "/usr/local/lib"]  # pylint: disable=protected-access
  dynload = sandbox_root._stdlib()[1]  # pylint: disable=protected-access
  found = ((x, os.path.basename(p), p) for x in
           (os.path.join(d, n) for d in dynload for n in sorted(os.listdir(d)) if n.endswith(".so"))
           for p in sandbox_root._libraries(x, [])[0]  # pylint: disable=protected-access
           if os.path.basename(p) in sandbox_root._elf(x)[1]  # pylint: disable=protected-access
           and not os.path.basename(p).startswith(("libc.", "libm.", "libpthread.")))
  ext, name, lib = next(found, (None, None, None))
  if ext is None:
    pytest.skip("no stdlib extension module needs a library of its own here")
  assert sandbox_root._libraries(ext, [])[1] is False  # pylint: disable=protected-access
  # the same module, its library renamed (same length) and present only in a conf dir
  other = "q" * len(name)
  with open(ext, "rb") as f:
    data = f.read()
  assert b"\0" + name.encode() + b"\0" in data
  (tmp_path / "ext.so").write_bytes(data.replace(b"\0" + name.encode() + b"\0",
                                                 b"\0" + other.encode() + b"\0"))
  (tmp_path / "lib").mkdir()
  shutil.copy(lib, tmp_path / "lib" / other)
  monkeypatch.setattr(sandbox_root, "_conf_dirs", lambda: [str(tmp_path / "lib")])
  libraries, needs_cache = sandbox_root._libraries(str(tmp_path / "ext.so"), [])  # pylint: disable=protected-access
  assert needs_cache and str(tmp_path / "lib" / other) in libraries, libraries
  assert any(os.path.basename(p) == "libc.so.6" for p in libraries)  # its own, transitively
  if not ROOT:
    return  # the root below is built in a mount namespace of a root child
  enter = ("import ctypes, json, os, subprocess, sys\n"
           "sys.path.insert(0, sys.argv[1])\nimport sandbox_root as r\n"
           "real = r._libraries\nr._libraries = lambda *a: (real(*a)[0], True)\n"
           "assert ctypes.CDLL(None, use_errno=True).unshare(0x00020000) == 0\n"
           "exe = r.enter(sys.argv[2], 65534, 65534, 1 << 20)\n"
           "ran = subprocess.run([exe, '-I', '-S', '-c', 'print(6 * 7)'], capture_output=True)\n"
           "print(json.dumps([os.listdir('/etc'), open('/etc/ld.so.cache', 'rb').read(32).hex(),"
           " ran.stdout.decode()]))\n")
  (tmp_path / "work").mkdir()
  (tmp_path / "work" / "main.py").write_text("")
  child = subprocess.run([sys.executable, "-I", "-S", "-c", enter,
                          os.path.dirname(sandbox_root.__file__), str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=30, check=False)
  assert child.returncode == 0, child.stderr
  with open("/etc/ld.so.cache", "rb") as f:
    assert json.loads(child.stdout) == [["ld.so.cache"], f.read(32).hex(), "42\n"]
