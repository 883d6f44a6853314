"""test_connbench.py: bench/connbench.py, the connector benchmarks' runner (issue 35).

Its warm passes reuse the memory of the pass before, however long the other forms take between
them. Its pages used to be removed right after each pass; when the other forms' passes took
over a second (a loaded machine), kvtierd's DRAM tier gave the freed pages back to the kernel
meanwhile (its shared arenas' decay), and the next "warm" save wrote into fresh pages, a page
fault each 4 KiB. Against real kvtierds, with a form that takes two seconds (untimed) standing
in for the slow round.

The keyed PUT's bar under --busy is judged on paired saves: the median's interval from order
statistics (checked against the tables), the pairs' order (balanced, shuffled, fixed), the
summary (every pair judged, split by order), the forms' byte checks (memcmp: no OpenMP worker
left spinning into the next timed save, checked against a real kvtierd), and a run with pairs."""

from __future__ import annotations

import json
import math
import os
import random
import sys
import threading
import time

import pytest

from conftest import BUILD_ROOT, SOURCE_ROOT

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(SOURCE_ROOT, "bench"))
import connbench as cb  # noqa: E402


class Slow(cb.Form):
    """Moves nothing; its untimed check takes 2 s, past the DRAM tier's decay (about 1 s)."""

    def save(self) -> None:
        time.sleep(0.001)

    def load(self) -> None:
        time.sleep(0.001)

    def check(self) -> None:
        time.sleep(2.0)


def test_warm_saves_reuse_the_last_pass_memory(capsys: pytest.CaptureFixture[str]) -> None:
    keys = lambda p: ["connbench-%d-%d" % (p, i) for i in range(cb.PAGES)]  # noqa: E731
    cb.run("test", BUILD_ROOT, {"connector": lambda unix: Slow(),
                                "keyed": lambda unix: cb.Keyed(unix, keys), "raw": cb.Raw},
           passes=2)
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    warm = [r for r in recs if r.get("op") == "save" and r["pass"] > 1 and
            r["form"] in ("keyed", "raw")]
    assert len(warm) == 4, warm
    # A save into fresh memory faults 16,384 times (64 MiB); a warm one reuses its pages.
    assert all(r["minflt"] < 4096 for r in warm), [(r["form"], r["pass"], r["minflt"])
                                                   for r in warm]
    summary = [r for r in recs if r.get("summary") == "save" and r["pass"] == "warm"]
    assert summary and summary[0]["passes"] == 2
    lo, hi = summary[0]["keyed_over_raw_spread"]
    assert lo <= summary[0]["keyed_over_raw"] <= hi


# -- the keyed PUT's paired saves and their interval (issue 35) --------------------------------


def binom_below(n: int, k: int) -> float:
    """P(B <= k - 1), B ~ Binomial(n, 1/2), summed term by term as a reference."""
    return sum(math.comb(n, i) for i in range(k)) / 2 ** n


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (12, (3, 10)), (24, (7, 18)), (50, (18, 33)),
                                      (100, (40, 61))])
def test_median_ci_is_the_order_statistics_of_the_tables(n: int, ranks: tuple) -> None:
    # The ranks of the 95% interval of a median in the usual tables (Conover, Nonparametric
    # Statistics, table A3), on samples whose value is their rank, given shuffled.
    x = [float(i) for i in range(1, n + 1)]
    random.Random(n).shuffle(x)
    lo, hi, cov = cb.median_ci(x)
    assert (lo, hi) == ranks
    k = ranks[0]
    assert cov == pytest.approx(1 - 2 * binom_below(n, k)) and cov >= 0.95
    # The next narrower interval would cover less than 95%.
    assert 1 - 2 * binom_below(n, k + 1) < 0.95


def test_median_ci_with_too_few_samples_is_the_range() -> None:
    lo, hi, cov = cb.median_ci([3.0, 1.0, 2.0])
    assert (lo, hi) == (1.0, 3.0) and cov == pytest.approx(0.75)
    assert cb.median_ci([5.0]) == (5.0, 5.0, 0.0)


def test_pair_orders_are_balanced_shuffled_and_fixed() -> None:
    o = cb.pair_orders(100)
    assert o == cb.pair_orders(100), "not the same order from run to run"
    assert sum(o) == 50
    assert o != [i % 2 == 0 for i in range(100)], "a strict alternation"
    assert sum(cb.pair_orders(7)) == 4


