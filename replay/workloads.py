#!/usr/bin/env python3
"""workloads.py: synthetic request traces of six workload families that serving fleets see, in
the Mooncake format (traces/README.md), and the runner that replays them through kvtier-replay
for every policy at the tier sizes of issue 40 and prints one row per family, seed and tier
configuration (docs/policy.md, section 5).

The two Mooncake logs are one chat service and one mix; a policy tuned on them alone can learn
their quirks. The families here stress the signals a policy may read in turn: recency (agents
paused for tool calls), frequency (documents reused behind different prefixes), a hot shared
prefix (one system prompt, many questions), scans (bursts of users who never return).

    workloads.py gen FAMILY SEED [-n REQUESTS] [-o FILE]    one trace (stdout without -o)
    workloads.py run --replay PATH [-n REQUESTS] [--families A,B] [--seeds 0-4] [--table]
    workloads.py table ROWS.jsonl                          the table again from run's output

`run --references lru-dead-first` also replays the replay's reference policies, which read the
trace's future as the oracle does (docs/policy.md, section 4, "What each part of the gap is"),
and reports the share of the LRU-to-oracle gap each closes; without it the output is unchanged.

A trace depends only on (family, seed, requests) and is the same bytes on every run (Python's
random.Random seeded by a string, no hash randomisation, no clock). Standard library only.

Block ids: one id per 512-token block, as in the Mooncake logs. A session's prompt is a list of
blocks that only grows; its last block is cut short (a prompt rarely ends on a block edge), and
the next turn holds that block whole: the partial block is the first tokens of the whole one,
as kvt_trace_tokens() makes them, so the replay sees one prompt extend the other. A document is
the same ids wherever it is pasted, so behind two prefixes it is two sets of pages in the tree.

Hints (traces/README.md, "Engine hints"): a record may carry what a real engine knows when that
request's generation ends, never the future: "hint_pause_ms" (the reply was a tool call; the
expected pause is the tool's typical duration, not the pause the trace then draws) and
"hint_finished" (the agent gave its final answer). Only the families where an engine knows
these emit them: agents, and the agents inside the mix.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

BLOCK = 512
FAMILIES = ("chat", "agent", "sysprompt", "docs", "burst", "mix")
# Tuning set of issue 40: seeds 0-1 of four families; the other seeds of those, and every seed of
# the two families below, are held out.
HELD_OUT_FAMILIES = ("docs", "mix")
# The families whose records carry hint events (an engine knows them there): the runner also
# replays these with the cost policy reading them (kvtier-replay --trace-hints).
HINTED_FAMILIES = ("agent", "mix")
TUNING_SEEDS = (0, 1)
SEEDS = (0, 1, 2, 3, 4)
POLICIES = ("cost", "lru", "lfu", "oracle")
# kvtier-replay's reference policies (not policies an engine can run: they read the future).
REFERENCES = ("lru-dead-first",)
# The tier configurations: percentages of the working set split 1:4:15 over HBM/DRAM/NVMe, and
# the replay's default (1/4/15) with the remote tier (30), as kvtier-replay names it.
CONFIGS = (
    ("5%", ["--hbm", "0.25", "--dram", "1", "--nvme", "3.75"]),
    ("10%", ["--hbm", "0.5", "--dram", "2", "--nvme", "7.5"]),
    ("25%", ["--hbm", "1.25", "--dram", "5", "--nvme", "18.75"]),
    ("remote", ["--hbm", "1", "--dram", "4", "--nvme", "15", "--remote", "30"]),
)

Req = Dict[str, Any]


class Ids:
    """Fresh block ids, 0, 1, 2 ... in the order the generator asks for them."""

    def __init__(self) -> None:
        self.n = 0

    def take(self, k: int) -> List[int]:
        out = list(range(self.n, self.n + k))
        self.n += k
        return out


class Zipf:
    """Index 0..n-1 with weight 1 / (i + 1)^s: a few items take most uses."""

    def __init__(self, n: int, s: float) -> None:
        acc, self.cum = 0.0, []
        for i in range(n):
            acc += 1.0 / (i + 1) ** s
            self.cum.append(acc)

    def pick(self, rng: random.Random) -> int:
        x = rng.random() * self.cum[-1]
        lo, hi = 0, len(self.cum) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cum[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return lo


def record(t_ms: float, blocks: Sequence[int], rng: random.Random, out_len: int,
           hint: Optional[Tuple[str, int]] = None) -> Req:
    """A request over blocks, its last block cut short by 0..511 tokens."""
    n = len(blocks) * BLOCK - rng.randrange(BLOCK)
    r: Req = {"timestamp": int(t_ms), "input_length": n, "output_length": out_len,
              "hash_ids": list(blocks)}
    if hint is not None:
        r[hint[0]] = hint[1]
    return r


def lognorm(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw with the given mean."""
    return mean * math.exp(rng.gauss(0.0, sigma) - sigma * sigma / 2)


