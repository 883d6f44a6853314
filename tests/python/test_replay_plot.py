"""test_replay_plot.py: `kvtier replay --plot` and `--sweep` (replay/replay.c, replay/plot.py)
run on a trace from the repository: the JSON lines carry a timeline that adds up to their
totals, a sweep doubles the tier's capacity step by step, and matplotlib renders a picture that
is not blank. Bad input is refused with a message."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BUILD_ROOT, SOURCE_ROOT

mpimg = pytest.importorskip("matplotlib.image", reason="matplotlib is not in this venv")
np = pytest.importorskip("numpy")

REPLAY = os.path.join(BUILD_ROOT, "replay", "kvtier-replay")
TRACE = os.path.join(SOURCE_ROOT, "traces", "mooncake-conversation.jsonl")
TIERS = ("hbm", "dram", "nvme", "remote")


def replay(*args, env=None):
    e = dict(os.environ, KVTIER_PYTHON=sys.executable)
    e.update(env or {})
    return subprocess.run([REPLAY, "--no-progress", *args, TRACE], capture_output=True, text=True,
                          env=e, timeout=240)


def picture(path):
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600, img.shape
    # Not blank: a chart has lines, bars and text in several colours over its white.
    assert float(np.std(img[..., :3])) > 0.05
    assert len(np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50
    return img


def test_plot_draws_the_timeline_and_the_totals(tmp_path):
    png = tmp_path / "replay.png"
    r = replay("--requests", "600", "--policy", "lru,cost", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in r.stdout.splitlines()]
    assert [(x["config"], x["policy"]) for x in rows] == [
        ("local", "lru"), ("local", "cost"), ("remote", "lru"), ("remote", "cost")]
    for x in rows:
        tl = x["timeline"]
        assert len(tl["input_tokens"]) == 48
        assert sum(tl["input_tokens"]) == x["input_tokens"]
        for t in TIERS:
            assert sum(tl["hit_tokens"][t]) == x["hit_tokens"][t], t
        assert tl["window_seconds"] > 0
    assert any(x["hit_tokens"]["remote"] for x in rows if x["config"] == "remote")
    picture(png)


def test_sweep_doubles_the_tier_and_draws_a_curve_per_policy(tmp_path):
    png = tmp_path / "sweep.png"
    r = replay("--requests", "400", "--policy", "lru,lfu", "--sweep", "dram=2G..8G", "--plot",
               str(png))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in r.stdout.splitlines()]
    assert len(rows) == 3 * 2 and all(x["config"] == "sweep" for x in rows)
    caps = [x["capacity_bytes"]["dram"] for x in rows if x["policy"] == "lru"]
    assert len(caps) == 3 and caps[0] > 0
    for a, b in zip(caps, caps[1:]):
        assert 1.99 < b / a < 2.01, caps  # (each rounded down to whole pages)
    other = {(x["capacity_bytes"]["hbm"], x["capacity_bytes"]["nvme"]) for x in rows}
    assert len(other) == 1, "the other tiers stay as given"
    picture(png)


def test_bad_sweeps_are_refused():
    for bad in ("dram=8G..2G", "dram=2G..8", "l3=1G..2G", "dram=1G", "dram=..4G"):
        r = replay("--requests", "10", "--sweep", bad)
        assert r.returncode == 2 and "bad --sweep" in r.stderr, (bad, r.stderr)


def test_plot_without_matplotlib_says_so(tmp_path):
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('not here')\n")
    png = tmp_path / "none.png"
    r = replay("--requests", "50", "--policy", "lru", "--plot", str(png),
               env={"PYTHONPATH": str(fake)})
    assert r.returncode == 1
    assert "matplotlib is not installed" in r.stderr and "the results above stand" in r.stderr
    assert r.stdout.count("\n") == 2, "the results are printed all the same"
    assert not png.exists()
