#!/usr/bin/env python3
"""test_deploy.py: what `meson install` puts on a machine, and kvtierd as a service.

- install: `meson install --destdir` of this build holds kvtierd, the systemd unit and the
  example settings as /etc's kvtierd.conf; the installed kvtierd starts on that file;
- unit: `systemd-analyze verify` passes on the installed unit (with ExecStart pointed at the
  destdir's kvtierd, the only line changed), and ExecStart names the installed binary and file;
- notify: kvtierd speaks systemd's readiness protocol to $NOTIFY_SOCKET (a datagram socket this
  test listens on): READY=1 once it serves, RELOADING=1 then READY=1 around a SIGHUP,
  STOPPING=1 on a drain (SIGUSR1), after which it exits 0;
- container: `podman build` of deploy/Containerfile, only where podman and a debian:12 image
  are present (no registry is reachable from the test machines): skipped otherwise, saying why.

Prints "N passed, N failed, N skipped"; exits 1 on a failure, 77 when every check skipped."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

BUILD = os.environ.get("KVT_BUILD_ROOT", "build")
SOURCE = os.environ.get("KVT_SOURCE_ROOT", ".")
results = {"passed": 0, "failed": 0, "skipped": 0}


def check(name, fn):
    try:
        msg = fn()
    except Skip as e:
        results["skipped"] += 1
        print("SKIP %s: %s" % (name, e))
        return
    except Exception as e:  # an assertion, a timeout, a failed command
        results["failed"] += 1
        print("FAIL %s: %s: %s" % (name, type(e).__name__, e))
        return
    results["passed"] += 1
    print("ok   %s%s" % (name, ": " + msg if msg else ""))


class Skip(Exception):
    pass


def start(argv, env=None, cwd=None):
    """Starts kvtierd, returns (proc, lines it printed up to 'ready')."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=cwd)
    lines = []
    deadline = time.time() + 30
    for line in p.stdout:
        lines.append(line.strip())
        if line.strip() == "ready" or time.time() > deadline:
            break
    if "ready" not in lines:
        p.kill()
        raise AssertionError("kvtierd did not start: %s %s" % (lines, p.stderr.read()[-500:]))
    return p, lines


def stop(p, sig=signal.SIGTERM):
    p.send_signal(sig)
    rc = p.wait(timeout=30)
    p.stdout.close()
    p.stderr.close()
    return rc


tmp = tempfile.mkdtemp(prefix="kvt-deploy-", dir=os.environ.get("TMPDIR"))
dest = os.path.join(tmp, "dest")
installed = {}


def test_install():
    r = subprocess.run(["meson", "install", "-C", BUILD, "--destdir", dest, "--no-rebuild"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-1000:]
    for d, _, files in os.walk(dest):
        for f in files:
            installed.setdefault(f, os.path.join(d, f))
    for f in ("kvtierd", "kvtierd.service", "kvtierd.conf", "kvtierd.conf.example"):
        assert f in installed, "meson install put no %s in %s" % (f, dest)
    assert installed["kvtierd.conf"].endswith(os.path.join("etc", "kvtier", "kvtierd.conf"))
    # The installed binary starts on the installed settings (ports and paths of its own here).
    run = os.path.join(tmp, "run")
    os.mkdir(run)
    p, _ = start([installed["kvtierd"], "--config", installed["kvtierd.conf"], "--tcp",
                  "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--dram-bytes", "16M",
                  "--nvme-bytes", "8M", "--nvme-segment-bytes", "1M", "--hbm-bytes", "0"],
                 cwd=run)
    rc = stop(p)
    assert rc == 0, "exit %d" % rc
    return "%d files under %s" % (sum(len(f) for _, _, f in os.walk(dest)), dest)


def test_unit():
    if "kvtierd.service" not in installed:
        raise Skip("nothing installed (the install check failed)")
    tool = shutil.which("systemd-analyze")
    if not tool:
        raise Skip("no systemd-analyze on this machine (Debian's systemd package has it)")
    unit = open(installed["kvtierd.service"]).read()
    exec_start = [l for l in unit.splitlines() if l.startswith("ExecStart=")]
    assert len(exec_start) == 1, exec_start
    binary = exec_start[0].split("=", 1)[1].split()[0]
    conf = exec_start[0].split("--config", 1)[1].split()[0]
    assert os.path.exists(dest + binary), "ExecStart names %s, not installed" % binary
    assert os.path.exists(dest + conf), "ExecStart reads %s, not installed" % conf
    assert "Type=notify" in unit and "ExecReload=" in unit and "ExecStop=" in unit
    here = os.path.join(tmp, "unit")
    os.mkdir(here)
    path = os.path.join(here, "kvtierd.service")
    with open(path, "w") as f:
        f.write(unit.replace("ExecStart=" + binary, "ExecStart=" + dest + binary))
    r = subprocess.run([tool, "verify", path], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    return "systemd-analyze verify: clean"


def test_notify():
    sock_path = os.path.join(tmp, "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(sock_path)
    s.settimeout(10)
    run = os.path.join(tmp, "notify")
    os.mkdir(run)
    env = dict(os.environ, NOTIFY_SOCKET=sock_path)
    exe = os.path.join(BUILD, "server", "kvtierd")
    p, _ = start([exe, "--tcp", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--dram-bytes",
                  "16M", "--nvme-bytes", "0", "--hbm-bytes", "0", "--log-level", "warn"],
                 env=env, cwd=run)
    try:
        got = [s.recv(256).decode()]
        assert got == ["READY=1"], got
        p.send_signal(signal.SIGHUP)
        got += [s.recv(256).decode(), s.recv(256).decode()]
        assert got[1:] == ["RELOADING=1", "READY=1"], got
        p.send_signal(signal.SIGUSR1)
        got.append(s.recv(256).decode())
        assert got[3] == "STOPPING=1", got
        rc = p.wait(timeout=30)
        assert rc == 0, "the drain with no client left exits 0, not %d" % rc
    finally:
        if p.poll() is None:
            p.kill()
        s.close()
    return " -> ".join(got) + ", exit 0"


def test_container():
    tool = shutil.which("podman") or shutil.which("buildah")
    if not tool:
        raise Skip("neither podman nor buildah is installed: the Containerfile is not built here")
    r = subprocess.run([tool, "image", "exists", "debian:12"], capture_output=True)
    if r.returncode != 0:
        raise Skip("no debian:12 image on this machine and no registry to pull it from")
    r = subprocess.run([tool, "build", "-f", os.path.join(SOURCE, "deploy", "Containerfile"),
                        "-t", "kvtier-test", SOURCE], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return "built"


try:
    check("install", test_install)
    check("unit", test_unit)
    check("notify", test_notify)
    check("container", test_container)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
print("%(passed)d passed, %(failed)d failed, %(skipped)d skipped" % results)
sys.exit(1 if results["failed"] else 77 if not results["passed"] else 0)
