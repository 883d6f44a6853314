"""connbench.py: what the connector benchmarks bench_sglang.py and bench_lmcache.py share: the
page they move, the kvtier package's own forms of the same bytes (the baselines), and the run
that sets them side by side. (bench_vllm.py predates it and keeps its own loop.)

A page is 16 tokens of all 32 layers of a model with 8 KV heads of 128 (bf16): 32 x 64 KiB =
2 MiB, as bench_vllm.py's. Each pass moves 32 pages (64 MiB) each way, in three forms:

- connector: the engine's own calls into the kvtier connector (the benchmark's Form);
- keyed: the package's Client.put_keys_each / get_keys_each_into of the same 32 buffers under
  keys of the engine's kind, one independent key per page: the calls both connectors make, so
  connector / keyed is what the connector and the engine's wrapping of it cost;
- raw: the package's token PUT (8 pages, 16 MiB, per PUT) and one leased get_into of all 32
  pages, bench_vllm.py's raw: the package's fastest way to move these bytes.

Each form has a kvtierd of its own, started fresh (pybench.Daemon, DRAM tier only): pass 1 is
its first pass (the DRAM tier faults its memory in as it fills), passes 2.. are warm reruns
(WARM: a pass's pages are removed just before the form's next pass, untimed, so that pass
reuses that memory, as a full tier's evictions hand theirs on). They used to be removed right
after the pass; the other forms' passes then ran in between, and a round took over a second on
a loaded machine: long enough for the DRAM tier's shared arenas to give the freed pages back
to the kernel (their decay, about a second, tiers/dram.c), so that most "warm" passes wrote
into fresh pages, a zero-filling page fault each 4 KiB (16,384 a pass), and measured the
kernel's page faults under load rather than the forms (their ratios swung 0.1-12 pass to
pass). The forms run
interleaved pass by pass, their order rotating, so that a change in the machine's load reaches
all three alike. The client-side buffers are written before pass 1.

The warm ratios are the median of paired ratios: form A's time over form B's within each warm
pass (the two ran back to back, under the same load), the median over the passes, printed with
the spread (the lowest and highest pass). A ratio of two medians taken apart lets a stray slow
pass of one form move it; with a few seconds' benchmark and the machine shared, the ratio swung
0.4-2.0 between runs. Each pass's line also says how many page faults the process took in the
operation (minflt): a zero-copy save writes into the daemon's memfd, and pages the DRAM tier
gave back to the kernel come back as fresh zeroed pages, a fault each 4 KiB, in whichever form
meets them (see WARM): a warm pass with thousands is one that did not reuse its memory.

Each op's line also says what the scheduler did meanwhile (Sched): how long this process's
threads (wait_ms) and the form's kvtierd (daemon_wait_ms) waited for a CPU, this process's
involuntary context switches (nivcsw), and preempted when the waits came to 10% of the op's
time or more. They are read around the timed window, outside it.

The keyed PUT's bar is also set with two CPU-bound processes beside (--busy 2). There the
passes' paired ratios swung 0.01-9 and their median of 12 read 0.56-1.66 from run to run of
the same code, and the rotation put the keyed save before the raw one in most passes.
So with busy the bar is judged on BUSY_PAIRS paired saves of the keyed and raw forms alone,
after the passes (keyed_pairs): per pair the two saves back to back, in an order shuffled
half each way (pair_orders), then both loaded and checked, untimed. The summary gives their
median ratio, its 95% confidence interval from order statistics (median_ci), the spread, the
passes' own median beside it (keyed_over_raw_passes), and the median over the pairs neither of
whose saves was preempted and by which form went first (pair_summary). No pair is left out of
the judged median; the bar (0.95) is unchanged.

The forms' checks compare bytes with memcmp (same), not torch.equal: its OpenMP worker went on
spinning into the next form's timed save.
"""

from __future__ import annotations

import ctypes
import glob
import json
import math
import random
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import kvtier
from pybench import CONNECTOR_BAR, KEYED_PUT_BAR, Busy, Daemon, verdict

LAYERS, BS, HEADS, HEAD = 32, 16, 8, 128
PAGES = 32
LAYER_BYTES = 2 * BS * HEADS * HEAD * 2  # K and V of 16 tokens, bf16: 64 KiB
PAGE_BYTES = LAYERS * LAYER_BYTES  # 2 MiB
RAW_PAGES_PER_PUT = 8  # 16 MiB per PUT, as bench_vllm.py's raw and the vLLM connector send
# Paired saves of the keyed and the raw form run with --busy (keyed_pairs): with 100 the 95%
# interval of their median runs from the 40th to the 61st ratio.
BUSY_PAIRS = 100


