"""pybench.py: what the Python benchmarks (bench_client.py, bench_vllm.py) share: running under
the test venv that scripts/pyenv.sh makes (BUILD/pyenv, with numpy, cffi, torch and the engines),
a kvtierd of their own, started fresh in a temporary directory with only a DRAM tier (and any
further settings), and for bench_fleet.py a loopback Redis Cluster (Cluster: the same recipe as
the tests' tests/test_cluster.h)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, List, Sequence


def run_in_venv(build: str, name: str, missing_rc: int, venv: str = "pyenv") -> None:
    """Re-executes the calling script under BUILD/VENV's Python (BUILD/pyenv unless named)
    unless it already runs there; exits with missing_rc (77: skipped) when there is no such
    venv. On return the package in the source tree's python/ is importable and KVT_BUILD_ROOT
    is set."""
    venv_py = os.path.join(build, venv, "bin", "python")
    if os.path.realpath(sys.prefix) != os.path.realpath(os.path.join(build, venv)):
        if not os.access(venv_py, os.X_OK):
            print("%s: no %s (bash scripts/pyenv.sh makes it)" % (name, venv_py), file=sys.stderr)
            sys.exit(missing_rc)
        script = os.path.abspath(sys.argv[0])
        os.execv(venv_py, [venv_py, script, *sys.argv[1:]])
    source = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    sys.path.insert(0, os.path.join(source, "python"))
    os.environ.setdefault("KVT_BUILD_ROOT", build)



def run_here_or_in_venv(build: str, name: str, no_venv: bool) -> None:
    """run_in_venv(build, name, 77), or with ``no_venv`` (the GPU pack's runner, whose python
    is the GPU host's) this python, with the source tree's package importable and
    KVT_BUILD_ROOT set as run_in_venv leaves them."""
    if not no_venv:
        run_in_venv(build, name, 77)
        return
    source = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    sys.path.insert(0, os.path.join(source, "python"))
    os.environ.setdefault("KVT_BUILD_ROOT", build)


def torch_or_skip(name: str) -> Any:
    """torch, imported; without it the benchmark exits 77 (skipped), saying so."""
    try:
        import torch
    except ImportError as e:
        print("SKIP: %s needs torch (%s)" % (name, e))
        sys.exit(77)
    return torch

class Daemon:
    """A kvtierd with a DRAM tier of dram_bytes (and an NVMe tier of nvme_bytes, sparse, when
    not "0"), on a Unix socket only (unix is its path); stop() ends it by its PID and removes
    its directory."""

    def __init__(self, build: str, prefix: str, dram_bytes: str, nvme_bytes: str = "0",
                 extra: Sequence[str] = ()) -> None:
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.log = open(os.path.join(self.dir, "kvtierd.log"), "w")
        self.proc = subprocess.Popen(
            [os.path.join(build, "server", "kvtierd"), "--tcp", "", "--metrics", "",
             "--dram-bytes", dram_bytes, "--nvme-bytes", nvme_bytes, "--nvme-sparse", "yes",
             "--hbm-bytes", "0", "--log-level", "warn", *extra],
            cwd=self.dir, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.unix = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("unix "):
                self.unix = os.path.join(self.dir, line.split(" ", 1)[1].strip())
            if line.strip() == "ready":
                break
        if not self.unix:
            raise RuntimeError("kvtierd did not start (%s/kvtierd.log)" % self.dir)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    """A loopback port that is free, whose cluster bus port (+10000) is free too."""
    for _ in range(1000):
        port = random.randint(20000, 45000)
        ok = True
        for p in (port, port + 10000):
            with socket.socket() as sk:
                try:
                    sk.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no free port pair")


class Cluster:
    """A Redis Cluster on loopback: 3 primaries and 3 replicas (cluster-node-timeout 1000 ms,
    no persistence) in a temporary directory, joined with redis-cli --cluster create; stop()
    kills the nodes by PID. seeds is "127.0.0.1:P,..." (every node). Raises FileNotFoundError
    without redis-server and redis-cli on PATH, RuntimeError when the cluster does not form."""

    NODES = 6

    def __init__(self) -> None:
        server, self.cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if not server or not self.cli:
            raise FileNotFoundError("redis-server and redis-cli are needed")
        self.dir = tempfile.mkdtemp(prefix="kvt-fleet-cluster.")
        self.ports: List[int] = []
        self.procs: List[subprocess.Popen] = []
        try:
            for _ in range(self.NODES):
                port = _free_port()
                self.ports.append(port)
                self.procs.append(subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", self.dir, "--logfile", "redis-%d.log" % port,
                     "--cluster-enabled", "yes", "--cluster-config-file", "nodes-%d.conf" % port,
                     "--cluster-node-timeout", "1000"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for port in self.ports:
                self._wait(lambda: "redis_version" in self.cmd(port, "INFO", "server"), 5)
            subprocess.run([self.cli, "--cluster", "create",
                            *["127.0.0.1:%d" % p for p in self.ports],
                            "--cluster-replicas", "1", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._wait(self._whole, 10)
        except BaseException:
            self.stop()
            raise
        self.seeds = ",".join("127.0.0.1:%d" % p for p in self.ports)

    def cmd(self, port: int, *words: str) -> str:
        """A command's reply on the node at port, as redis-cli prints it ("" if it fails)."""
        r = subprocess.run([self.cli, "-p", str(port), *words], capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else ""

    def primaries(self) -> List[int]:
        return [p for p in self.ports if "role:master" in self.cmd(p, "INFO", "replication")]

    def _whole(self) -> bool:
        for p in self.ports:
            info = self.cmd(p, "CLUSTER", "INFO") + self.cmd(p, "INFO", "replication")
            if "cluster_state:ok" not in info or not (
                    "role:master" in info or "master_link_status:up" in info):
                return False
        return True

    @staticmethod
    def _wait(cond, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not cond():
            if time.monotonic() > end:
                raise RuntimeError("the cluster did not form in %g s" % seconds)
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)


# The speed bars of issue 35, printed with pass or fail by bench_vllm, bench_sglang and
# bench_lmcache: each connector's save and load against the package's raw calls of the same
# bytes in the same run (the bar is on the warm median; the first pass is reported beside it),
# and the package's keyed PUT against its raw PUT (also with CPU-bound processes beside it:
# --busy 2).
CONNECTOR_BAR = 0.85
KEYED_PUT_BAR = 0.95


def verdict(ratio: float, bar: float) -> str:
    return "pass" if ratio >= bar else "fail"


class Busy:
    """n CPU-bound processes (a Python loop each) running beside a benchmark until stop():
    the "two CPU-bound processes running beside it" of the keyed PUT's bar."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []
