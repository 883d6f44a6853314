"""bench_fleet.py: the prefill tokens a fleet of kvtierd saves with a shared remote tier (one
Redis Cluster), against the same daemons without it (issue 39).

A Mooncake trace (traces/, first --requests requests, in order) is split across N daemons
(--daemons, default 2 and 4) by session. The traces carry no session id, so a session is
defined from the prompts: a request whose full pages begin with every full page of an earlier
request (of 2 pages or more) is that request's next turn, in its session; any other request
opens a session, numbered by its index. A session goes to daemon crc32("session-<n>") % N, so
a conversation's turns return to the daemon that served the earlier ones, while sessions that
only share a system prompt or a document land anywhere. (The first two block ids, the obvious
key, would send every session sharing a two-page system prompt to one daemon.) Each request,
on its daemon:

  MATCH its whole 512-token pages (with the remote probe, when the fleet shares a cluster),
  GET the matched pages (each page's first 8 bytes are checked: its block id), RELEASE,
  PUT the pages it did not get (the engine's prefill of the rest).

Saved tokens are the pages GET returned x 512: prefill the request did not recompute. Every
daemon has the same DRAM tier (--dram-frac, default 5%, of the slice's distinct pages, at least
4 MiB: each daemon gets that much, however many there are), no NVMe, no HBM, the LRU policy (a DRAM victim is demoted to the
next tier when there is one, else dropped). The two configurations of each N differ only in
the remote tier: "local" has none; "shared" has the cluster (3 primaries, 3 replicas on
loopback, started here) with remote-bytes large enough for the whole slice, so that what it
adds is what other daemons (and the daemon's own demoted pages) left there. A third, "one",
is a single daemon with N times the DRAM and no remote tier: what one big node would save.
Pages are --block-bytes bytes (default 4 KiB: the figure counted is tokens, not bandwidth).

Prints one JSON object per run, then one per (trace, N) with each configuration's median saved
tokens, the spread (min and max over --repeat runs) and the ratio shared / local.

  bench_fleet.py --build-root BUILD [--trace FILE ...] [--requests R] [--daemons 2,4]
                 [--repeat K] [--dram-frac F] [--block-bytes B] [--configs one,local,shared]
                 [--no-zero-copy]

Runs under BUILD/pyenv's Python (re-executing itself there); exits 77 (skipped) without
redis-server and redis-cli, 1 on an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from typing import Dict, List, Sequence

from pybench import Cluster, Daemon, run_in_venv

PAGE = 512  # tokens per page: one trace block
VOCAB = 151936
GOLDEN = 0x9E3779B97F4A7C15


def parse() -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    traces = os.environ.get("KVT_TRACE_DIR", os.path.join(here, "..", "traces"))
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-root", default=os.environ.get("KVT_BUILD_ROOT", "build"))
    ap.add_argument("--trace", nargs="+",
                    default=[os.path.join(traces, "mooncake-conversation.jsonl"),
                             os.path.join(traces, "mooncake-synthetic.jsonl")])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--daemons", default="2,4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dram-frac", type=float, default=0.05)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--configs", default="one,local,shared",
                    help="which of one, local and shared to run (the summary needs all three)")
    ap.add_argument("--no-zero-copy", action="store_true",
                    help="move page bytes over the socket, not through the mapped arena")
    return ap.parse_args()


args = parse()
build = os.path.abspath(args.build_root)
run_in_venv(build, "bench_fleet", 1)
import numpy as np  # noqa: E402

import kvtier  # noqa: E402

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


STEPS = (np.arange(1, PAGE + 1, dtype=np.uint64) * np.uint64(GOLDEN))


def block_tokens(h: int) -> np.ndarray:
    """The 512 token ids of block id h, by traces/README.md's rule (kvt_trace_tokens)."""
    with np.errstate(over="ignore"):
        s = mix(np.array([h + 1], dtype=np.uint64))[0]
        return (mix(s + STEPS) % np.uint64(VOCAB)).astype(np.uint32)


def load(path: str, n: int) -> List[dict]:
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