# ---- the sources: each makes one session (or one burst) starting at t ------------------------


class Chat:
    """Multi-turn chat: one of a few system prompts, a user's turns, the replies folded into
    the next prompt; minutes of thinking between turns. The engine cannot know a user's last
    turn, so no hints."""

    rate = 1 / 4.0  # sessions per second

    def __init__(self, rng: random.Random, ids: Ids) -> None:
        self.sys = [ids.take(rng.randint(2, 6)) for _ in range(6)]
        self.pop = Zipf(len(self.sys), 1.2)

    def session(self, rng: random.Random, ids: Ids, t: float) -> List[Req]:
        blocks = list(self.sys[self.pop.pick(rng)]) + ids.take(rng.randint(1, 6))
        turns = 1 + min(int(rng.expovariate(1 / 4.0)), 30)
        out = []
        for k in range(turns):
            reply = rng.randint(60, 900)
            out.append(record(t, blocks, rng, reply))
            blocks = blocks + ids.take(math.ceil(reply / BLOCK) + rng.randint(0, 2))
            t += 1000 * lognorm(rng, 45.0, 1.0)
        return out


class Agent:
    """Agent sessions: a long system prompt with tool definitions (one of a few agent kinds), a
    task, then steps that each end in a tool call; the tool's output joins the context and the
    next step comes when the tool returns. Tools range from a search (seconds) to a human's
    approval (minutes). The engine sees the tool call, so it hints the pause (the tool's typical
    duration); the agent's final answer ends the session (hint_finished)."""

    rate = 1 / 6.0
    TOOLS = ((3000, 0.40), (15000, 0.30), (45000, 0.20), (240000, 0.10))  # (typical ms, share)

    def __init__(self, rng: random.Random, ids: Ids, hints: bool = True) -> None:
        self.sys = [ids.take(rng.randint(8, 16)) for _ in range(3)]
        self.hints = hints

    def tool(self, rng: random.Random) -> int:
        x = rng.random()
        for ms, share in self.TOOLS:
            if x < share:
                return ms
            x -= share
        return self.TOOLS[-1][0]

    def session(self, rng: random.Random, ids: Ids, t: float) -> List[Req]:
        blocks = list(self.sys[rng.randrange(len(self.sys))]) + ids.take(rng.randint(1, 4))
        steps = rng.randint(3, 16)
        out = []
        for k in range(steps):
            last = k == steps - 1
            typical = self.tool(rng)
            hint: Optional[Tuple[str, int]] = None
            if self.hints:
                hint = ("hint_finished", 1) if last else ("hint_pause_ms", typical)
            out.append(record(t, blocks, rng, rng.randint(40, 400), hint))
            blocks = blocks + ids.take(rng.randint(1, 5))
            t += lognorm(rng, typical, 0.6) + 1000 * rng.uniform(1, 4)  # the tool, then decode
        return out


