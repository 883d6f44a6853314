"""pybench.py: what the Python benchmarks (bench_client.py, bench_vllm.py) share: running under
the test venv that scripts/pyenv.sh makes (BUILD/pyenv, with numpy, cffi, torch and the engines),
and a kvtierd of their own, started fresh in a temporary directory with only a DRAM tier."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


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


class Daemon:
    """A kvtierd with a DRAM tier of dram_bytes (and an NVMe tier of nvme_bytes, sparse, when
    not "0"), on a Unix socket only (unix is its path); stop() ends it by its PID and removes
    its directory."""

    def __init__(self, build: str, prefix: str, dram_bytes: str, nvme_bytes: str = "0") -> None:
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.log = open(os.path.join(self.dir, "kvtierd.log"), "w")
        self.proc = subprocess.Popen(
            [os.path.join(build, "server", "kvtierd"), "--tcp", "", "--metrics", "",
             "--dram-bytes", dram_bytes, "--nvme-bytes", nvme_bytes, "--nvme-sparse", "yes",
             "--hbm-bytes", "0", "--log-level", "warn"],
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