def test_pair_summary_judges_every_pair_and_splits_by_order() -> None:
    # Keyed saves 3 ms when second, 6 ms when first (a form that inherits a preemption); raw
    # always 3 ms. Nothing is left out of the judged median: half the pairs read 0.5.
    order = cb.pair_orders(40)
    keyed = [0.006 if k else 0.003 for k in order]
    raw = [0.003] * 40
    quiet = [not k for k in order]
    rec = cb.pair_summary(keyed, raw, order, quiet)
    assert rec["keyed_over_raw_pairs"] == 40
    assert rec["keyed_over_raw"] == pytest.approx(0.75)  # the median of 20 x 0.5 and 20 x 1.0
    assert rec["keyed_over_raw_ci"] == [0.5, 1.0]
    assert rec["keyed_over_raw_spread"] == [0.5, 1.0]
    assert rec["keyed_over_raw_keyed_first"] == 0.5 and rec["keyed_over_raw_raw_first"] == 1.0
    assert rec["keyed_over_raw_quiet"] == 1.0 and rec["keyed_over_raw_quiet_pairs"] == 20
    assert rec["keyed_over_raw_ci_coverage"] >= 0.95


def test_same_compares_every_byte() -> None:
    a = torch.randint(0, 256, (4, 4096), dtype=torch.uint8)
    b = a.clone()
    assert cb.same(a, b)
    b[3, 4095] ^= 1
    assert not cb.same(a, b)
    with pytest.raises(AssertionError):
        cb.same(a, b[:, :100])


def other_threads_cpu_ns() -> int:
    me = str(threading.get_native_id())
    total = 0
    for t in os.listdir("/proc/self/task"):
        if t != me:
            with open("/proc/self/task/%s/schedstat" % t) as f:
                total += int(f.read().split()[0])
    return total


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here")
def test_a_check_leaves_no_thread_spinning_into_the_next_save() -> None:
    # The forms' checks compared with torch.equal, whose OpenMP region left torch's worker
    # spinning for about 10 ms of CPU afterwards, into the next form's timed save (under
    # --busy 2 that delayed whichever save came next). With memcmp, no other thread of this
    # process runs after a check. Against a real kvtierd, as the benchmark's passes.
    d = cb.Daemon(BUILD_ROOT, "kvt-pytest-connbench-", "256M")
    f = cb.Keyed(d.unix, lambda p: ["spin-%d-%d" % (p, i) for i in range(cb.PAGES)])
    try:
        spun = []
        for p in range(1, 4):
            f.prepare(p)
            f.save()
            f.load()
            # What other threads of this process (earlier tests' too, in the whole suite) take
            # in 50 ms anyway, then in the 50 ms after a check.
            c0 = other_threads_cpu_ns()
            time.sleep(0.05)
            c1 = other_threads_cpu_ns()
            f.check()
            c2 = other_threads_cpu_ns()
            time.sleep(0.05)
            spun.append(((other_threads_cpu_ns() - c2) - (c1 - c0)) / 1e6)
            f.drop()
        print("ms of CPU other threads took after each check, beyond their usual:", spun)
        assert sum(spun) < 1.0, "ms of CPU other threads took in the 50 ms after a check: %s" % spun
    finally:
        f.close()
        d.stop()


def test_run_judges_the_keyed_put_on_the_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    keys = lambda p: ["connbench-pairs-%d-%d" % (p, i) for i in range(cb.PAGES)]  # noqa: E731
    cb.run("test", BUILD_ROOT, {"connector": lambda unix: cb.Keyed(unix, keys),
                                "keyed": lambda unix: cb.Keyed(unix, keys), "raw": cb.Raw},
           passes=1, pairs=6)
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    saves = [r for r in recs if "pair" in r]
    assert [r["pair"] for r in saves] == [i // 2 for i in range(12)]
    assert all(r["op"] == "save" and {"wait_ms", "daemon_wait_ms", "nivcsw", "preempted"} <= set(r)
               for r in saves)
    # The two saves of a pair run in pair_orders' order.
    firsts = [r["form"] == "keyed" for r in saves if r["first"]]
    assert firsts == cb.pair_orders(6)
    warm = [r for r in recs if r.get("summary") == "save" and r["pass"] == "warm"][0]
    k = {r["pair"]: r["gib_s"] for r in saves if r["form"] == "keyed"}
    w = {r["pair"]: r["gib_s"] for r in saves if r["form"] == "raw"}
    ratios = sorted(k[i] / w[i] for i in range(6))
    assert warm["keyed_over_raw_pairs"] == 6
    assert warm["keyed_over_raw"] == pytest.approx((ratios[2] + ratios[3]) / 2, rel=0.02)
    lo, hi = warm["keyed_over_raw_ci"]
    assert lo <= warm["keyed_over_raw"] <= hi
    assert "keyed_over_raw_passes" in warm  # the passes' own figure, beside
    bars = [r for r in recs if "bars" in r][0]["bars"]
    assert "95% CI" in bars["keyed_put_warm"] and "of 6 pairs" in bars["keyed_put_warm"]
