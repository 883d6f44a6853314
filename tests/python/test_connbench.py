"""test_connbench.py: bench/connbench.py's warm passes reuse the memory of the pass before,
however long the other forms take between them (issue 35). Its pages used to be removed right
after each pass; when the other forms' passes took over a second (a loaded machine), kvtierd's
DRAM tier gave the freed pages back to the kernel meanwhile (its shared arenas' decay), and the
next "warm" save wrote into fresh pages, a page fault each 4 KiB. Against real kvtierds, with a
form that takes two seconds (untimed) standing in for the slow round."""

from __future__ import annotations

import json
import os
import sys
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
