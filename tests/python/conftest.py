"""conftest.py: fixtures that start a real kvtierd ($KVT_BUILD_ROOT/server/kvtierd) in a
temporary directory (its Unix socket there, TCP and metrics on ports the kernel picks, no HBM
tier) and stop it by its PID; and clients of it. The package is imported from the source tree
(python/), so the tests check the code as it is now; test_install checks the installed copy."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, List, Optional

import pytest

SOURCE_ROOT = os.environ.get(
    "KVT_SOURCE_ROOT", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BUILD_ROOT = os.environ.get("KVT_BUILD_ROOT", os.path.join(SOURCE_ROOT, "build"))
os.environ.setdefault("KVT_BUILD_ROOT", BUILD_ROOT)
sys.path.insert(0, os.path.join(SOURCE_ROOT, "python"))

import kvtier  # noqa: E402

# A daemon dies with the test process that started it (as tests/test_server_harness.h does): a
# pytest that crashes leaves no kvtierd behind. Looked up before any fork, so that the child runs
# only the one call between fork and exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# The stall tests' bar: a step takes no longer than the same step without a daemon plus the
# deadline plus STALL_SLACK. 20 ms is the bar issue 35 sets, checked in the release build; under
# AddressSanitizer (libkvtier and kvtierd instrumented, several times slower) on a 2-core machine
# shared with the other tests only the bound itself is checked, with 150 ms of slack.
STALL_SLACK = 0.150 if os.environ.get("KVT_PYTEST_SANITIZED") else 0.020

PAGE = 16  # tokens per page
BLOCK = 4096  # bytes per page


class Daemon:
    """kvtierd in a fresh directory; stop() signals it by PID and checks its clean exit."""

    def __init__(self, *extra: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvt-pytest-", dir=os.environ.get("TMPDIR"))
        self.log_path = os.path.join(self.dir, "kvtierd.log")
        self.log = open(self.log_path, "w")
        exe = os.path.join(BUILD_ROOT, "server", "kvtierd")
        env = dict(os.environ)
        if os.environ.get("KVT_DAEMON_ASAN_OPTIONS") is not None:  # tests/python/run.py
            env["ASAN_OPTIONS"] = os.environ["KVT_DAEMON_ASAN_OPTIONS"]
        self.proc = subprocess.Popen(
            [exe, "--tcp", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--dram-bytes", "16M",
             "--nvme-bytes", "8M", "--nvme-segment-bytes", "1M", "--hbm-bytes", "0",
             "--log-level", "warn",
             # index-prefault 0: the default fills all of index-bytes (1G) at start, too dear for
             # every test's daemon (test_server_harness.h does the same)
             "--index-prefault", "0",
             # KVT_TEST_LOOPS=N: N event loops (as test_server_harness.h and faults.py read it)
             *(["--loops", os.environ["KVT_TEST_LOOPS"]] if os.environ.get("KVT_TEST_LOOPS") else []),
             *extra],
            cwd=self.dir, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
            preexec_fn=_die_with_parent)
        self.unix: Optional[str] = None
        self.tcp: Optional[str] = None
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("unix "):
                self.unix = os.path.join(self.dir, line.split(" ", 1)[1].strip())
            elif line.startswith("tcp "):
                self.tcp = line.split(" ", 1)[1].strip()
            elif line.strip() == "ready":
                break
        if not self.unix:
            self.proc.kill()
            raise RuntimeError("kvtierd did not start (see %s)" % self.log_path)

    def client(self, model: str = "pytest", **kw) -> kvtier.Client:
        kw.setdefault("page_size", PAGE)
        kw.setdefault("block_bytes", BLOCK)
        return kvtier.Client(model, unix_path=self.unix, **kw)

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOPs the daemon and returns once every one of its threads is stopped: kill()
        returns before the kernel has stopped threads running on other CPUs, and with several
        event loops one of them could still answer a request sent right after."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        tasks = "/proc/%d/task" % self.proc.pid
        end = time.monotonic() + timeout
        while True:
            states = []
            for t in os.listdir(tasks):
                try:
                    with open("%s/%s/stat" % (tasks, t)) as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except OSError:  # a thread that exited meanwhile
                    continue
            if all(st in ("T", "t") for st in states):
                return
            if time.monotonic() > end:
                raise TimeoutError("kvtierd %d: threads not stopped: %s" % (self.proc.pid, states))
            time.sleep(0.001)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        rc = self.proc.wait(timeout=30)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hostpool: needs SGLang modules that import torchvision (its host KV pool, "
        "its scheduler's cache); the meson test python_sglang_hostpool runs these in "
        "build/pyenv-sglang")


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    assert d.stop() == 0, "kvtierd's clean shutdown exits 0"


@pytest.fixture
def client(daemon: Daemon) -> Iterator[kvtier.Client]:
    with daemon.client() as c:
        yield c


@pytest.fixture
def vd() -> Iterator[Daemon]:
    """A daemon of the test's own (the engine connectors' tests: test_vllm, test_vllm_hma), which
    a test may stop, freeze or kill; killed at the end, whatever state it is in."""
    d = Daemon()
    yield d
    d.stop(signal.SIGKILL)


_base = [1_000_000]


def tokens(pages: int, extra: int = 0) -> List[int]:
    """Token ids of `pages` whole pages (plus `extra` tokens of a partial one), unique to each
    call so that tests do not see each other's pages."""
    _base[0] += 100_000
    return list(range(_base[0], _base[0] + pages * PAGE + extra))


def payload(pages: int, seed: int) -> bytes:
    """pages x BLOCK bytes, different per page and seed."""
    ramp = bytes(range(256)) * (BLOCK // 256)
    return b"".join(ramp[k:] + ramp[:k] for k in ((seed * 31 + p * 7) % 256 for p in range(pages)))