def emit(rec: Dict[str, Any]) -> Dict[str, Any]:
    print(json.dumps(rec), flush=True)
    return rec


def gib_s(nbytes: int, secs: float) -> float:
    return round(nbytes / secs / (1 << 30), 3)


def minflt() -> int:
    """The page faults this process has taken so far (all its threads: LMCache's calls run in
    one of their own)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _run_delay_ns(pid: str) -> int:
    """The time the threads of process pid (\"self\" or a number) have spent runnable but
    waiting for a CPU, ns (the second field of each /proc/PID/task/TID/schedstat); 0 where the
    kernel does not keep it."""
    total = 0
    for f in glob.glob("/proc/%s/task/*/schedstat" % pid):
        try:
            with open(f) as fh:
                total += int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return total


class Sched:
    """What the scheduler did to this process and to a form's kvtierd between start() and
    stop(): how long their threads waited on a run queue (ms) and this process's involuntary
    context switches. Read outside the timed window, around it. PREEMPTED_SHARE: an op counts
    as preempted when the two together waited for at least that share of its time (on an idle
    machine they wait for none of it: a 64 MiB save is a few ms of one thread's CPU)."""

    PREEMPTED_SHARE = 0.10

    def __init__(self, daemon_pid: int) -> None:
        self.dpid = str(daemon_pid)
        self.w0 = self.d0 = self.c0 = 0

    def start(self) -> None:
        self.c0 = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        self.w0 = _run_delay_ns("self")
        self.d0 = _run_delay_ns(self.dpid)

    def stop(self, secs: float) -> Dict[str, Any]:
        wait = (_run_delay_ns("self") - self.w0) / 1e6
        dwait = (_run_delay_ns(self.dpid) - self.d0) / 1e6
        nivcsw = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - self.c0
        return {"wait_ms": round(wait, 3), "daemon_wait_ms": round(dwait, 3), "nivcsw": nivcsw,
                "preempted": wait + dwait >= self.PREEMPTED_SHARE * secs * 1e3}


def median_ci(x: Sequence[float], level: float = 0.95) -> Tuple[float, float, float]:
    """A distribution-free confidence interval of the median of x, from its order statistics:
    (x_(k), x_(n+1-k), coverage) for the largest k whose coverage, 1 - 2 P(B <= k - 1) with
    B ~ Binomial(n, 1/2), is still at least level (the exact coverage is returned, it moves in
    steps). With too few samples for level (n < 6 for 0.95) it is the range, with the coverage
    that has."""
    s = sorted(x)
    n = len(s)
    assert n, "no samples"

    def below(k: int) -> float:  # P(B <= k - 1), exactly (integers, then one division)
        return sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * below(k + 1) >= level:
        k += 1
    return s[k - 1], s[n - k], 1 - 2 * below(k)


def pair_orders(n: int, seed: int = 35) -> List[bool]:
    """Whether the keyed save goes first in each of n pairs: half of the pairs each way (an odd
    n's last one more keyed first), in an order shuffled with a fixed seed, so that neither
    form is always the one that starts right after the untimed work (the last pair's loads and
    checks) or inherits the other's preemption, and nothing periodic in the machine lines up
    with a strict alternation."""
    order = [i % 2 == 0 for i in range(n)]
    random.Random(seed).shuffle(order)
    return order


def pair_summary(keyed: Sequence[float], raw: Sequence[float], keyed_first: Sequence[bool],
                 quiet: Sequence[bool]) -> Dict[str, Any]:
    """The keyed PUT over the raw PUT from paired saves (their times, s, the same index one
    pair): the median of the paired ratios with its 95% interval and the spread, over all
    pairs (the figure the bar is judged on: no pair left out), then the same median over the
    pairs in which neither save was preempted (quiet: what the keyed PUT costs when the
    machine leaves both alone) and by which form went first."""
    r = paired(list(keyed), list(raw))
    lo, hi, cov = median_ci(r)
    rec: Dict[str, Any] = {
        "keyed_over_raw": round(statistics.median(r), 3),
        "keyed_over_raw_ci": [round(lo, 3), round(hi, 3)],
        "keyed_over_raw_ci_coverage": round(cov, 3),
        "keyed_over_raw_spread": [round(min(r), 3), round(max(r), 3)],
        "keyed_over_raw_pairs": len(r)}
    for name, sel in (("quiet", list(quiet)), ("keyed_first", list(keyed_first)),
                      ("raw_first", [not k for k in keyed_first])):
        sub = [v for v, s in zip(r, sel) if s]
        rec["keyed_over_raw_%s_pairs" % name] = len(sub)
        rec["keyed_over_raw_%s" % name] = round(statistics.median(sub), 3) if sub else None
    return rec


def paired(a: List[float], b: List[float]) -> List[float]:
    """b[i] / a[i] for each pass i: a's speed over b's in the passes they ran side by side."""
    assert len(a) == len(b) and a, (len(a), len(b))
    return [y / x for x, y in zip(a, b)]


def spread(r: List[float]) -> str:
    return "[%.3f..%.3f]" % (r[0], r[1])


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b (contiguous CPU tensors of one size) hold the same bytes: one memcmp on
    this thread. The checks used torch.equal, whose OpenMP region leaves torch's worker thread
    spinning for its next task (the OpenMP runtime's wait policy), about 7-10 ms of CPU in the
    50 ms after it, into the next form's timed save: on 2 cores with two CPU-bound processes
    beside (--busy 2), whichever save followed a check paid for it (docs/benchmarks.md, "The
    keyed PUT's bar under two busy processes")."""
    assert a.is_contiguous() and b.is_contiguous(), "same: not contiguous"
    n = a.numel() * a.element_size()
    assert n == b.numel() * b.element_size(), "same: sizes differ"
    return _memcmp(a.data_ptr(), b.data_ptr(), n) == 0


def mark(t: torch.Tensor, p: int) -> None:
    """Makes a pass's bytes differ from the last pass's (one byte in each 4 KiB), so that a
    load that returned stale bytes fails the check."""
    t.view(torch.uint8).view(-1)[::4096] = p & 0xFF


class Form:
    """One way of moving a pass's pages into kvtierd and back. The runner times save() and
    load() only; prepare() (keys, references), check() (the bytes came back) and drop()
    (removes the pass's pages: called before the next prepare(), and after the last pass)
    are untimed."""

    def prepare(self, p: int) -> None:
        pass

    def save(self) -> None:
        raise NotImplementedError

    def load(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        pass

    def drop(self) -> None:
        pass

    def close(self) -> None:
        pass


class Keyed(Form):
    """The package's independent-key calls on the same pages, keys from names(pass)."""

    def __init__(self, unix: str, names: Callable[[int], List[str]]) -> None:
        self.names = names
        self.c = kvtier.Client("bench-keyed", page_size=kvtier.KEY_TOKENS,
                               block_bytes=PAGE_BYTES, unix_path=unix, timeout_ms=60000)
        g = torch.Generator().manual_seed(7)
        self.src = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, generator=g)
        self.out = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
        self.srcs = list(self.src)
        self.outs = list(self.out)
        self.keys: List[str] = []
        self.ok: List[bool] = []
        self.got: List[bool] = []

    def prepare(self, p: int) -> None:
        self.keys = self.names(p)
        mark(self.src, p)

    def save(self) -> None:
        self.ok = self.c.put_keys_each(self.keys, self.srcs)

    def load(self) -> None:
        self.got = self.c.get_keys_each_into(self.keys, self.outs)

    def check(self) -> None:
        assert all(self.ok) and all(self.got), "keyed: pages not stored or not found"
        assert same(self.src, self.out), "keyed: other bytes came back"

    def drop(self) -> None:
        assert all(self.c.remove_keys_each(self.keys))

    def close(self) -> None:
        self.c.close()


class Raw(Form):
    """The package's token calls: 8 pages per PUT, one leased GET of all the pages."""

    def __init__(self, unix: str) -> None:
        self.c = kvtier.Client("bench-raw", page_size=BS, block_bytes=PAGE_BYTES, unix_path=unix,
                               timeout_ms=60000)
        g = torch.Generator().manual_seed(8)
        self.src = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, generator=g)
        self.out = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
        self.toks = torch.zeros(0, dtype=torch.int32)
        self.got = 0

    def prepare(self, p: int) -> None:
        base = 1_000_000 * p  # 512 tokens a pass; int32 up to pass 2,147 (keyed_pairs)
        self.toks = torch.arange(base, base + PAGES * BS, dtype=torch.int32)
        mark(self.src, p)

    def save(self) -> None:
        n = RAW_PAGES_PER_PUT
        for a in range(0, PAGES, n):
            self.c.put(self.toks[:(a + n) * BS], self.src[a:a + n], first_page=a)

    def load(self) -> None:
        m = self.c.match(self.toks, lease=True)
        self.got = self.c.get_into(m.lease, self.out, npages=PAGES)
        self.c.release(m.lease)

    def check(self) -> None:
        assert self.got == PAGES, self.got
        assert same(self.src, self.out), "raw: other bytes came back"

    def drop(self) -> None:
        self.c.remove(self.toks[:BS])

    def close(self) -> None:
        self.c.close()


def keyed_pairs(bench: str, keyed: Form, raw: Form, ks: Sched, rs: Sched, n: int,
                p0: int) -> Dict[str, Any]:
    """n paired warm saves of the keyed and the raw form (passes p0.., one line per save,
    "pair" its index), for the keyed PUT's bar: per pair, each form's pages of its last pass
    are removed and its next pass's prepared just before its save (untimed, see WARM), the two
    saves timed back to back in the order pair_orders gives; then both are loaded and checked,
    untimed. What is timed is the passes' save, alone. Returns pair_summary's fields."""
    t: Dict[str, List[float]] = {"keyed": [], "raw": []}
    quiet: List[bool] = []
    orders = pair_orders(n)
    for i, kfirst in enumerate(orders):
        p = p0 + i
        calm = True
        for name in (("keyed", "raw") if kfirst else ("raw", "keyed")):
            f, sc = (keyed, ks) if name == "keyed" else (raw, rs)
            f.drop()
            f.prepare(p)
            sc.start()
            f0 = minflt()
            t0 = time.perf_counter()
            f.save()
            t1 = time.perf_counter()
            flt = minflt() - f0
            got = sc.stop(t1 - t0)
            calm = calm and not got["preempted"]
            t[name].append(t1 - t0)
            emit({"bench": bench, "form": name, "op": "save", "pass": p, "pair": i,
                  "first": name == ("keyed" if kfirst else "raw"), "bytes": PAGES * PAGE_BYTES,
                  "gib_s": gib_s(PAGES * PAGE_BYTES, t1 - t0), "minflt": flt, **got})
        quiet.append(calm)
        for f in (keyed, raw):
            f.load()
            f.check()
    return pair_summary(t["keyed"], t["raw"], orders, quiet)


def run(bench: str, build: str, forms: Dict[str, Callable[[str], Form]], passes: int,
        dram: str = "256M", busy: int = 0, pairs: Optional[int] = None) -> None:
    """Runs pass 1 (first) and passes 2..passes+1 (warm) of each form against its own fresh
    kvtierd, printing one line per form, operation and pass, then the summary lines: for save
    and load, first and warm, the connector's GiB/s beside the keyed and raw forms' (the median
    of the phase's passes) and the ratios (the median of the paired ratios of the phase's
    passes, with their spread). passes: a multiple of the number of forms gives each form each
    place in the rotation equally often. forms: name -> constructor taking the daemon's Unix
    socket path; "connector", "keyed" and "raw" are expected. Any other form (bench_sglang's
    "connector_v1") adds NAME_gib_s and its ratios over the three to the summary lines.
    Each summary line carries the bars (pybench.CONNECTOR_BAR, KEYED_PUT_BAR) with pass or
    fail, and a last line lists them all. busy: CPU-bound processes running beside the passes
    (pybench.Busy). pairs: after the passes, that many paired saves of the keyed and the raw
    form (keyed_pairs), on which the keyed PUT's warm bar is then judged (None: BUSY_PAIRS
    with busy, else none). Each op's line says how long this process and the form's kvtierd
    waited for a CPU meanwhile (Sched) and whether that made it preempted."""
    if pairs is None:
        pairs = BUSY_PAIRS if busy else 0
    total = PAGES * PAGE_BYTES
    daemons: Dict[str, Daemon] = {}
    made: Dict[str, Form] = {}
    secs: Dict[str, Dict[str, List[float]]] = {n: {"save": [], "load": []} for n in forms}
    sched: Dict[str, Sched] = {}
    pair_recs: Dict[str, Any] = {}
    load = Busy(busy)
    try:
        for name, make in forms.items():
            daemons[name] = Daemon(build, "kvt-bench-%s-%s-" % (bench, name), dram)
            sched[name] = Sched(daemons[name].proc.pid)
            made[name] = make(daemons[name].unix)
        names = list(forms)
        for p in range(1, passes + 2):
            k = (p - 1) % len(names)
            for name in names[k:] + names[:k]:
                f = made[name]
                if p > 1:
                    f.drop()  # the last pass's pages, just now: see WARM
                f.prepare(p)
                sched[name].start()
                f0 = minflt()
                t0 = time.perf_counter()
                f.save()
                t1 = time.perf_counter()
                f1 = minflt()
                # The load's window opens after the save's scheduler figures are read (a few
                # /proc files, 0.1-0.5 ms), so that neither window times that reading.
                saved = sched[name].stop(t1 - t0)
                sched[name].start()
                f1b = minflt()
                t1b = time.perf_counter()
                f.load()
                t2 = time.perf_counter()
                f2 = minflt()
                loaded = sched[name].stop(t2 - t1b)
                f.check()
                for op, s, flt, sc in (("save", t1 - t0, f1 - f0, saved),
                                       ("load", t2 - t1b, f2 - f1b, loaded)):
                    secs[name][op].append(s)
                    emit({"bench": bench, "form": name, "op": op, "pass": p, "bytes": total,
                          "gib_s": gib_s(total, s), "minflt": flt, **sc})
        if pairs:
            pair_recs = keyed_pairs(bench, made["keyed"], made["raw"], sched["keyed"],
                                    sched["raw"], pairs, passes + 2)
        for f in made.values():
            f.drop()
    finally:
        load.stop()
        for f in made.values():
            f.close()
        for d in daemons.values():
            d.stop()
    bars: Dict[str, str] = {}
    for op, base in (("save", "put"), ("load", "get")):
        for phase in ("first", "warm"):
            # The passes of the phase: pass 1, or passes 2..; a form's speed is its median time.
            sel = {n: (v[op][:1] if phase == "first" else v[op][1:]) for n, v in secs.items()}
            t = {n: statistics.median(v) for n, v in sel.items()}
            rec = {"bench": bench, "summary": op, "pass": phase, "page_bytes": PAGE_BYTES,
                   "layers": LAYERS, "pages": PAGES, "passes": len(sel["raw"]),
                   "connector_gib_s": gib_s(total, t["connector"]),
                   "keyed_%s_gib_s" % base: gib_s(total, t["keyed"]),
                   "raw_%s_gib_s" % base: gib_s(total, t["raw"]), "busy": busy}

            def ratio(name: str, a: str, b: str) -> float:
                """b's time over a's pass by pass (a's speed over b's): median into rec[name],
                the lowest and highest pass into rec[name + "_spread"]."""
                r = paired(sel[a], sel[b])
                rec[name] = round(statistics.median(r), 3)
                rec[name + "_spread"] = [round(min(r), 3), round(max(r), 3)]
                return rec[name]

            ratio("connector_over_keyed", "connector", "keyed")
            ratio("connector_over_raw", "connector", "raw")
            rec["connector_bar"] = verdict(rec["connector_over_raw"], CONNECTOR_BAR)
            bars["connector_%s_%s" % (op, phase)] = "%s %.3f (bar %.2f) %s" % (
                rec["connector_bar"], rec["connector_over_raw"], CONNECTOR_BAR,
                spread(rec["connector_over_raw_spread"]))
            if op == "save":
                ratio("keyed_over_raw", "keyed", "raw")
                how = ""
                if phase == "warm" and pair_recs:
                    # Judged on the paired saves (keyed_pairs): the passes' own median stays
                    # beside it as keyed_over_raw_passes.
                    rec["keyed_over_raw_passes"] = rec["keyed_over_raw"]
                    rec["keyed_over_raw_passes_spread"] = rec["keyed_over_raw_spread"]
                    rec.update(pair_recs)
                    how = " 95%% CI [%.3f..%.3f] of %d pairs" % (
                        rec["keyed_over_raw_ci"][0], rec["keyed_over_raw_ci"][1],
                        rec["keyed_over_raw_pairs"])
                rec["keyed_put_bar"] = verdict(rec["keyed_over_raw"], KEYED_PUT_BAR)
                bars["keyed_put_%s" % phase] = "%s %.3f (bar %.2f) %s%s" % (
                    rec["keyed_put_bar"], rec["keyed_over_raw"], KEYED_PUT_BAR,
                    spread(rec["keyed_over_raw_spread"]), how)
            for n in forms:
                if n not in ("connector", "keyed", "raw"):
                    rec["%s_gib_s" % n] = gib_s(total, t[n])
                    for other in ("connector", "keyed", "raw"):
                        ratio("%s_over_%s" % (n, other), n, other)
            emit(rec)
    emit({"bench": bench, "bars": bars, "busy": busy,
          "verdict": "pass" if all(v.startswith("pass") for k, v in bars.items()
                                   if k.endswith("_warm")) else "fail"})
