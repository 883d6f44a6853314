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
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from typing import Any, Callable, Dict, List

import torch

import kvtier
from pybench import CONNECTOR_BAR, KEYED_PUT_BAR, Busy, Daemon, verdict

LAYERS, BS, HEADS, HEAD = 32, 16, 8, 128
PAGES = 32
LAYER_BYTES = 2 * BS * HEADS * HEAD * 2  # K and V of 16 tokens, bf16: 64 KiB
PAGE_BYTES = LAYERS * LAYER_BYTES  # 2 MiB
RAW_PAGES_PER_PUT = 8  # 16 MiB per PUT, as bench_vllm.py's raw and the vLLM connector send


def emit(rec: Dict[str, Any]) -> Dict[str, Any]:
    print(json.dumps(rec), flush=True)
    return rec


def gib_s(nbytes: int, secs: float) -> float:
    return round(nbytes / secs / (1 << 30), 3)


def minflt() -> int:
    """The page faults this process has taken so far (all its threads: LMCache's calls run in
    one of their own)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def paired(a: List[float], b: List[float]) -> List[float]:
    """b[i] / a[i] for each pass i: a's speed over b's in the passes they ran side by side."""
    assert len(a) == len(b) and a, (len(a), len(b))
    return [y / x for x, y in zip(a, b)]


def spread(r: List[float]) -> str:
    return "[%.3f..%.3f]" % (r[0], r[1])


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
        assert torch.equal(self.src, self.out), "keyed: other bytes came back"

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
        base = 10_000_000 * p
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
        assert torch.equal(self.src, self.out), "raw: other bytes came back"

    def drop(self) -> None:
        self.c.remove(self.toks[:BS])

    def close(self) -> None:
        self.c.close()


def run(bench: str, build: str, forms: Dict[str, Callable[[str], Form]], passes: int,
        dram: str = "256M", busy: int = 0) -> None:
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
    (pybench.Busy)."""
    total = PAGES * PAGE_BYTES
    daemons: Dict[str, Daemon] = {}
    made: Dict[str, Form] = {}
    secs: Dict[str, Dict[str, List[float]]] = {n: {"save": [], "load": []} for n in forms}
    load = Busy(busy)
    try:
        for name, make in forms.items():
            daemons[name] = Daemon(build, "kvt-bench-%s-%s-" % (bench, name), dram)
            made[name] = make(daemons[name].unix)
        names = list(forms)
        for p in range(1, passes + 2):
            k = (p - 1) % len(names)
            for name in names[k:] + names[:k]:
                f = made[name]
                if p > 1:
                    f.drop()  # the last pass's pages, just now: see WARM
                f.prepare(p)
                f0 = minflt()
                t0 = time.perf_counter()
                f.save()
                t1 = time.perf_counter()
                f1 = minflt()
                f.load()
                t2 = time.perf_counter()
                f2 = minflt()
                f.check()
                for op, s, flt in (("save", t1 - t0, f1 - f0), ("load", t2 - t1, f2 - f1)):
                    secs[name][op].append(s)
                    emit({"bench": bench, "form": name, "op": op, "pass": p, "bytes": total,
                          "gib_s": gib_s(total, s), "minflt": flt})
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
                rec["keyed_put_bar"] = verdict(rec["keyed_over_raw"], KEYED_PUT_BAR)
                bars["keyed_put_%s" % phase] = "%s %.3f (bar %.2f) %s" % (
                    rec["keyed_put_bar"], rec["keyed_over_raw"], KEYED_PUT_BAR,
                    spread(rec["keyed_over_raw_spread"]))
            for n in forms:
                if n not in ("connector", "keyed", "raw"):
                    rec["%s_gib_s" % n] = gib_s(total, t[n])
                    for other in ("connector", "keyed", "raw"):
                        ratio("%s_over_%s" % (n, other), n, other)
            emit(rec)
    emit({"bench": bench, "bars": bars, "busy": busy,
          "verdict": "pass" if all(v.startswith("pass") for k, v in bars.items()
                                   if k.endswith("_warm")) else "fail"})