class SysPrompt:
    """One system prompt shared by many questions: a few long prompts of very different
    popularity, one-shot questions after them, a share of them asked again (a FAQ)."""

    rate = 2.0

    def __init__(self, rng: random.Random, ids: Ids) -> None:
        self.sys = [ids.take(rng.randint(4, 24)) for _ in range(8)]
        self.pop = Zipf(len(self.sys), 1.1)
        self.faq: List[List[List[int]]] = [[] for _ in self.sys]
        self.fpop = Zipf(64, 1.0)

    def session(self, rng: random.Random, ids: Ids, t: float) -> List[Req]:
        s = self.pop.pick(rng)
        faq = self.faq[s]
        if faq and rng.random() < 0.2:
            q = faq[self.fpop.pick(rng) % len(faq)]
        else:
            q = ids.take(rng.randint(1, 3))
            if len(faq) < 64 and rng.random() < 0.3:
                faq.append(q)
        return [record(t, self.sys[s] + q, rng, rng.randint(50, 500))]


class Docs:
    """Documents reused mid-prompt behind different prefixes: each user has a prefix of their
    own (a tenant's system prompt and the user's profile), and pastes documents from a shared
    pool of Zipf popularity, then asks a follow-up or two. The same document ids sit behind
    many prefixes: only a user coming back to a document reuses its pages."""

    rate = 1.0

    def __init__(self, rng: random.Random, ids: Ids) -> None:
        tenants = [ids.take(rng.randint(2, 5)) for _ in range(3)]
        self.users = [tenants[rng.randrange(3)] + ids.take(rng.randint(1, 4)) for _ in range(120)]
        self.upop = Zipf(len(self.users), 0.9)
        self.docs = [ids.take(rng.randint(2, 24)) for _ in range(300)]
        self.dpop = Zipf(len(self.docs), 1.0)

    def session(self, rng: random.Random, ids: Ids, t: float) -> List[Req]:
        blocks = self.users[self.upop.pick(rng)] + self.docs[self.dpop.pick(rng)]
        blocks = blocks + ids.take(1)
        out = []
        for _ in range(1 + min(int(rng.expovariate(1 / 0.8)), 4)):
            reply = rng.randint(100, 700)
            out.append(record(t, blocks, rng, reply))
            blocks = blocks + ids.take(math.ceil(reply / BLOCK) + 1)
            t += 1000 * lognorm(rng, 30.0, 0.8)
        return out


class Burst:
    """Bursts of new users (a launch, a link shared): every couple of minutes dozens of users
    arrive within seconds behind the app's system prompt, most asking once and leaving, a few
    coming back once; beside them a trickle of regular chat sessions."""

    rate = 1 / 90.0  # bursts per second

    def __init__(self, rng: random.Random, ids: Ids) -> None:
        self.app = ids.take(4)
        self.chat = Chat(rng, ids)

    def session(self, rng: random.Random, ids: Ids, t: float) -> List[Req]:
        out: List[Req] = []
        for _ in range(rng.randint(2, 6)):  # the regulars between bursts
            out += self.chat.session(rng, ids, t + rng.uniform(0, 90000))
        for _ in range(rng.randint(20, 90)):
            u = t + rng.uniform(0, 5000)
            blocks = self.app + ids.take(rng.randint(2, 10))
            out.append(record(u, blocks, rng, rng.randint(50, 600)))
            if rng.random() < 0.15:
                blocks = blocks + ids.take(rng.randint(1, 3))
                out.append(record(u + 1000 * rng.uniform(10, 90), blocks, rng, 200))
        return out


