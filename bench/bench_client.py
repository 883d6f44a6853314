"""bench_client.py: PUT and GET of 2 MiB and 256 KiB pages through the kvtier Python package and
through libkvtier (bench_client, a C loop), over kvtierd's Unix socket and on the zero-copy path
(the client maps its namespace's DRAM arena), beside memcpy of the same bytes, in one run. Each
(implementation, path, page size) gets a fresh daemon: pass 1 is its first pass (the daemon's
memory faulted in, and on the zero-copy path this process's mapping too), passes 2.. are warm
reruns. Prints each pass, then one summary line per (path, op, page size, first|warm) with the
ratios python/libkvtier, libkvtier/memcpy and python/memcpy (warm: the median of the reruns), one
for PING round trips (the per-call cost alone; the ratio is libkvtier's time over the
package's), and one line per bar of issues 22 and 38 (met or not). One JSON object per line.

Zero-copy ops (impl libkvtier_zc, python_zc): put (kvt_client_put / Client.put: RESERVE + probe,
a memcpy into the mapping, COMMIT), get (kvt_client_get / Client.get_into: one memcpy from the
mapping), get_cb / get_views (no copy: the consumer reads one 8-byte word per 4 KiB where the
block lies), put_reserve (reserve, a memcpy into the room, commit); libkvtier's get_reader is a
second connection's GET of the same pages through a mapping of its own (another process: its
first touch of each page faults), memcpy beside it the same bytes copied in that process right
after its GETs (the baseline under the same load), and put_socket_arena socket PUTs into the same
namespace by a connection without a mapping (the daemon writes them into the namespace's arena:
the zero-copy PUT's like-for-like baseline). One round trip per step (issue 38, libkvtier only;
bench_client.c says what each times): step_get (MATCH, GET, RELEASE per one-page request),
step_locate (MATCH with LOCATE, a memcpy from the location, RELEASE sent without waiting),
get_located (step_locate's load: the memcpy and the RELEASE's send, from the MATCH's reply on;
the bars of issue 38 are its ratios to memcpy), step_match (the lookup alone); vs_step_get is
each step's rate over step_get's.

  bench_client.py --build-root BUILD [--passes R] [--quick]

Runs under BUILD/pyenv's Python (re-executing itself there) so that numpy and cffi are present.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from pybench import Daemon, run_in_venv

PAGE_TOKENS = 16


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-root", default=os.environ.get("KVT_BUILD_ROOT", "build"))
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="fewer pages (a smoke run)")
    return ap.parse_args()


args = parse()
build = os.path.abspath(args.build_root)
run_in_venv(build, "bench_client", 1)
import numpy as np  # noqa: E402

import kvtier  # noqa: E402

SIZES = [(2 << 20, 64), (256 << 10, 256)]  # (block bytes, pages per pass): 128 and 64 MiB
if args.quick:
    SIZES = [(2 << 20, 8), (256 << 10, 32)]


def emit(impl: str, op: str, block: int, pages: int, pass_: int, secs: float) -> dict:
    rec = {"bench": "client", "impl": impl, "op": op, "block_bytes": block, "pages": pages,
           "pass": pass_, "gib_s": round(block * pages / secs / (1 << 30), 3),
           "us_per_page": round(secs * 1e6 / pages, 2)}
    print(json.dumps(rec), flush=True)
    return rec


def python_passes(unix: str, block: int, pages: int, passes: int, zc: bool) -> list:
    out = []
    impl = "python_zc" if zc else "python"
    with kvtier.Client("bench-client", page_size=PAGE_TOKENS, block_bytes=block,
                       unix_path=unix, timeout_ms=60000, zero_copy=zc) as c:
        if zc and not c.zero_copy:
            raise RuntimeError("no zero-copy mapping: " + c.zero_copy_reason)
        # Faulted in first (np.ones writes every page), as bench_client.c's: the first pass
        # measures a fresh daemon, not this process's page faults.
        src = np.ones(block * pages, np.uint8)
        dst = np.ones(block * pages, np.uint8)
        srcs = [src[i * block:(i + 1) * block] for i in range(pages)]
        dsts = [dst[i * block:(i + 1) * block] for i in range(pages)]
        ntok = pages * PAGE_TOKENS
        for p in range(1, passes + 1):
            tok = np.arange(ntok, dtype=np.uint32) + np.uint32(9_000_000 + p * 1_000_000)
            toks = [tok[:(i + 1) * PAGE_TOKENS] for i in range(pages)]
            src[::4096] = np.arange(len(src[::4096]), dtype=np.uint8) + p
            t0 = time.perf_counter()
            for i in range(pages):
                r = c.put(toks[i], srcs[i], first_page=i)
            secs = time.perf_counter() - t0
            assert r.stored == 1
            out.append(emit(impl, "put", block, pages, p, secs))
            m = c.match(tok, lease=True, lease_ms=60000)
            assert m.pages == pages, m
            t0 = time.perf_counter()
            for i in range(pages):
                c.get_into(m.lease, dsts[i], first_page=i, npages=1)
            secs = time.perf_counter() - t0
            out.append(emit(impl, "get", block, pages, p, secs))
            assert np.array_equal(src, dst), "GET returned other bytes than PUT stored"
            if zc:
                total = 0
                t0 = time.perf_counter()
                for i in range(pages):
                    (v,) = c.get_views(m.lease, first_page=i, npages=1)
                    total += int(np.frombuffer(v, np.uint64)[::512].sum(dtype=np.uint64))
                secs = time.perf_counter() - t0
                out.append(emit(impl, "get_views", block, pages, p, secs))
                want = int(src.view(np.uint64)[::512].sum(dtype=np.uint64))
                assert total % (1 << 64) == want % (1 << 64), "get_views saw other bytes"
            c.release(m.lease)
            c.remove(tok[:PAGE_TOKENS])
            if not zc:
                continue
            tok = np.arange(ntok, dtype=np.uint32) + np.uint32(600_000_000 + p * 1_000_000)
            toks = [tok[:(i + 1) * PAGE_TOKENS] for i in range(pages)]
            t0 = time.perf_counter()
            for i in range(pages):
                r = c.reserve(toks[i], 1, first_page=i)
                r.views[0][:] = srcs[i]
                c.commit(r)
            secs = time.perf_counter() - t0
            out.append(emit(impl, "put_reserve", block, pages, p, secs))
            c.remove(tok[:PAGE_TOKENS])
        pings = 5000
        t0 = time.perf_counter()
        for _ in range(pings):
            c.ping()
        rec = {"bench": "client", "impl": impl, "op": "ping", "calls": pings,
               "us_per_call": round((time.perf_counter() - t0) * 1e6 / pings, 2)}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def c_passes(helper: str, mode: str, unix: str, block: int, pages: int, passes: int) -> list:
    cmd = [helper, mode, "--block-bytes", str(block), "--pages", str(pages), "--passes",
           str(passes)]
    if unix:
        cmd += ["--unix", unix]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(cmd), res.stderr))
    recs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    for r in recs:
        print(json.dumps(r), flush=True)
    return recs


def main() -> int:
    helper = os.path.join(build, "bench", "bench_client")
    recs = []
    for block, pages in SIZES:
        recs += c_passes(helper, "memcpy", "", block, pages, args.passes)
        for impl in ("libkvtier", "python", "libkvtier_zc", "python_zc"):
            d = Daemon(build, "kvt-bench-client-", "512M")
            try:
                if impl.startswith("python"):
                    recs += python_passes(d.unix, block, pages, args.passes, impl == "python_zc")
                else:
                    mode = "zc" if impl == "libkvtier_zc" else "client"
                    recs += c_passes(helper, mode, d.unix, block, pages, args.passes)
            finally:
                d.stop()

    def rate(impl: str, op: str, block: int, warm: bool) -> float:
        v = [r["gib_s"] for r in recs if r["impl"] == impl and r["op"] == op and "gib_s" in r and
             r["block_bytes"] == block and (r["pass"] > 1) == warm]
        return statistics.median(v)

    def ping(impl: str) -> float:
        return statistics.median(r["us_per_call"] for r in recs
                                 if r["impl"] == impl and r["op"] == "ping")

    py, lib = ping("python"), ping("libkvtier")
    print(json.dumps({"bench": "client", "summary": "ping", "python_us_per_call": round(py, 2),
                      "libkvtier_us_per_call": round(lib, 2),
                      "python_vs_libkvtier": round(lib / py, 3)}), flush=True)
    # (path, summary op, the package's op, libkvtier's op)
    rows = [("socket", "get", "get", "get"), ("socket", "put", "put", "put"),
            ("zero_copy", "get", "get", "get"), ("zero_copy", "get_reader", None, "get_reader"),
            ("zero_copy", "get_nocopy", "get_views", "get_cb"),
            ("zero_copy", "get_batch8", None, "get_batch8"),
            ("zero_copy", "get_located", None, "get_located"),
            ("zero_copy", "step_get", None, "step_get"),
            ("zero_copy", "step_locate", None, "step_locate"),
            ("zero_copy", "step_match", None, "step_match"),
            ("zero_copy", "put", "put", "put"), ("zero_copy", "put_reserve", "put_reserve",
                                                 "put_reserve"),
            ("zero_copy", "put_socket_arena", None, "put_socket_arena")]
    bars = []
    for block, _ in SIZES:
        for path, op, pyop, libop in rows:
            sfx = "_zc" if path == "zero_copy" else ""
            for warm in (False, True):
                lib, mc = (rate("libkvtier" + sfx, libop, block, warm),
                           rate("memcpy", "copy", block, warm))
                rec = {
                    "bench": "client", "summary": op, "path": path, "block_bytes": block,
                    "pass": "warm" if warm else "first", "libkvtier_op": libop,
                    "libkvtier_gib_s": lib, "memcpy_gib_s": mc,
                    "libkvtier_vs_memcpy": round(lib / mc, 3)}
                if pyop:  # the package's counterpart, where it has one
                    py = rate("python" + sfx, pyop, block, warm)
                    rec.update({"python_op": pyop, "python_gib_s": py,
                                "python_vs_libkvtier": round(py / lib, 3),
                                "python_vs_memcpy": round(py / mc, 3)})
                if op == "put" and path == "zero_copy":
                    arena = rate("libkvtier_zc", "put_socket_arena", block, warm)
                    rec["libkvtier_zc_vs_socket_into_arena"] = round(lib / arena, 3)
                if path == "zero_copy" and op in ("get", "put"):  # ops the socket path has
                    sock = rate("libkvtier", libop, block, warm)
                    rec["libkvtier_zc_vs_socket"] = round(lib / sock, 3)
                if path == "zero_copy" and op in ("step_locate", "step_match"):
                    # the step with LOCATE against the step before it (MATCH, GET, RELEASE)
                    rec["vs_step_get"] = round(lib / rate("libkvtier_zc", "step_get", block, warm), 3)
                if path == "zero_copy" and op in ("get", "put", "get_batch8", "get_located"):
                    # memcpy in the zero-copy helper's own process right after its GETs
                    beside = rate("libkvtier_zc", "memcpy", block, warm)
                    rec["memcpy_beside_gib_s"] = beside
                    rec["libkvtier_vs_memcpy_beside"] = round(lib / beside, 3)
                print(json.dumps(rec), flush=True)
                if path == "zero_copy" and op == "get" and block == 2 << 20:
                    bars.append(("zero-copy 2 MiB DRAM GET >= 0.8x memcpy", warm,
                                 rec["libkvtier_vs_memcpy"], 0.8))
                    bars.append(("zero-copy 2 MiB DRAM GET >= 0.8x memcpy beside it", warm,
                                 rec["libkvtier_vs_memcpy_beside"], 0.8))
                    bars.append(("python zero-copy GET >= 0.7x libkvtier's", warm,
                                 rec["python_vs_libkvtier"], 0.7))
                if path == "zero_copy" and op == "get_batch8" and block == 2 << 20:
                    bars.append(("zero-copy 2 MiB DRAM GET, 8 pages a request, >= 0.8x memcpy",
                                 warm, rec["libkvtier_vs_memcpy"], 0.8))
                    bars.append(("zero-copy 2 MiB DRAM GET, 8 pages a request, >= 0.8x memcpy "
                                 "beside it", warm, rec["libkvtier_vs_memcpy_beside"], 0.8))
                if path == "zero_copy" and op == "get_located":
                    # issue 38: a one-page zero-copy GET once the step's MATCH locates it
                    want = 0.9 if block == 2 << 20 else 0.8
                    size = "2 MiB" if block == 2 << 20 else "256 KiB"
                    bars.append((f"one-page zero-copy GET after MATCH with LOCATE, {size}, "
                                 f">= {want}x memcpy", warm, rec["libkvtier_vs_memcpy"], want))
                    bars.append((f"one-page zero-copy GET after MATCH with LOCATE, {size}, "
                                 f">= {want}x memcpy beside it", warm,
                                 rec["libkvtier_vs_memcpy_beside"], want))
    for name, warm, ratio, bar in bars:
        print(json.dumps({"bench": "client", "bar": name, "pass": "warm" if warm else "first",
                          "ratio": ratio, "met": ratio >= bar}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
