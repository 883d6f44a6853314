"""faults.py: kvtier's fault suite (issue 36): a real kvtierd, real sockets and a real
redis-server, hurt on purpose, with every page a client reads checked byte for byte.

    python3 tests/faults.py --short            # every fault, few loops (make test runs this)
    python3 tests/faults.py --long             # the long form of docs/faults.md
    python3 tests/faults.py --short --only soak,redis

The faults, one function each (FAULTS below):

  sigkill     kvtierd SIGKILLed during PUT bursts (one zero-copy writer, one over TCP), then
              restarted on the same data-dir (nvme-recover), in a loop: every acknowledged page
              (the PUT returned) is served byte-exact or reported missing, never wrong.
  files       flips and truncation of kvtier.data and of the side files (kvtier.meta,
              kvtier.live), and kvtier.data removed: the daemon either starts and serves no
              wrong byte, or refuses to start (exit 69) naming the file; never a crash or a hang.
  fullfs      the NVMe tier on a tmpfs that fills up (mounted in a private mount namespace:
              needs root, else skipped, saying so): PUTs go on (pages not stored are counted),
              no wrong bytes, writes resume when the file system grows, and a restart recovers.
  redis       the remote tier's redis-server SIGKILLed, restarted and SIGSTOPped under PUT and
              GET load: no wrong bytes, the daemon keeps serving (misses) and reconnects.
  reserve     clients SIGKILLed mid-reservation (zero-copy RESERVE, bytes half written): nothing
              becomes visible and the room returns.
  soak        connections mixing MATCH, PUT, GET, get_views, RELEASE, REMOVE, PREFETCH,
              RESERVE/COMMIT/ABORT and STATS over several namespaces; at the end RSS, the
              arenas (kvtier_zero_copy_arenas against the memfds in /proc/PID/fd), leases and
              the tiers' used bytes are reconciled and no protocol error was counted.

Payloads are deterministic per (namespace, sequence, page) (page_bytes), so a reader recomputes
what it must get. The last line printed is a JSON summary: faults injected, pages verified,
missing, wrong, and the daemon's memory at the end of the soak.

Needs the kvtier package's imports (cffi, numpy): run by a python3 without them it re-executes
itself with the venv scripts/pyenv.sh makes ($KVT_PYENV, $KVT_BUILD_ROOT/pyenv, build/pyenv),
and exits 77 (skipped) when there is none. kvtierd and libkvtier come from $KVT_BUILD_ROOT
(default build/); --sanitized LIBASAN for a build with AddressSanitizer (tests/meson.build
passes it). Every daemon's log is searched for sanitizer reports and failed assertions. Exit
status 0: every check held; 1: a check failed (printed, and the work directory kept).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.environ.get("KVT_SOURCE_ROOT", os.path.dirname(HERE))
BUILD_ROOT = os.environ.get("KVT_BUILD_ROOT", os.path.join(SOURCE_ROOT, "build"))


def _reexec_in_venv() -> None:
    """The package needs cffi and numpy: without them here, run again with the venv's python
    (looked up as tests/python/run.py does), or skip. --sanitized LIBASAN (the build carries
    AddressSanitizer): libasan must come first in the python process, as run.py explains, so
    the script runs again with it preloaded; the daemons get the build's ASAN_OPTIONS back."""
    py: Optional[str] = sys.executable
    try:
        import cffi  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        py = None
        for v in (os.environ.get("KVT_PYENV", ""), os.path.join(BUILD_ROOT, "pyenv"),
                  os.path.join(SOURCE_ROOT, "build", "pyenv")):
            if v and os.access(os.path.join(v, "bin", "python"), os.X_OK):
                py = os.path.join(v, "bin", "python")
                break
        if py is None or os.path.realpath(py) == os.path.realpath(sys.executable):
            print("SKIP: no Python environment with cffi and numpy (bash scripts/pyenv.sh build "
                  "makes build/pyenv)")
            sys.exit(77)
    asan = sys.argv[sys.argv.index("--sanitized") + 1] if "--sanitized" in sys.argv[:-1] else ""
    if asan and os.environ.get("KVT_FAULTS_SANITIZED") != "1":
        if not os.path.isabs(asan) or not os.path.exists(asan):
            print("SKIP: sanitizer build, but the compiler names no libasan to preload (%r)" % asan)
            sys.exit(77)
        os.environ["KVT_DAEMON_ASAN_OPTIONS"] = os.environ.get("ASAN_OPTIONS", "")
        os.environ["ASAN_OPTIONS"] = "detect_leaks=0:protect_shadow_gap=0:abort_on_error=1"
        os.environ["LD_PRELOAD"] = asan + " libstdc++.so.6"
        os.environ["KVT_FAULTS_SANITIZED"] = "1"
    elif py == sys.executable:
        return
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.execv(py, [py, os.path.abspath(__file__), *sys.argv[1:]])


_reexec_in_venv()
sys.path.insert(0, os.path.join(SOURCE_ROOT, "python"))
os.environ.setdefault("KVT_BUILD_ROOT", BUILD_ROOT)

import numpy as np  # noqa: E402

import kvtier  # noqa: E402

KVTIERD = os.path.join(BUILD_ROOT, "server", "kvtierd")
PAGE = 16  # tokens per page
BLOCK = 16384  # bytes per page
_libc = ctypes.CDLL(None, use_errno=True)


class Failure(Exception):
    """A check that did not hold."""


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failure(what)


def log(msg: str) -> None:
    print("%8.1f %s" % (time.monotonic() - T0, msg), flush=True)


T0 = time.monotonic()
TOTALS: Dict[str, Any] = {"faults_injected": 0, "pages_verified": 0, "pages_missing": 0,
                          "wrong_bytes": 0, "ops": 0}