def sources(family: str, rng: random.Random, ids: Ids) -> List[Tuple[float, Any]]:
    """(sessions per second, source) of a family."""
    if family == "chat":
        return [(Chat.rate, Chat(rng, ids))]
    if family == "agent":
        return [(Agent.rate, Agent(rng, ids))]
    if family == "sysprompt":
        return [(SysPrompt.rate, SysPrompt(rng, ids))]
    if family == "docs":
        return [(Docs.rate, Docs(rng, ids))]
    if family == "burst":
        return [(Burst.rate, Burst(rng, ids))]
    if family == "mix":
        return [(Chat.rate / 3, Chat(rng, ids)), (Agent.rate / 3, Agent(rng, ids)),
                (SysPrompt.rate / 3, SysPrompt(rng, ids)), (Docs.rate / 3, Docs(rng, ids)),
                (Burst.rate / 3, Burst(rng, ids))]
    raise ValueError("unknown family %r (one of %s)" % (family, ", ".join(FAMILIES)))


def generate(family: str, seed: int, requests: int) -> List[Req]:
    """The first `requests` requests of the family's trace for this seed, in time order."""
    if requests < 1:
        raise ValueError("requests must be >= 1, not %r" % (requests,))
    if seed < 0:
        raise ValueError("seed must be >= 0, not %r" % (seed,))
    rng = random.Random("kvtier-workload:%s:%d" % (family, seed))
    ids = Ids()
    srcs = sources(family, rng, ids)
    # Session starts by Poisson arrivals per source, taken in time order; a session's requests
    # reach past its start. Stop once every session that starts before the n-th request (in
    # time) is made: then the first n requests are final.
    heap = [(rng.expovariate(rate) * 1000, i) for i, (rate, _) in enumerate(srcs)]
    heapq.heapify(heap)
    reqs: List[Tuple[int, int, Req]] = []
    seq = 0
    while True:
        t, i = heapq.heappop(heap)
        if len(reqs) >= requests:
            reqs.sort(key=lambda x: (x[0], x[1]))
            if t > reqs[requests - 1][0]:
                break
        for r in srcs[i][1].session(rng, ids, t):
            reqs.append((r["timestamp"], seq, r))
            seq += 1
        heapq.heappush(heap, (t + rng.expovariate(srcs[i][0]) * 1000, i))
    reqs.sort(key=lambda x: (x[0], x[1]))
    out = [r for _, _, r in reqs[:requests]]
    t0 = out[0]["timestamp"]
    for r in out:
        r["timestamp"] -= t0
    return out


def write(reqs: Sequence[Req], f: Any) -> None:
    for r in reqs:
        f.write(json.dumps(r, separators=(", ", ": ")) + "\n")


# ---- the runner -------------------------------------------------------------------------------


def held_out(family: str, seed: int) -> bool:
    return family in HELD_OUT_FAMILIES or seed not in TUNING_SEEDS


