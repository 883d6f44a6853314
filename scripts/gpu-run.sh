#!/usr/bin/env bash
# The GPU pack's runner, copied to .gpu/run.sh by scripts/gpu-pack.sh (which documents it):
#     run.sh suite [TEST...] | bench | ttft | all | -- CMD ARGS...
# It runs from the checkout's root on the GPU machine, starts a throwaway redis-server on a
# free loopback port (stopped by its PID on exit), prints one line per check and closes with
# "N passed, N failed".
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
g=$here/.gpu
packed=$(cat "$g/root")
# The build names this checkout's path on the machine that packed it (meson embeds it): where
# the checkout sits elsewhere here, that path is made to lead to it.
if [ "$here" != "$packed" ] && [ ! -e "$packed" ]; then
    mkdir -p "$(dirname "$packed")" && ln -s "$here" "$packed"
fi
export LD_LIBRARY_PATH=$g/lib:$g/build/client${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$g/bin:$PATH
out=${OUT:-$g/out}
mkdir -p "$out"
mode=${1:-all}
[ $# -gt 0 ] && shift

tmp=$(mktemp -d)
mkdir -p "$tmp/logs"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" \
    --daemonize no >"$tmp/redis.log" 2>&1 &
rpid=$!
finish() {
    kill "$rpid" 2>/dev/null
    wait "$rpid" 2>/dev/null
    tar czf "$out/gpu-logs.tgz" -C "$tmp/logs" . 2>/dev/null
    rm -rf "$tmp"
}
trap finish EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
export KVT_TEST_REDIS=127.0.0.1:$port KVT_REDIS_SERVER=$g/bin/redis-server TMPDIR=$tmp

# The Python package's tests use the image's python3 (its CUDA torch) with cffi from the pack.
if ! python3 -c 'import cffi' 2>/dev/null && ls "$g"/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --target "$tmp/py" "$g"/wheels/*.whl >/dev/null 2>&1 &&
        export PYTHONPATH=$tmp/py${PYTHONPATH:+:$PYTHONPATH}
fi
# tests/python/run.py runs pytest with $KVT_PYENV/bin/python: here that is the image's python3,
# when it has what the tests import (else they skip, saying there is no environment).
if missing=$(python3 -c 'import cffi, numpy, pytest' 2>&1); then
    mkdir -p "$tmp/pyenv/bin"
    printf '#!/bin/sh\nexec python3 "$@"\n' >"$tmp/pyenv/bin/python"
    chmod +x "$tmp/pyenv/bin/python"
    export KVT_PYENV=$tmp/pyenv
else
    echo "python: python3 here cannot run the package's tests (${missing##*$'\n'})"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
    sed 's/^/gpu: /'

if [ "$mode" = "--" ]; then
    "$@"
    exit $?
fi
case $mode in
suite | bench | ttft | all) ;;
*)
    echo "usage: run.sh suite [TEST...] | bench | ttft | all | -- CMD ARGS..." >&2
    exit 2
    ;;
esac

python3 - "$mode" "$g" "$tmp/logs" "$here" "$@" <<'PY'
import json, os, re, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor

mode, g, logs, here, only = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], set(sys.argv[5:])
checks = []
if mode in ("suite", "all"):
    for t in json.load(open(os.path.join(g, "tests.json"))):
        if only and t["name"] not in only:
            continue
        cmd = list(t["cmd"])
        if os.path.basename(cmd[0]).startswith("python"):
            cmd[0] = "python3"  # the image's interpreter: the one with the CUDA torch
        elif os.path.basename(cmd[0]).startswith("test_"):
            cmd.append("--verbose")  # a Criterion test: each skip's reason in the log
        env = dict(os.environ, **t["env"])
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        checks.append((t["name"], cmd, env, t.get("timeout") or 300))
if mode in ("bench", "all"):
    checks.append(("bench_tiers_hbm", [os.path.join(g, "build", "bench", "bench_tiers"), "--only",
                                       "hbm"], dict(os.environ), 300))
    # The vLLM connector's copies of engine tensors to and from the arena (kvtier/gpucopy.py:
    # registered arena, pinned bounce pool, pageable) against one pinned copy, bar 0.8x.
    checks.append(("bench_gpucopy", ["python3", os.path.join(here, "bench", "bench_gpucopy.py"),
                                     "--no-venv", "--build-root", os.path.join(g, "build")],
                   dict(os.environ), 300))
if mode in ("ttft", "all"):
    # TTFT recomputed against loaded through kvtier, Llama-3-8B and a quarter of 70B
    # (bench/bench_ttft.py), with the image's python3 and its CUDA torch.
    checks.append(("bench_ttft", ["python3", os.path.join(here, "bench", "bench_ttft.py"),
                                  "--no-venv", "--build-root", os.path.join(g, "build")],
                   dict(os.environ), 480))


def run(check):
    name, cmd, env, limit = check
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", "%s%s" % (e.stdout or "", e.stderr or "")
    except OSError as e:
        rc, text = "exec", str(e)
    with open(os.path.join(logs, name + ".log"), "w") as f:
        f.write(text)
    lines = text.splitlines()
    tail = [l for l in lines if re.search(r"Synthesis|^=+ .* in [0-9.]+s|passed|\"ratio|\"speedup", l)]
    fails = [l for l in lines if re.search(r"\[FAIL\]|Assertion|FAILED|Error", l)]
    skips = [l.strip() for l in lines if re.search(r"\[SKIP\]|SKIP:|skipped", l)]
    return name, rc, time.time() - t0, tail[-24:], fails[:10], skips[:6]


bad = 0
# Benchmarks alone (one at a time, after the tests); tests four at a time.
tests = [c for c in checks if not c[0].startswith("bench")]
benches = [c for c in checks if c[0].startswith("bench")]
with ThreadPoolExecutor(4) as ex:
    results = list(ex.map(run, tests))
results += [run(c) for c in benches]
for name, rc, dt, tail, fails, skips in results:
    bench = name.startswith("bench")
    print("%-24s %-10s %6.1fs  %s" % (name, "ok" if rc in (0, 77) else "FAIL(%s)" % rc, dt,
                                      "" if bench else (tail[-1].strip() if tail else "")[:120]),
          flush=True)
    for l in (tail if bench else []) + skips:  # a benchmark's figures, every one
        print("      " + l[:400])
    if rc not in (0, 77):
        bad += 1
        for l in fails:
            print("      " + l[:160])
print("%d passed, %d failed" % (len(checks) - bad, bad))
sys.exit(1 if bad else 0)
PY