def sessions(reqs: Sequence[dict]) -> List[int]:
    """Each request's session: the session of the latest earlier request of 2 or more full
    pages whose every full page begins this one (a conversation's next turn resends the whole
    previous prompt), else a new one, numbered by its first request. Two sessions that share
    only a system prompt or a document stay two sessions (the 2-page floor: in the conversation
    trace a one-page request is the bare system prompt, which every request begins with)."""
    ends: Dict[tuple, int] = {}  # a request's full pages -> its session
    out = []
    for i, req in enumerate(reqs):
        ids = req["hash_ids"][: req["input_length"] // PAGE]
        sid = i
        for j in range(len(ids), 1, -1):
            s = ends.get(tuple(ids[:j]))
            if s is not None:
                sid = s
                break
        if len(ids) >= 2:
            ends[tuple(ids)] = sid
        out.append(sid)
    return out


def daemon_of(session: int, n: int) -> int:
    return zlib.crc32(b"session-%d" % session) % n


class Fleet:
    def __init__(self, n: int, dram: int, cluster: Cluster | None, prefix: str,
                 remote_bytes: int) -> None:
        extra = ["--policy", "lru"]
        if cluster:
            extra += ["--remote", cluster.seeds, "--remote-cluster", "yes", "--remote-prefix",
                      prefix, "--remote-bytes", str(remote_bytes)]
        self.daemons = [Daemon(build, "kvt-fleet.", str(dram), "0", extra) for _ in range(n)]
        self.clients = [kvtier.Client("fleet-model", page_size=PAGE, block_bytes=args.block_bytes,
                                      unix_path=d.unix, zero_copy=not args.no_zero_copy)
                        for d in self.daemons]
        if cluster:  # every remote tier up before the first request
            end = time.monotonic() + 10
            while any(c.stats().get("remote_up", 0) != 1 for c in self.clients):
                if time.monotonic() > end:
                    raise RuntimeError("a daemon never reached the cluster")
                time.sleep(0.05)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        for d in self.daemons:
            d.stop()


def replay(reqs: Sequence[dict], fleet: Fleet, shared: bool) -> Dict[str, float]:
    n = len(fleet.clients)
    bb = args.block_bytes
    tot = {"prompt_tokens": 0, "saved_tokens": 0, "saved_remote_tokens": 0, "probe_pages": 0,
           "errors": 0, "wrong_bytes": 0}
    cache: Dict[int, np.ndarray] = {}
    t0 = time.monotonic()
    for req, sid in zip(reqs, sessions(reqs)):
        tot["prompt_tokens"] += req["input_length"]
        pages = req["input_length"] // PAGE
        if pages == 0:
            continue
        ids = req["hash_ids"][:pages]
        toks = []
        for h in ids:
            t = cache.get(h)
            if t is None:
                t = cache[h] = block_tokens(h)
            toks.append(t)
        tokens = np.concatenate(toks)
        c = fleet.clients[daemon_of(sid, n)]
        got = 0
        try:
            m = c.match(tokens, lease=True, remote=shared)
            tot["probe_pages"] += m.remote_pages
            if m.pages:
                buf = np.empty(m.pages * bb, dtype=np.uint8)
                tiers = bytearray(m.pages)
                try:
                    got = c.get_into(m.lease, buf, npages=m.pages, tiers=tiers)
                finally:
                    c.release(m.lease)
                words = buf.view(np.uint64)[:: bb // 8][:got]
                good = int(np.count_nonzero(words == np.array(ids[:got], dtype=np.uint64)))
                if good != got:
                    tot["wrong_bytes"] += got - good
                    bad = [(i, int(words[i]), ids[i], tiers[i]) for i in range(got)
                           if int(words[i]) != ids[i]]
                    print("bench_fleet: wrong pages (page, read, want, tier): %s of %d (matched %d,"
                          " remote %d)" % (bad[:8], got, m.pages, m.remote_pages), file=sys.stderr)
                    got = 0
                tot["saved_tokens"] += got * PAGE
                tot["saved_remote_tokens"] += sum(
                    1 for t in tiers[:got] if t == kvtier.Tier.REMOTE) * PAGE
        except kvtier.Error:
            tot["errors"] += 1
            got = 0
        if got < pages:
            payload = np.zeros((pages - got) * bb, dtype=np.uint8)
            payload.view(np.uint64)[:: bb // 8] = np.array(ids[got:], dtype=np.uint64)
            try:
                c.put(tokens, payload, first_page=got)
            except kvtier.Error:
                tot["errors"] += 1
    tot["wall_s"] = round(time.monotonic() - t0, 2)
    tot["saved_ratio"] = round(tot["saved_tokens"] / max(tot["prompt_tokens"], 1), 4)
    return tot


def main() -> int:
    try:
        cluster = Cluster()
    except FileNotFoundError as e:
        print("bench_fleet: %s: skipped" % e, file=sys.stderr)
        return 77
    try:
        ns = [int(x) for x in args.daemons.split(",") if x]
        confs = set(args.configs.split(","))
        for path in args.trace:
            reqs = load(path, args.requests)
            distinct = len({h for r in reqs for h in r["hash_ids"][: r["input_length"] // PAGE]})
            dram = max(int(args.dram_frac * distinct * args.block_bytes), 4 << 20)
            remote_bytes = 2 * distinct * (args.block_bytes + 4160) + (64 << 20)
            name = os.path.basename(path)
            for n in ns:
                runs: Dict[str, List[dict]] = {"one": [], "local": [], "shared": []}
                for k in range(args.repeat):
                    for conf in [c for c in ("one", "local", "shared") if c in confs]:
                        for p in cluster.primaries():
                            cluster.cmd(p, "FLUSHALL")
                        nd, dr = (1, n * dram) if conf == "one" else (n, dram)
                        fleet = Fleet(nd, dr, cluster if conf == "shared" else None,
                                      "fleet-%d-%d-%d" % (os.getpid(), n, k), remote_bytes)
                        try:
                            r = replay(reqs, fleet, conf == "shared")
                        finally:
                            fleet.stop()
                        rec = {"bench": "fleet", "trace": name, "requests": len(reqs),
                               "daemons": n, "config": conf, "run": k + 1,
                               "dram_bytes_per_daemon": dr, "distinct_pages": distinct, **r}
                        print(json.dumps(rec), flush=True)
                        runs[conf].append(r)
                if not all(runs.values()):
                    continue
                summ = {"bench": "fleet", "summary": True, "trace": name, "requests": len(reqs),
                        "daemons": n, "repeat": args.repeat,
                        "prompt_tokens": runs["local"][0]["prompt_tokens"]}
                for conf, rs in runs.items():
                    saved = [r["saved_tokens"] for r in rs]
                    summ[conf + "_saved_tokens"] = int(statistics.median(saved))
                    summ[conf + "_spread"] = [min(saved), max(saved)]
                    summ[conf + "_errors"] = sum(r["errors"] for r in rs)
                    summ[conf + "_wrong_pages"] = sum(r["wrong_bytes"] for r in rs)
                summ["shared_saved_remote_tokens"] = int(
                    statistics.median(r["saved_remote_tokens"] for r in runs["shared"]))
                summ["shared_over_local"] = round(
                    summ["shared_saved_tokens"] / max(summ["local_saved_tokens"], 1), 3)
                summ["fleet_extra_tokens"] = summ["shared_saved_tokens"] - summ["local_saved_tokens"]
                print(json.dumps(summ), flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
