#!/usr/bin/env python3
"""plot.py: draws `kvtier replay --plot FILE.png` results (installed as kvtier-plot.py).

    plot.py --out FILE.png RESULTS.jsonl

RESULTS.jsonl holds the replay's JSON lines (with their timelines). One row per trace and tier
configuration:
- a plain replay: on the left, the token hit ratio over the trace's time, split by the tier the
  hits came from (stacked areas, for the first policy replayed: cost by default), with every
  policy's total hit ratio as a line; on the right, the prefill time each policy leaves, beside
  no cache at all;
- a sweep (--sweep TIER=A..B): on the left, the prefill time against the swept tier's capacity,
  a curve per policy; on the right, the token hit ratio against it.

matplotlib (Agg, no display needed) because it is the plotting library Python users already
have, it writes PNG without a GUI, and its charts read well in a README; the replay itself stays
in C and only hands this script its JSON.
"""

import argparse
import json
import sys
from collections import OrderedDict

TIERS = ["hbm", "dram", "nvme", "remote"]
COLORS = {"hbm": "#1b9e77", "dram": "#7570b3", "nvme": "#d95f02", "remote": "#e7298a"}


def label(r):
    name = r["policy"]
    if "hint_accuracy" in r:
        name += " hints %.2f" % r["hint_accuracy"]
    return name


def human_bytes(n):
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1024 or unit == "P":
            return ("%.0f%s" if n == int(n) else "%.1f%s") % (n, unit)
        n /= 1024.0
    return str(n)


def hit_ratio(r):
    hit = sum(r["hit_tokens"].get(t, 0) for t in TIERS)
    return hit / r["input_tokens"] if r["input_tokens"] else 0.0


def timeline_row(ax_t, ax_p, trace, config, rows):
    first = rows[0]
    tl = first.get("timeline")
    if not tl:
        raise SystemExit("plot: the results carry no timeline (the replay adds it with --plot)")
    w = tl["window_seconds"]
    x = [(i + 0.5) * w for i in range(len(tl["input_tokens"]))]
    ins = tl["input_tokens"]

    def ratio(vals):
        return [v / n if n else 0.0 for v, n in zip(vals, ins)]

    stacks = [ratio(tl["hit_tokens"][t]) for t in TIERS]
    used = [t for t, s in zip(TIERS, stacks) if any(s)]
    ax_t.stackplot(x, *[stacks[TIERS.index(t)] for t in used], labels=used,
                   colors=[COLORS[t] for t in used], alpha=0.8)
    for r in rows:
        rt = r["timeline"]
        tot = [sum(rt["hit_tokens"][t][i] for t in TIERS) for i in range(len(ins))]
        ax_t.plot(x, ratio(tot), lw=1.2, label="%s (all tiers)" % label(r))
    ax_t.set_ylim(0, 1)
    ax_t.set_xlim(0, x[-1] + w / 2)
    ax_t.set_xlabel("trace time (s)")
    ax_t.set_ylabel("token hit ratio")
    ax_t.set_title("%s, %s: hits by tier (%s) over time" % (trace, config, label(first)),
                   fontsize=9)
    ax_t.legend(fontsize=7, loc="upper left", ncol=2)

    names = [label(r) for r in rows] + ["no cache"]
    secs = [r["prefill_seconds_total"] for r in rows] + [first["prefill_seconds_no_cache"]]
    bars = ax_p.barh(names, secs, color=["#4c72b0"] * len(rows) + ["#999999"])
    for b, v in zip(bars, secs):
        ax_p.text(v, b.get_y() + b.get_height() / 2, " %.0f s" % v, va="center", fontsize=7)
    ax_p.invert_yaxis()
    ax_p.set_xlabel("prefill time (GPU seconds, cost model)")
    ax_p.set_title("prefill time per policy", fontsize=9)
    ax_p.set_xlim(0, max(secs) * 1.25)


def sweep_row(ax_s, ax_h, trace, rows):
    caps = {t: sorted({r["capacity_bytes"][t] for r in rows}) for t in TIERS}
    tier = max(TIERS, key=lambda t: len(caps[t]))
    curves = OrderedDict()
    for r in rows:
        curves.setdefault(label(r), []).append(r)
    for name, rs in curves.items():
        rs.sort(key=lambda r: r["capacity_bytes"][tier])
        xs = [r["capacity_bytes"][tier] for r in rs]
        ax_s.plot(xs, [r["prefill_seconds_total"] for r in rs], marker="o", ms=3, label=name)
        ax_h.plot(xs, [hit_ratio(r) for r in rs], marker="o", ms=3, label=name)
    ax_s.axhline(rows[0]["prefill_seconds_no_cache"], color="#999999", ls="--", lw=1,
                 label="no cache")
    for ax in (ax_s, ax_h):
        ax.set_xscale("log", base=2)
        ax.set_xticks(caps[tier])
        ax.set_xticklabels([human_bytes(c) for c in caps[tier]], fontsize=7)
        ax.set_xlabel("%s capacity (KV bytes)" % tier)
        ax.legend(fontsize=7)
    ax_s.set_ylabel("prefill time (GPU seconds)")
    ax_s.set_title("%s: prefill time as %s grows" % (trace, tier), fontsize=9)
    ax_h.set_ylabel("token hit ratio")
    ax_h.set_ylim(0, 1)
    ax_h.set_title("%s: hit ratio as %s grows" % (trace, tier), fontsize=9)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="PNG file to write")
    ap.add_argument("results", help="the replay's JSON lines")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print("plot: matplotlib is not installed for %s (%s): pip install matplotlib, or point "
              "KVTIER_PYTHON at a python that has it" % (sys.executable, e), file=sys.stderr)
        return 3
    groups = OrderedDict()
    with open(a.results) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                groups.setdefault((r["trace"], r["config"]), []).append(r)
    if not groups:
        print("plot: no results to draw", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.6 * len(groups)), squeeze=False,
                             gridspec_kw={"width_ratios": [1.6, 1]})
    for row, ((trace, config), rows) in enumerate(groups.items()):
        if config == "sweep":
            sweep_row(axes[row][0], axes[row][1], trace, rows)
        else:
            timeline_row(axes[row][0], axes[row][1], trace, config, rows)
    r0 = next(iter(groups.values()))[0]
    fig.suptitle("kvtier replay: %s on %s, pages of %d tokens" % (r0["model"], r0["hw"],
                                                                  r0["page_size"]), fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("plot: wrote %s" % a.out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