def replay(binary: str, trace: str, config: Sequence[str], extra: Sequence[str] = (),
           refs: Sequence[str] = ()) -> List[Dict[str, Any]]:
    cmd = [binary, "--no-progress", "--policy", ",".join(list(POLICIES) + list(refs))] + \
        list(config) + list(extra) + [trace]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr))
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def row(family: str, seed: int, config: str, results: Sequence[Dict[str, Any]],
        refs: Sequence[str] = ()) -> Dict[str, Any]:
    """One family x seed x configuration: prefill seconds per policy, the gap the cost policy
    closes from LRU to the oracle, and whether it is never worse than min(LRU, LFU); where the
    trace carries hint events, the same for the cost policy reading them ("cost+hints") and
    the share of prefill time they save; for each reference policy asked for, its prefill
    seconds and the share of the gap it closes (gap_closed_ref)."""
    s = {}
    hinted = None
    for r in results:
        if r.get("hint_source") == "trace":
            hinted = r["prefill_seconds_total"]
        elif "hint_accuracy" not in r:
            s[r["policy"]] = r["prefill_seconds_total"]
    missing = [p for p in list(POLICIES) + list(refs) if p not in s]
    if missing:
        raise RuntimeError("%s seed %d %s: no result for %s" % (family, seed, config, missing))
    gap = s["lru"] - s["oracle"]
    best = min(s["lru"], s["lfu"])
    out = {
        "family": family, "seed": seed, "config": config,
        "set": "held-out" if held_out(family, seed) else "tuning",
        "requests": results[0]["requests"], "working_set_tokens": results[0]["working_set_tokens"],
        "prefill_s": {p: round(s[p], 3) for p in POLICIES},
        # None where LRU already matches the oracle: nothing to close
        "gap_closed": round((s["lru"] - s["cost"]) / gap, 4) if gap > 1e-9 else None,
        # a relative slack of 1e-9: the sums of the same charges in another order
        "never_worse": s["cost"] <= best * (1 + 1e-9),
        "oracle_ok": s["oracle"] <= best * (1 + 1e-9),
    }
    if hinted is not None:
        out["prefill_s"]["cost+hints"] = round(hinted, 3)
        out["gap_closed_hints"] = round((s["lru"] - hinted) / gap, 4) if gap > 1e-9 else None
        out["hint_gain"] = round((s["cost"] - hinted) / s["cost"], 4)
    if refs:
        for p in refs:
            out["prefill_s"][p] = round(s[p], 3)
        out["gap_closed_ref"] = {p: round((s["lru"] - s[p]) / gap, 4) if gap > 1e-9 else None
                                 for p in refs}
    return out


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per family, configuration and set (tuning or held-out): prefill seconds per policy summed
    over the seeds, the mean gap closed, and whether every seed passed."""
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["config"], r["set"]), []).append(r)
    out = []
    for (fam, cfg, st), rs in groups.items():
        gaps = [r["gap_closed"] for r in rs if r["gap_closed"] is not None]
        pols = list(rs[0]["prefill_s"])
        g = {
            "family": fam, "config": cfg, "set": st, "seeds": [r["seed"] for r in rs],
            "prefill_s": {p: round(sum(r["prefill_s"][p] for r in rs), 3) for p in pols},
            "gap_closed_mean": round(sum(gaps) / len(gaps), 4) if gaps else None,
            "never_worse": all(r["never_worse"] for r in rs),
            "oracle_ok": all(r["oracle_ok"] for r in rs),
        }
        if "cost+hints" in pols:
            hg = [r["gap_closed_hints"] for r in rs if r["gap_closed_hints"] is not None]
            g["gap_closed_hints_mean"] = round(sum(hg) / len(hg), 4) if hg else None
            g["hint_gain"] = round(1 - g["prefill_s"]["cost+hints"] / g["prefill_s"]["cost"], 4)
        if "gap_closed_ref" in rs[0]:
            g["gap_closed_ref_mean"] = {}
            for p in rs[0]["gap_closed_ref"]:
                rg = [r["gap_closed_ref"][p] for r in rs if r["gap_closed_ref"][p] is not None]
                g["gap_closed_ref_mean"][p] = round(sum(rg) / len(rg), 4) if rg else None
        out.append(g)
    order = {f: i for i, f in enumerate(FAMILIES)}
    corder = {c: i for i, (c, _) in enumerate(CONFIGS)}
    out.sort(key=lambda g: (g["set"] != "tuning", order[g["family"]], corder[g["config"]]))
    return out


def table(groups: Sequence[Dict[str, Any]]) -> str:
    def f3(x: Optional[float]) -> str:
        return "n/a" if x is None else "%.3f" % x

    lines = ["| set | family | config | seeds | cost s | LRU s | LFU s | oracle s | gap closed "
             "| cost <= min(LRU, LFU) | oracle <= min(LRU, LFU) | cost+hints s "
             "| gap closed, hints | hint gain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in groups:
        p = g["prefill_s"]
        hints = ["-", "-", "-"]
        if "cost+hints" in p:
            hints = ["%.1f" % p["cost+hints"], f3(g["gap_closed_hints_mean"]),
                     "%.1f%%" % (100 * g["hint_gain"])]
        lines.append("| %s | %s | %s | %s | %.1f | %.1f | %.1f | %.1f | %s | %s | %s | %s |" % (
            g["set"], g["family"], g["config"], ",".join(str(s) for s in g["seeds"]), p["cost"],
            p["lru"], p["lfu"], p["oracle"], f3(g["gap_closed_mean"]),
            "pass" if g["never_worse"] else "FAIL", "yes" if g["oracle_ok"] else "NO",
            " | ".join(hints)))
    for st in ("tuning", "held-out"):
        gs = [g["gap_closed_mean"] for g in groups if g["set"] == st and
              g["gap_closed_mean"] is not None]
        nw = sum(1 for g in groups if g["set"] == st and g["never_worse"])
        n = sum(1 for g in groups if g["set"] == st)
        hs = [g for g in groups if g["set"] == st and g.get("gap_closed_hints_mean") is not None]
        if n:
            lines.append("\n%s: mean gap closed %s over %d rows; never worse in %d of %d" % (
                st, "%.3f" % (sum(gs) / len(gs)) if gs else "n/a", len(gs), nw, n))
        if hs:
            lines.append("%s, hinted families (%s): mean gap closed %.3f without hints, %.3f "
                         "with them, over %d rows" % (
                             st, ", ".join(HINTED_FAMILIES),
                             sum(g["gap_closed_mean"] for g in hs) / len(hs),
                             sum(g["gap_closed_hints_mean"] for g in hs) / len(hs), len(hs)))
    return "\n".join(lines)


def ref_table(groups: Sequence[Dict[str, Any]]) -> str:
    """Per family and configuration (tuning and held-out seeds together): the mean share of the
    LRU-to-oracle gap that the cost policy and each reference close; then the means the bar of
    issue 40 takes (over the tuning groups and over the held-out groups)."""
    refs = [p for p in REFERENCES if any(p in g.get("gap_closed_ref_mean", {}) for g in groups)]
    if not refs:
        return ""

    def mean(xs: Sequence[Optional[float]]) -> Optional[float]:
        v = [x for x in xs if x is not None]
        return sum(v) / len(v) if v else None

    def f3(x: Optional[float]) -> str:
        return "n/a" if x is None else "%.3f" % x

    order = {f: i for i, f in enumerate(FAMILIES)}
    corder = {c: i for i, (c, _) in enumerate(CONFIGS)}
    keys = sorted({(g["family"], g["config"]) for g in groups},
                  key=lambda k: (order[k[0]], corder[k[1]]))
    lines = ["| family | config | seeds | LRU s | oracle s | %s | gap closed: cost | %s |" % (
        " | ".join("%s s" % p for p in refs), " | ".join(refs)),
        "|---|---|---|---|---|%s---|%s" % ("---|" * len(refs), "---|" * len(refs))]
    for fam, cfg in keys:
        gs = [g for g in groups if g["family"] == fam and g["config"] == cfg]
        # each group's mean weighted by its seeds: the mean over this family's rows
        def wmean(get: Any) -> Optional[float]:
            v = [(get(g), len(g["seeds"])) for g in gs if get(g) is not None]
            return sum(x * n for x, n in v) / sum(n for _, n in v) if v else None
        seeds = sorted(s for g in gs for s in g["seeds"])
        lines.append("| %s | %s | %s | %.1f | %.1f | %s | %s | %s |" % (
            fam, cfg, ",".join(str(x) for x in seeds),
            sum(g["prefill_s"]["lru"] for g in gs), sum(g["prefill_s"]["oracle"] for g in gs),
            " | ".join("%.1f" % sum(g["prefill_s"][p] for g in gs) for p in refs),
            f3(wmean(lambda g: g["gap_closed_mean"])),
            " | ".join(f3(wmean(lambda g, p=p: g["gap_closed_ref_mean"][p])) for p in refs)))
    for st in ("tuning", "held-out"):
        gs = [g for g in groups if g["set"] == st]
        if gs:
            lines.append("\n%s: mean gap closed over %d groups: cost %s; %s" % (
                st, len(gs), f3(mean([g["gap_closed_mean"] for g in gs])),
                "; ".join("%s %s" % (p, f3(mean([g["gap_closed_ref_mean"][p] for g in gs])))
                          for p in refs)))
    return "\n".join(lines)


def parse_seeds(s: str) -> List[int]:
    out: List[int] = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            raise argparse.ArgumentTypeError("bad seeds %r (e.g. 0-4 or 0,2)" % s)
        out += list(range(int(a), int(b or a) + 1))
    return out


def parse_families(s: str) -> List[str]:
    fams = s.split(",")
    for f in fams:
        if f not in FAMILIES:
            raise argparse.ArgumentTypeError("unknown family %r (one of %s)" %
                                             (f, ",".join(FAMILIES)))
    return fams


def parse_references(s: str) -> List[str]:
    refs = [p for p in s.split(",") if p]
    for p in refs:
        if p not in REFERENCES:
            raise argparse.ArgumentTypeError("unknown reference %r (one of %s)" %
                                             (p, ",".join(REFERENCES)))
    return refs


def run(args: argparse.Namespace) -> int:
    if not os.access(args.replay, os.X_OK):
        print("workloads: no kvtier-replay at %s" % args.replay, file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-workloads.") as tmp:
        for fam in args.families:
            for seed in args.seeds:
                path = os.path.join(tmp, "%s-%d.jsonl" % (fam, seed))
                with open(path, "w") as f:
                    write(generate(fam, seed, args.requests), f)
                extra = ["--trace-hints"] if fam in HINTED_FAMILIES else []
                for cname, cargs in CONFIGS:
                    r = row(fam, seed, cname,
                            replay(args.replay, path, cargs, extra, args.references),
                            args.references)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    groups = summarize(rows)
    for g in groups:
        print(json.dumps(dict(g, summary=True)))
    if args.table:
        print(table(groups))
        if args.references:
            print("\n" + ref_table(groups))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="write one trace")
    g.add_argument("family", choices=FAMILIES)
    g.add_argument("seed", type=int)
    g.add_argument("-n", "--requests", type=int, default=4000)
    g.add_argument("-o", "--out")
    r = sub.add_parser("run", help="replay the families through kvtier-replay")
    r.add_argument("--replay", required=True, help="the kvtier-replay executable")
    r.add_argument("-n", "--requests", type=int, default=4000)
    r.add_argument("--families", type=parse_families, default=list(FAMILIES))
    r.add_argument("--seeds", type=parse_seeds, default=list(SEEDS))
    r.add_argument("--table", action="store_true", help="also print a Markdown table")
    r.add_argument("--references", type=parse_references, default=[],
                   help="also replay these reference policies (%s), which read the trace's "
                   "future: the share of the gap each closes" % ",".join(REFERENCES))
    t = sub.add_parser("table", help="the Markdown table of a run's saved output")
    t.add_argument("rows", help="what `run` printed (its per-row JSON lines are read)")
    a = ap.parse_args(argv)
    if a.cmd == "table":
        try:
            with open(a.rows) as f:
                rows = [json.loads(l) for l in f if l.startswith("{")]
        except (OSError, ValueError) as e:
            print("workloads: %s: %s" % (a.rows, e), file=sys.stderr)
            return 2
        rows = [r for r in rows if not r.get("summary")]
        if not rows:
            print("workloads: %s: no rows of `workloads.py run`" % a.rows, file=sys.stderr)
            return 2
        groups = summarize(rows)
        print(table(groups))
        if any("gap_closed_ref_mean" in g for g in groups):
            print("\n" + ref_table(groups))
        return 0
    if a.requests < 1:
        ap.error("--requests must be >= 1")
    if a.cmd == "gen":
        if a.seed < 0:
            ap.error("seed must be >= 0")
        reqs = generate(a.family, a.seed, a.requests)
        if a.out:
            with open(a.out, "w") as f:
                write(reqs, f)
        else:
            write(reqs, sys.stdout)
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