SANITIZED = os.environ.get("KVT_FAULTS_SANITIZED") == "1"


def child_env(daemon: bool = False) -> Dict[str, str]:
    """The environment of a process the suite starts: kvtierd (sanitized: the build's own
    ASAN_OPTIONS, leak checks included) and redis-server get no libasan preloaded."""
    env = dict(os.environ)
    if SANITIZED:
        env.pop("LD_PRELOAD", None)
        if daemon:
            env["ASAN_OPTIONS"] = os.environ.get("KVT_DAEMON_ASAN_OPTIONS", "")
    return env


def _die_with_parent() -> None:
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no daemon outlives a killed suite


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# -- payloads ---------------------------------------------------------------------------------

def tokens_of(seq: int, pages: int) -> List[int]:
    """The token ids of sequence `seq` (a prefix of the same sequence for fewer pages)."""
    base = 1_000_000 + seq * 4096
    return list(range(base, base + pages * PAGE))


def page_bytes(ns: int, seq: int, page: int) -> bytes:
    """BLOCK bytes, different per namespace, sequence, page and 8-byte word: a torn, shifted,
    stale or foreign page never matches."""
    tag = np.uint64((ns * 0x9E3779B1 + seq * 0x85EBCA77 + page * 0xC2B2AE3D) & (2**63 - 1))
    return (np.arange(BLOCK // 8, dtype=np.uint64) * np.uint64(0x100000001B3) ^ tag).tobytes()


def seq_bytes(ns: int, seq: int, first: int, n: int) -> bytes:
    return b"".join(page_bytes(ns, seq, p) for p in range(first, first + n))


class Tally:
    """Pages a fault's readers checked: verified (byte-exact), missing, wrong (bytes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.verified = self.missing = self.wrong = self.errors = 0
        self.wrong_where: List[str] = []

    def add(self, verified: int = 0, missing: int = 0, wrong: int = 0, errors: int = 0,
            where: str = "") -> None:
        with self.lock:
            self.verified += verified
            self.missing += missing
            self.wrong += wrong
            self.errors += errors
            if wrong and len(self.wrong_where) < 10:
                self.wrong_where.append(where)

    def close(self, name: str) -> None:
        TOTALS["pages_verified"] += self.verified
        TOTALS["pages_missing"] += self.missing
        TOTALS["wrong_bytes"] += self.wrong
        log("%s: %d pages verified byte-exact, %d missing, %d wrong bytes%s" % (
            name, self.verified, self.missing, self.wrong,
            " (%d GETs answered with an error: their pages counted missing)" % self.errors
            if self.errors else ""))
        check(self.wrong == 0, "%s: wrong bytes served: %s" % (name, self.wrong_where))


def verify(c: kvtier.Client, ns: int, seq: int, pages: int, tally: Tally, *,
           remote: bool = False) -> None:
    """Reads sequence `seq`'s first `pages` pages back and checks each one it gets: the pages
    MATCH reports without bytes, or that GET does not return, are missing."""
    m = c.match(tokens_of(seq, pages), lease=True, remote=remote)
    try:
        have = 0
        while have < m.pages and m.tiers[have] != kvtier.Tier.NONE:
            have += 1
        got = 0
        if have:
            out = bytearray(have * BLOCK)
            try:
                got = c.get_into(m.lease, out, npages=have)
            except (kvtier.Unavailable, kvtier.Timeout, kvtier.Corrupt, kvtier.IOFailure) as e:
                if c.closed:
                    raise
                # A tier that cannot serve now (the remote server down or stopped): the GET
                # says so, and its pages are missing.
                tally.add(errors=1, where=type(e).__name__)
            for p in range(got):
                want = page_bytes(ns, seq, p)
                seen = out[p * BLOCK:(p + 1) * BLOCK]
                if seen == want:
                    tally.add(verified=1)
                else:
                    bad = int(np.count_nonzero(np.frombuffer(seen, np.uint8) !=
                                               np.frombuffer(want, np.uint8)))
                    tally.add(wrong=bad, where="ns %d seq %d page %d (%d bytes)" % (
                        ns, seq, p, bad))
        tally.add(missing=pages - got)
    finally:
        if m.lease:
            c.release(m.lease)


# -- the daemon -------------------------------------------------------------------------------

class Daemon:
    """kvtierd in directory `home` (socket, log, data-dir `data` unless given); killed with the
    suite."""

    def __init__(self, home: str, *extra: str, expect_ready: bool = True) -> None:
        self.home = home
        os.makedirs(home, exist_ok=True)
        self.log_path = os.path.join(home, "kvtierd.log")
        self.logf = open(self.log_path, "a")
        self.logf.write("---- start %s\n" % " ".join(extra))
        self.logf.flush()
        # KVT_TEST_LOOPS=N: every daemon with N event loops (tests/meson.build, faults_loops2).
        loops = ["--loops", os.environ["KVT_TEST_LOOPS"]] if os.environ.get("KVT_TEST_LOOPS") else []
        # index-prefault 0: the default fills all of index-bytes (1G) at start, which the soak's
        # RSS bound would count and every start would pay (test_server_harness.h does the same)
        args = [KVTIERD, "--tcp", "127.0.0.1:0", "--metrics", "", "--hbm-bytes", "0",
                "--log-level", "warn", "--index-prefault", "0", *loops, *extra]
        self.proc = subprocess.Popen(args, cwd=home, stdout=subprocess.PIPE, stderr=self.logf,
                                     text=True, env=child_env(True),
                                     preexec_fn=_die_with_parent)
        self.unix: Optional[str] = None
        self.tcp: Optional[str] = None
        self.ready = False
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("unix "):
                self.unix = os.path.join(home, line.split(" ", 1)[1].strip())
            elif line.startswith("tcp "):
                self.tcp = line.split(" ", 1)[1].strip()
            elif line.strip() == "ready":
                self.ready = True
                break
        if expect_ready and not self.ready:
            rc = self.proc.wait(timeout=30)
            raise Failure("kvtierd did not start (exit %s): %s" % (rc, self.log_tail()))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, ns: int = 0, *, tcp: bool = False, **kw: Any) -> kvtier.Client:
        kw.setdefault("page_size", PAGE)
        kw.setdefault("block_bytes", BLOCK)
        if tcp:
            return kvtier.Client("faults-%d" % ns, tcp=self.tcp, **kw)
        return kvtier.Client("faults-%d" % ns, unix_path=self.unix, **kw)

    def log_tail(self, n: int = 8) -> str:
        if not self.logf.closed:
            self.logf.flush()
        with open(self.log_path, errors="replace") as f:
            return " | ".join(ln.strip() for ln in f.readlines()[-n:])

    def kill(self, sig: int = signal.SIGKILL) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        rc = self.proc.wait(timeout=60)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.logf.close()
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        for mark in ("Sanitizer", "runtime error:", "assertion failed"):
            check(mark not in text, "kvtierd in %s wrote a %r report: %s" % (
                self.home, mark, text[text.find(mark) - 200:text.find(mark) + 800]))
        return rc

    def stop(self) -> None:
        rc = self.kill(signal.SIGTERM)
        check(rc == 0, "kvtierd's SIGTERM exit is 0, got %s: %s" % (rc, self.log_tail()))

    def alive(self) -> bool:
        return self.proc.poll() is None


def rss_kb(pid: int) -> Dict[str, int]:
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[k] = int(v.split()[0])
    return out


def memfds(pid: int) -> int:
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            if os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("/memfd:"):
                n += 1
        except OSError:
            pass
    return n


# -- load -------------------------------------------------------------------------------------

class Writer(threading.Thread):
    """PUTs sequences of `pages` pages (namespace ns, sequences start, start + step, ...) until
    stopped or until the daemon goes; `acked` lists those whose PUT returned with every page
    stored."""

    def __init__(self, d: Daemon, ns: int, start: int, step: int, pages: int, *,
                 tcp: bool = False, reads: Optional[Tally] = None) -> None:
        super().__init__(daemon=True)
        self.c = d.client(ns, tcp=tcp, timeout_ms=3000)
        self.ns, self.seq, self.step, self.pages = ns, start, step, pages
        self.acked: List[int] = []
        self.not_stored = 0
        self.errors: Dict[str, int] = {}
        self.reads = reads
        self.halt = threading.Event()

    def run(self) -> None:
        rng = random.Random(self.seq)
        while not self.halt.is_set():
            s = self.seq
            op, t0 = "put", time.monotonic()
            try:
                r = self.c.put(tokens_of(s, self.pages), seq_bytes(self.ns, s, 0, self.pages))
                TOTALS["ops"] += 1
                if r.stored == self.pages:
                    self.acked.append(s)
                else:
                    self.not_stored += 1
                if self.reads is not None and self.acked and rng.random() < 0.5:
                    op, t0 = "match+get", time.monotonic()
                    verify(self.c, self.ns, rng.choice(self.acked[-200:]), self.pages,
                           self.reads, remote=True)
                    TOTALS["ops"] += 1
            except kvtier.NoSpace:
                self.not_stored += 1
            except (kvtier.ConnectionClosed, kvtier.ConnectError):
                return  # the daemon went
            except kvtier.Error as e:
                k = "%s:%s" % (op, type(e).__name__)
                if isinstance(e, kvtier.Timeout):
                    k += " after %.1f s" % (time.monotonic() - t0)
                self.errors[k] = self.errors.get(k, 0) + 1
                if self.c.closed:  # the client's own timeout closes it
                    return
            self.seq += self.step

    def finish(self) -> None:
        self.halt.set()
        self.join(timeout=30)
        self.c.close()


# -- the faults -------------------------------------------------------------------------------

NVME_ARGS = ["--dram-bytes", "2M", "--nvme-bytes", "48M", "--nvme-segment-bytes", "1M"]


def fault_sigkill(work: str, long: bool) -> None:
    """SIGKILL during PUT bursts, restart on the same data-dir, every acknowledged page checked."""
    loops = 100 if long else 5
    home = os.path.join(work, "sigkill")
    rng = random.Random(36)
    tally = Tally()
    acked_all: List[int] = []
    seq = last_n = 0
    for loop in range(loops):
        d = Daemon(home, *NVME_ARGS)
        if loop:
            # What the previous loops acknowledged: the last loop's pages all, older ones by
            # sample (the 48 MiB log wraps: older pages may be gone, never wrong).
            with d.client() as c:
                last = acked_all[-last_n:] if last_n else []
                older = acked_all[:-last_n] if last_n else acked_all
                for s in last + rng.sample(older, min(len(older), 100)):
                    verify(c, 0, s, 8, tally)
        ws = [Writer(d, 0, seq, 2, 8), Writer(d, 0, seq + 1, 2, 8, tcp=True)]
        for w in ws:
            w.start()
        time.sleep(rng.uniform(0.4, 1.5))
        d.kill(signal.SIGKILL)
        TOTALS["faults_injected"] += 1
        last_n = 0
        for w in ws:
            w.finish()
            acked_all += w.acked
            last_n += len(w.acked)
            seq = max(seq, w.seq + 2)
        seq += seq % 2
        if loop % 10 == 0 or loop == loops - 1:
            log("sigkill loop %d: %d sequences acknowledged so far; %d pages verified, %d "
                "missing" % (loop, len(acked_all), tally.verified, tally.missing))
    d = Daemon(home, *NVME_ARGS)
    with d.client() as c:
        st = c.stats()
        for s in acked_all[-last_n:]:
            verify(c, 0, s, 8, tally)
    d.stop()
    check(st["nvme_recovery_blocks_inserted"] > 0, "the last restart recovered blocks")
    tally.close("sigkill (%d loops, %d sequences of 8 pages acknowledged)" % (
        loops, len(acked_all)))
    check(tally.verified > 0, "sigkill: some acknowledged pages survived the kills")


def settle(c: kvtier.Client, name: str, quiet_s: float = 0.5, most_s: float = 10) -> Dict[str, int]:
    """STATS once counter `name` has not moved for quiet_s (the tiers' background moves done)."""
    st = c.stats()
    end = time.monotonic() + most_s
    while time.monotonic() < end:
        time.sleep(quiet_s)
        nxt = c.stats()
        if nxt[name] == st[name]:
            return nxt
        st = nxt
    return st


def _populate(home: str, nseq: int) -> List[int]:
    d = Daemon(home, *NVME_ARGS)
    acked = []
    with d.client() as c:
        for s in range(nseq):
            r = c.put(tokens_of(s, 8), seq_bytes(0, s, 0, 8))
            check(r.stored == 8, "populate: PUT stored %d of 8" % r.stored)
            acked.append(s)
        st = c.stats()
    d.stop()
    check(st["nvme_used_bytes"] > 0, "populate: blocks reached NVMe")
    return acked


def _flip(path: str, n: int, rng: random.Random, limit: Optional[int] = None) -> None:
    size = os.path.getsize(path)
    lim = min(size, limit) if limit else size
    with open(path, "r+b") as f:
        for _ in range(n):
            off = rng.randrange(lim)
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))


def fault_files(work: str, long: bool) -> None:
    """Flips and truncation of the NVMe tier's data and side files."""
    rng = random.Random(3636)
    home = os.path.join(work, "files")
    pristine = os.path.join(work, "files-pristine")
    acked = _populate(pristine, 400)  # 400 x 8 x 16 KiB = 50 MiB through a 48 MiB log
    data_used = os.path.getsize(os.path.join(pristine, "kvtier-data", "kvtier.data"))
    damages: List[Tuple[str, Callable[[str], None]]] = []
    rounds = 10 if long else 1
    for r in range(rounds):
        damages += [
            ("kvtier.data: %d bit flips" % (20 * (r + 1)),
             lambda dd, r=r: _flip(os.path.join(dd, "kvtier.data"), 20 * (r + 1), rng,
                                   data_used)),
        ]
    damages += [
        ("kvtier.data truncated to half", lambda dd: os.truncate(
            os.path.join(dd, "kvtier.data"), os.path.getsize(os.path.join(dd, "kvtier.data"))
            // 2)),
        ("kvtier.data truncated to 0", lambda dd: os.truncate(os.path.join(dd, "kvtier.data"),
                                                              0)),
        ("kvtier.data removed", lambda dd: os.unlink(os.path.join(dd, "kvtier.data"))),
    ]
    for side in sorted(os.listdir(os.path.join(pristine, "kvtier-data"))):
        if side == "kvtier.data" or not side.startswith("kvtier."):
            continue
        damages += [
            ("%s: 4 bit flips" % side, lambda dd, s=side: _flip(os.path.join(dd, s), 4, rng)),
            ("%s truncated to half" % side, lambda dd, s=side: os.truncate(
                os.path.join(dd, s), os.path.getsize(os.path.join(dd, s)) // 2)),
            ("%s removed" % side, lambda dd, s=side: os.unlink(os.path.join(dd, s))),
        ]
    tally = Tally()
    outcomes = []
    for what, damage in damages:
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(pristine, home)
        damage(os.path.join(home, "kvtier-data"))
        TOTALS["faults_injected"] += 1
        d = Daemon(home, *NVME_ARGS, expect_ready=False)
        if d.ready:
            with d.client() as c:
                st = c.stats()
                for s in acked:
                    verify(c, 0, s, 8, tally)
            d.stop()
            warned = [ln for ln in d.log_tail(4).split(" | ") if " warn " in ln or " error " in ln]
            outcomes.append("%s: started, %d blocks recovered%s" % (
                what, st["nvme_recovery_blocks_inserted"],
                ("; logged: " + warned[-1][:150]) if warned else "; nothing logged"))
        else:
            rc = d.proc.wait(timeout=30)
            tail = d.log_tail()
            d.kill()
            fname = what.split()[0].rstrip(":")
            why = [ln for ln in tail.split(" | ") if "kvtier-data/" + fname in ln]
            check(rc == 69 and bool(why), "%s: kvtierd neither started nor refused with exit 69 "
                  "naming %s (exit %s): %s" % (what, fname, rc, tail))
            outcomes.append("%s: refused (exit 69): %s" % (what, why[0].split(": ", 1)[-1][:150]))
    for o in outcomes:
        log("files: " + o)
    tally.close("files (%d damages)" % len(damages))


def _private_tmpfs(path: str, size: str) -> Optional[str]:
    """Mounts a tmpfs of `size` on path in this process's own mount namespace (made on first
    use, so nothing shows outside the suite and nothing outlives it); None when that works,
    else why not."""
    if os.geteuid() != 0:
        return "not root: no tmpfs can be mounted"
    if not getattr(_private_tmpfs, "done", False):
        if _libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
            return "unshare(CLONE_NEWNS): %s" % os.strerror(ctypes.get_errno())
        # MS_REC | MS_PRIVATE on /: the mounts below do not propagate back out.
        if _libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:
            return "mount --make-rprivate /: %s" % os.strerror(ctypes.get_errno())
        _private_tmpfs.done = True  # type: ignore[attr-defined]
    os.makedirs(path, exist_ok=True)
    opt = ("size=%s" % size).encode()
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, opt) != 0:
        return "mount -t tmpfs: %s" % os.strerror(ctypes.get_errno())
    return None


def _remount(path: str, size: str) -> None:
    rc = _libc.mount(None, path.encode(), None, 0x20, ("size=%s" % size).encode())  # REMOUNT
    check(rc == 0, "remount %s: %s" % (path, os.strerror(ctypes.get_errno())))


def fault_fullfs(work: str, long: bool) -> None:
    """The NVMe tier's file system fills up under PUTs, then grows again."""
    mnt = os.path.join(work, "fullfs")
    why = _private_tmpfs(mnt, "6m")
    if why:
        log("fullfs: SKIPPED (%s)" % why)
        TOTALS.setdefault("skipped", []).append("fullfs: " + why)
        return
    try:
        # Preallocated: the daemon refuses at once, saying why.
        d = Daemon(mnt, "--data-dir", "data", *NVME_ARGS, expect_ready=False)
        if d.ready:
            d.kill()
            raise Failure("fullfs: a preallocated 48M tier started on a 6M file system")
        rc = d.proc.wait(timeout=30)
        tail = d.log_tail()
        d.kill()
        check(rc != 0 and ("cannot hold" in tail or "space" in tail.lower()), "fullfs: the refusal "
              "names the full file system (exit %s): %s" % (rc, tail))
        TOTALS["faults_injected"] += 1
        log("fullfs: preallocation refused (exit %d): %s" % (rc, tail.split(" | ")[1][:200]))
        shutil.rmtree(os.path.join(mnt, "data"), ignore_errors=True)
        # Sparse: the file system fills under the writes.
        args = ["--data-dir", "data", "--nvme-sparse", "yes", *NVME_ARGS]
        d = Daemon(mnt, *args)
        tally = Tally()
        acked = []
        n = 600 if long else 200  # x 128 KiB: 75 / 25 MiB into 6 MiB
        with d.client() as c:
            for s in range(n):
                r = c.put(tokens_of(s, 8), seq_bytes(0, s, 0, 8))
                if r.stored == 8:
                    acked.append(s)
            st = settle(c, "tier_io_errors_nvme_write", most_s=3)
            check(d.alive(), "fullfs: kvtierd alive after filling its file system")
            time.sleep(1)
            idle = c.stats()["tier_io_errors_nvme_write"] - st["tier_io_errors_nvme_write"]
            st = c.stats()
            full_errors = st["tier_io_errors_nvme_write"]
            # Moves into a tier whose writes fail pause (up to 2 s at a time: server/exec.c):
            # before that pause, the policy retried at every step, ~100,000 failed writes a
            # second while idle (docs/faults.md).
            log("fullfs: %d of %d PUTs fully stored, %d NVMe write errors (%d in the last idle "
                "second), nvme_used %d, dram_used %d" % (
                    len(acked), n, full_errors, idle, st["nvme_used_bytes"],
                    st["dram_used_bytes"]))
            TOTALS["fullfs_idle_write_errors_per_s"] = idle
            check(full_errors > 0, "fullfs: the full file system showed as NVMe write errors")
            check(idle < 1000, "fullfs: %d failed NVMe writes in an idle second: the moves into "
                  "the full tier do not pause" % idle)
            TOTALS["faults_injected"] += 1
            for s in acked:
                verify(c, 0, s, 8, tally)
            _remount(mnt, "96m")
            # Moves into NVMe pause for up to 2 s after failed writes (server/exec.c); in the
            # meantime the policy drops what it cannot demote. Wait the pause out.
            time.sleep(2.2)
            written = c.stats()["nvme_written_bytes"]
            for s in range(n, n + 100):
                r = c.put(tokens_of(s, 8), seq_bytes(0, s, 0, 8))
                if r.stored == 8:
                    acked.append(s)
            st = settle(c, "nvme_written_bytes")
            log("fullfs: after growing the file system: %d bytes more written to NVMe, %d more "
                "write errors" % (st["nvme_written_bytes"] - written,
                                  st["tier_io_errors_nvme_write"] - full_errors))
            check(st["nvme_written_bytes"] > written, "fullfs: NVMe writes resume once there is "
                  "room (kvtierd's log ends: %s)" % d.log_tail())
        d.stop()
        d = Daemon(mnt, *args)
        with d.client() as c:
            st = c.stats()
            for s in acked:
                verify(c, 0, s, 8, tally)
        d.stop()
        log("fullfs: restart recovered %d blocks" % st["nvme_recovery_blocks_inserted"])
        tally.close("fullfs")
    finally:
        _libc.umount2(mnt.encode(), 2)  # MNT_DETACH


class Redis:
    def __init__(self, home: str, port: int) -> None:
        self.home, self.port = home, port
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        exe = os.environ.get("KVT_REDIS_SERVER") or shutil.which("redis-server")
        if not exe:
            raise FileNotFoundError("redis-server")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.home, "--logfile", "redis.log"],
            cwd=self.home, stdout=subprocess.DEVNULL, env=child_env(False),
            preexec_fn=_die_with_parent)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise Failure("redis-server did not start on port %d" % self.port)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(timeout=30)
            self.proc = None


def fault_redis(work: str, long: bool) -> None:
    """redis-server SIGKILLed, restarted, SIGSTOPped and SIGCONTed under load."""
    if not (os.environ.get("KVT_REDIS_SERVER") or shutil.which("redis-server")):
        log("redis: SKIPPED (no redis-server)")
        TOTALS.setdefault("skipped", []).append("redis: no redis-server")
        return
    home = os.path.join(work, "redis")
    os.makedirs(home)
    rs = Redis(home, free_port())
    rs.start()
    d = Daemon(home, "--dram-bytes", "2M", "--nvme-bytes", "0", "--remote",
               "127.0.0.1:%d" % rs.port, "--remote-bytes", "256M", "--remote-timeout-ms", "300")
    tally = Tally()
    ws = [Writer(d, 0, 0, 2, 4, reads=tally), Writer(d, 0, 1, 2, 4, tcp=True, reads=tally)]
    for w in ws:
        w.start()
    phase = 4.0 if long else 1.5
    cycles = 5 if long else 1
    try:
        with d.client() as c:
            def acked() -> int:
                return sum(len(w.acked) for w in ws)

            def phase_ok(name: str) -> None:
                a = acked()
                time.sleep(phase)
                check(d.alive(), "redis: kvtierd alive after %s" % name)
                c.ping()
                deadline = time.monotonic() + 10  # a loaded machine: progress, however slow
                while acked() == a and time.monotonic() < deadline and any(
                        w.is_alive() for w in ws):
                    time.sleep(0.1)
                check(acked() > a, "redis: PUTs acknowledged while %s (writers: %s)" % (
                    name, ["alive %s, %d acked, errors %s" % (w.is_alive(), len(w.acked),
                                                              w.errors) for w in ws]))

            phase_ok("redis is up")
            check(c.stats()["remote_used_bytes"] > 0, "redis: blocks reached the remote tier")
            for _ in range(cycles):
                rs.signal(signal.SIGKILL)
                TOTALS["faults_injected"] += 1
                phase_ok("redis is dead")
                connects = c.stats()["remote_connects"]
                rs.start()
                phase_ok("redis was restarted")
                st = c.stats()
                deadline = time.monotonic() + 10
                while st["remote_connects"] <= connects and time.monotonic() < deadline:
                    time.sleep(0.2)
                    st = c.stats()
                check(st["remote_connects"] > connects, "redis: reconnected after the restart")
                rs.signal(signal.SIGSTOP)
                TOTALS["faults_injected"] += 1
                phase_ok("redis is stopped")
                rs.signal(signal.SIGCONT)
                phase_ok("redis was continued")
            st = c.stats()
            for w in ws:
                w.finish()
            # After the storms, every acknowledged sequence read back once (remote probe on).
            for w in ws:
                for s in w.acked[-300:]:
                    verify(c, 0, s, 4, tally, remote=True)
        log("redis: %d PUTs acknowledged; remote connects %d, disconnects %d, timeouts %d, "
            "remote read errors %d, misses (remote unreachable) %d tokens" % (
                sum(len(w.acked) for w in ws), st["remote_connects"],
                st["remote_disconnects"], st["remote_timeouts"],
                st["tier_io_errors_remote_read"], st["miss_tokens_remote_unreachable"]))
        check(st["remote_disconnects"] > 0 or st["remote_timeouts"] > 0,
              "redis: the daemon saw the faults")
        d.stop()
    finally:
        for w in ws:
            w.halt.set()
        if rs.proc is not None:
            rs.signal(signal.SIGCONT)
            rs.signal(signal.SIGKILL)
    tally.close("redis")


CHILD_RESERVE = """
import os, sys, time
sys.path.insert(0, %r)
import kvtier
c = kvtier.Client(%r, unix_path=%r, page_size=%d, block_bytes=%d)
assert c.zero_copy, c.zero_copy_reason
toks = list(range(%d, %d))
r = c.reserve(toks, %d)
for i, v in enumerate(r.views):
    if v is not None and i %% 2 == 0:
        v[:] = bytes([0xEE]) * len(v)
print("reserved", r.nreserved, flush=True)
time.sleep(60)
"""


def fault_reserve(work: str, long: bool) -> None:
    """Clients SIGKILLed mid-reservation: nothing visible, the room returns."""
    home = os.path.join(work, "reserve")
    d = Daemon(home, "--dram-bytes", "8M", "--nvme-bytes", "0")
    rounds = 50 if long else 5
    tally = Tally()
    with d.client(0) as c, d.client(0, zero_copy=False) as reader:
        base = c.stats()
        for k in range(rounds):
            seq = 50_000 + k
            pages = 64 + k % 32
            toks = tokens_of(seq, pages)
            before = c.stats()["dram_used_bytes"]
            src = CHILD_RESERVE % (os.path.join(SOURCE_ROOT, "python"), "faults-0", d.unix,
                                   PAGE, BLOCK, toks[0], toks[-1] + 1, pages)
            child = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE,
                                     text=True, preexec_fn=_die_with_parent)
            assert child.stdout is not None
            line = child.stdout.readline().split()
            check(line[:1] == ["reserved"] and int(line[1]) == pages,
                  "reserve: the child reserved its pages: %r" % line)
            check(c.stats()["dram_used_bytes"] >= base["dram_used_bytes"] + pages * BLOCK,
                  "reserve: the reservation holds DRAM")
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            child.stdout.close()
            TOTALS["faults_injected"] += 1
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                st = c.stats()
                if st["reservations_closed"] >= base["reservations_closed"] + k + 1:
                    break
                time.sleep(0.05)
            check(st["reservations_closed"] == base["reservations_closed"] + k + 1,
                  "reserve: the killed client's reservation ended as closed")
            while st["dram_used_bytes"] != before and time.monotonic() < deadline:
                time.sleep(0.05)
                st = c.stats()
            check(st["dram_used_bytes"] == before, "reserve: its DRAM came back (%d used, %d "
                  "before)" % (st["dram_used_bytes"], before))
            m = reader.match(toks)
            check(all(t == kvtier.Tier.NONE for t in m.tiers),
                  "reserve: none of the killed client's pages became visible")
            # The same pages, reserved and committed by a live client: the room is there and
            # the bytes are the committer's, not the dead client's.
            r = c.reserve(toks, pages)
            check(r.nreserved == pages, "reserve: the room returned (%d of %d)" % (
                r.nreserved, pages))
            for p, v in enumerate(r.views):
                v[:] = page_bytes(0, seq, p)
            check(c.commit(r).stored == pages, "reserve: the commit stored every page")
            verify(reader, 0, seq, pages, tally)
            c.remove(toks[:PAGE])  # the whole sequence goes: each round starts from the same use
        st = c.stats()
    d.stop()
    log("reserve: %d clients killed mid-reservation; reservations closed %d, committed %d" % (
        rounds, st["reservations_closed"], st["reservations_committed"]))
    tally.close("reserve")


def fault_soak(work: str, long: bool) -> None:
    """Connections mixing every operation; counters reconciled at the end."""
    conns = 64 if long else 16
    secs = 600 if long else 10 if SANITIZED else 20
    nss = 8
    home = os.path.join(work, "soak")
    dram, nvme = 64 << 20, 128 << 20
    d = Daemon(home, "--dram-bytes", str(dram), "--nvme-bytes", str(nvme),
               "--nvme-segment-bytes", "4M", "--lease-ms", "5000", "--reserve-ms", "2000")
    rss0 = rss_kb(d.pid)
    tally = Tally()
    stop = threading.Event()
    counts: Dict[str, int] = {}
    errors: List[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        rng = random.Random(i)
        ns = i % nss
        local: Dict[str, int] = {}
        try:
            c = d.client(ns, tcp=(i % 4 == 3), timeout_ms=20000)
            zc = c.zero_copy
            mix = ("put", "put", "get", "get", "views", "remove", "prefetch", "stats",
                   "lease") + (("reserve",) if zc else ())
            while not stop.is_set():
                seq = rng.randrange(300)
                pages = rng.choice((1, 2, 4, 8))
                toks = tokens_of(seq, pages)
                # One op in 200 closes the connection (its leases and reservations go with it)
                # and opens a new one: HELLO and MAP again, the arena unmapped and mapped.
                op = "reconnect" if rng.random() < 0.005 else rng.choice(mix)
                local[op] = local.get(op, 0) + 1
                try:
                    if op == "put":
                        first = rng.randrange(pages)
                        c.put(toks, seq_bytes(ns, seq, first, pages - first), first_page=first)
                    elif op == "get":
                        verify(c, ns, seq, pages, tally)
                    elif op == "views":
                        m = c.match(toks, lease=True, lease_ms=5000)
                        if m.lease:
                            n = 0
                            while n < m.pages and m.tiers[n] != kvtier.Tier.NONE:
                                n += 1
                            if n:
                                vs = c.get_views(m.lease, npages=n)
                                for p, v in enumerate(vs):
                                    if bytes(v) == page_bytes(ns, seq, p):
                                        tally.add(verified=1)
                                    else:
                                        tally.add(wrong=BLOCK, where="views ns %d seq %d p %d" % (
                                            ns, seq, p))
                            c.release(m.lease)
                    elif op == "remove":
                        c.remove(toks, wait=rng.random() < 0.5)
                    elif op == "prefetch":
                        c.prefetch(toks, kvtier.Tier.DRAM, deadline_ms=500,
                                   wait=rng.random() < 0.7)
                    elif op == "reserve":
                        r = c.reserve(toks, pages)
                        for p, v in enumerate(r.views):
                            if v is not None:
                                v[:] = page_bytes(ns, seq, p)
                        if r.id:  # a reservation of nothing sends no COMMIT
                            local["commit"] = local.get("commit", 0) + 1
                        if rng.random() < 0.8:
                            c.commit(r)
                        else:
                            c.abort(r)
                    elif op == "stats":
                        c.stats()
                    elif op == "reconnect":
                        c.close()
                        c = d.client(ns, tcp=(i % 4 == 3), timeout_ms=20000)
                        check(c.zero_copy == zc, "soak: a new connection maps as the first did")
                    elif op == "lease":  # a lease left to expire or to the close
                        c.match(toks, lease=True, lease_ms=rng.choice((50, 1000)))
                        local["ping"] = local.get("ping", 0) + 1
                        c.ping()
                except (kvtier.NotFound, kvtier.Busy, kvtier.NoSpace) as e:
                    k = "%s:%s" % (op, type(e).__name__)
                    local[k] = local.get(k, 0) + 1
            c.close()
        except Exception as e:  # noqa: BLE001 - any other error fails the soak, named
            with lock:
                errors.append("conn %d: %s: %s" % (i, type(e).__name__, e))
        with lock:
            for k, v in local.items():
                counts[k] = counts.get(k, 0) + v

    ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(conns)]
    for t in ts:
        t.start()
    t_end = time.monotonic() + secs
    peak = 0
    while time.monotonic() < t_end and not errors:
        time.sleep(min(10.0, max(0.1, t_end - time.monotonic())))
        peak = max(peak, rss_kb(d.pid)["VmRSS"])
        if long:
            log("soak: %.0f s left, %d pages verified, RSS %d KiB" % (
                t_end - time.monotonic(), tally.verified, peak))
    stop.set()
    for t in ts:
        t.join(timeout=60)
    check(not errors, "soak: unexpected errors: %s" % errors[:5])
    time.sleep(1.5)  # the once-a-second arena check and the tick after the closes
    rss = rss_kb(d.pid)
    with d.client(0, zero_copy=False) as c:
        st = c.stats()
    fds = memfds(d.pid)
    ops = sum(v for k, v in counts.items()
              if ":" not in k and k not in ("commit", "ping", "reconnect"))
    TOTALS["ops"] += ops
    TOTALS["soak"] = {"connections": conns, "seconds": secs, "operations": ops,
                      "rss_kb_start": rss0["VmRSS"], "rss_kb_end": rss["VmRSS"],
                      "rss_kb_peak": peak, "rss_shmem_kb_end": rss.get("RssShmem", 0),
                      "zero_copy_arenas": st["zero_copy_arenas"], "memfds": fds,
                      "leases": st["leases"], "dram_used_bytes": st["dram_used_bytes"],
                      "nvme_used_bytes": st["nvme_used_bytes"],
                      "zero_copy_resident_bytes": st["zero_copy_resident_bytes"]}
    log("soak: %s" % json.dumps(TOTALS["soak"]))
    log("soak: operations %s" % json.dumps(dict(sorted(counts.items()))))
    check(st["leases"] == 0, "soak: %d leases left after every client closed" % st["leases"])
    check(st["zero_copy_arenas"] == fds, "soak: kvtier_zero_copy_arenas %d but %d memfds open" % (
        st["zero_copy_arenas"], fds))
    check(st["dram_used_bytes"] <= dram and st["nvme_used_bytes"] <= nvme,
          "soak: tiers within capacity")
    check(st["zero_copy_resident_bytes"] <= dram, "soak: arenas' resident bytes within dram-bytes")
    # The daemon counted exactly the requests the clients sent, and refused only those the
    # clients saw refused.
    for k in ("remove", "prefetch", "ping"):
        check(st["requests_" + k] == counts.get(k, 0), "soak: requests_%s %d, the clients sent "
              "%d" % (k, st["requests_" + k], counts.get(k, 0)))
    # A zero-copy client's put() is a RESERVE and a COMMIT (a PUT too for pages with no room).
    sent = st["requests_put"] + st["requests_reserve"]
    check(sent >= counts.get("put", 0) + counts.get("reserve", 0), "soak: %d PUTs and RESERVEs "
          "counted for %d put() and reserve() calls" % (sent, counts.get("put", 0) +
                                                      counts.get("reserve", 0)))
    check(st["requests_commit"] >= counts.get("commit", 0), "soak: COMMITs counted")
    check(st["requests_stats"] - counts.get("stats", 0) in (0, 1), "soak: requests_stats %d, the "
          "clients sent %d (+1: the last)" % (st["requests_stats"], counts.get("stats", 0)))
    check(st["connections"] == 1 and st["connections_accepted"] == conns + counts.get(
        "reconnect", 0) + 1, "soak: connections %d (1: the last STATS), accepted %d for %d "
        "opened" % (st["connections"], st["connections_accepted"],
                     conns + counts.get("reconnect", 0) + 1))
    refused = sum(v for k, v in counts.items() if k.startswith("remove:"))
    check(st["request_errors_remove"] == refused, "soak: request_errors_remove %d, the clients "
          "saw %d" % (st["request_errors_remove"], refused))
    proto = {k: v for k, v in st.items() if k.startswith("protocol_errors_") and v}
    check(not proto, "soak: protocol errors counted: %s" % proto)
    # Bounded: the DRAM tier (counted in RSS as shared memory once touched), the index and the
    # connections' buffers; 256 MiB over dram-bytes is far above what a leak-free daemon uses
    # here, far below what a leak of the soak's traffic (GiBs) would show.
    # (Not under ASan: its quarantine of freed memory and its shadow are hundreds of MiB that
    # are not the daemon's.)
    check(SANITIZED or rss["VmRSS"] <= (dram >> 10) + 256 * 1024,
          "soak: RSS %d KiB bounded" % rss["VmRSS"])
    d.stop()
    tally.close("soak (%d connections, %d s, %d operations)" % (conns, secs, ops))


FAULTS: Dict[str, Callable[[str, bool], None]] = {
    "sigkill": fault_sigkill, "files": fault_files, "fullfs": fault_fullfs,
    "redis": fault_redis, "reserve": fault_reserve, "soak": fault_soak,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--short", action="store_true", help="few loops (default)")
    g.add_argument("--long", action="store_true", help="the long form of docs/faults.md")
    ap.add_argument("--only", default="", help="comma-separated faults: " + ", ".join(FAULTS))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--sanitized", metavar="LIBASAN", default="",
                    help="the build carries AddressSanitizer: preload this libasan (the lighter "
                    "short form: fewer loops, a shorter soak)")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(FAULTS)
    bad = [n for n in names if n not in FAULTS]
    if bad:
        ap.error("unknown fault %s (known: %s)" % (", ".join(bad), ", ".join(FAULTS)))
    if not os.access(KVTIERD, os.X_OK):
        print("SKIP: no kvtierd at %s (build first)" % KVTIERD)
        return 77
    work = tempfile.mkdtemp(prefix="kvt-faults-", dir=os.environ.get("TMPDIR"))
    failed = []
    for n in names:
        t = time.monotonic()
        log("== %s (%s)" % (n, "long" if a.long else "short"))
        try:
            FAULTS[n](work, a.long)
            log("== %s: ok (%.1f s)" % (n, time.monotonic() - t))
        except Failure as e:
            failed.append(n)
            log("== %s: FAIL: %s" % (n, e))
    TOTALS["failed"] = failed
    TOTALS["seconds"] = round(time.monotonic() - T0, 1)
    if a.keep or failed:
        log("work directory kept: %s" % work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(TOTALS), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
