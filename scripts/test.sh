#!/usr/bin/env bash
# The whole test suite: format check, the release build that `make run` starts (so that what it
# builds is what CI builds) and an ASan+UBSan build, both run against a throwaway redis-server on
# a free loopback port that this script starts and stops by its PID; then a short run of each
# libFuzzer harness (fuzz/, built with clang in build-fuzz; KVT_FUZZ_SECONDS each, 8 by default);
# then the multi-loop tests against a ThreadSanitizer kvtierd (build-tsan), with 0 reports.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every stage's header carries the seconds since the command began (t=), and the end of the
# output lists each stage's length, so that any CI log shows where the time went.
stages=()
stage() {
    stages+=("$SECONDS $*")
    echo "== $* [t=$SECONDS s]"
}
stage_times() {
    local i start next name
    echo "== time per stage (s), $SECONDS s in all:"
    for i in "${!stages[@]}"; do
        start=${stages[$i]%% *} name=${stages[$i]#* }
        next=$SECONDS
        if [ $((i + 1)) -lt ${#stages[@]} ]; then
            next=${stages[$((i + 1))]%% *}
        fi
        printf '%6d  %s\n' $((next - start)) "$name"
    done
}

stage "build (release)"
bash scripts/setup.sh build -Dbuildtype=release -Dtests=enabled
stage "build-asan (AddressSanitizer + UndefinedBehaviorSanitizer)"
bash scripts/setup.sh build-asan -Dtests=enabled -Db_sanitize=address,undefined -Db_lundef=false \
    -Dbuildtype=debugoptimized
# The Python package's venv (build/pyenv: torch, numpy, pytest, cffi, the package, the engines),
# made once; and SGLang's host-pool venv (build/pyenv-sglang: torch 2.14.1 and torchvision 0.29.1,
# about 6 GB), made once, for the one meson test that needs it (python_sglang_hostpool). The two
# are independent and pip works on one core, so the second is made in the background while the
# first is (docs/testing.md has the measured gain). Its pip output goes to
# build/pyenv-sglang.log; failing to make it only makes that test skip, printing the log's end.
stage "pyenv (build/pyenv, and build/pyenv-sglang beside it)"
bash scripts/pyenv.sh --sglang build >build/pyenv-sglang.log 2>&1 &
sglang_pid=$!
pyenv_rc=0
bash scripts/pyenv.sh build || pyenv_rc=$?
if wait "$sglang_pid"; then
    grep '^pyenv:' build/pyenv-sglang.log >&2 || true
else
    echo "test: build/pyenv-sglang not made (build/pyenv-sglang.log); python_sglang_hostpool" \
        "will skip" >&2
fi
if [ "$pyenv_rc" -ne 0 ]; then
    exit "$pyenv_rc"
fi

# kvtierd under ThreadSanitizer (issue 42: several event loops), the daemon only (about 25 s from
# nothing): Criterion's runner does not start under ThreadSanitizer, so the release build's test
# programs drive it (KVT_TEST_KVTIERD). The packages are there already (setup.sh above).
stage "build-tsan (ThreadSanitizer kvtierd)"
if [ ! -f build-tsan/build.ninja ]; then
    meson setup build-tsan -Dtests=disabled -Db_sanitize=thread -Db_lundef=false \
        -Dbuildtype=debugoptimized
fi
ninja -C build-tsan server/kvtierd

# The fuzz build needs clang and its libFuzzer runtime (setup.sh installs both); without them the
# short fuzz runs are reported as skipped.
stage "build-fuzz (libFuzzer)"
fuzz_build=1 fuzz_why=""
fuzz_probe='int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return d && n; }'
if ! command -v clang >/dev/null 2>&1; then
    fuzz_why="clang is not installed (apt package clang)"
elif ! echo "$fuzz_probe" | clang -x c -fsanitize=fuzzer,address,undefined - \
        -o "${TMPDIR:-/tmp}/kvt-fuzz-probe.$$" >/dev/null 2>&1; then
    fuzz_why="clang cannot link libFuzzer with ASan and UBSan (apt package libclang-rt-dev)"
fi
rm -f "${TMPDIR:-/tmp}/kvt-fuzz-probe.$$"
if [ -n "$fuzz_why" ]; then
    echo "test: $fuzz_why: the fuzz stage is skipped" >&2
    fuzz_build=0
elif ! CC=clang bash scripts/setup.sh build-fuzz -Dfuzz=enabled -Dtests=disabled \
        -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized; then
    echo "test: the fuzz build (build-fuzz) failed" >&2
    exit 1
fi

stage "format check (clang-format, .clang-format)"
files=$(git ls-files '*.c' '*.h' 2>/dev/null || find . -name '*.[ch]' -not -path './build*')
if ! clang-format --dry-run --Werror $files; then
    echo "test: unformatted code (run: clang-format -i \$(git ls-files '*.c' '*.h'))" >&2
    exit 1
fi

tmp=$(mktemp -d /tmp/kvtier-test.XXXXXX)
redis_pid=""
cleanup() {
    if [ -n "$redis_pid" ]; then
        kill "$redis_pid" 2>/dev/null || true
        wait "$redis_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp" || true
}
trap cleanup EXIT

# A free loopback port: ask the kernel for one, then hand it to redis-server.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo $((20000 + RANDOM % 20000)))
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" \
    --logfile "$tmp/redis.log" --daemonize no &
redis_pid=$!
for _ in $(seq 1 100); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.05
done
redis-cli -p "$port" ping >/dev/null
echo "== redis-server pid $redis_pid on 127.0.0.1:$port"

export KVT_TEST_REDIS="127.0.0.1:$port"
export KVT_REDIS_SERVER="$(command -v redis-server)"
export TMPDIR="$tmp"

# What failed, at the very end of the output (CI shows its tail): each failed test's name and the
# last lines of what it printed.
summary() {
    python3 - "$1/meson-logs/testlog.json" <<'PY' || true
import json, sys
bad = []
for line in open(sys.argv[1]):
    t = json.loads(line)
    if t.get("result") not in ("OK", "SKIP", "EXPECTEDFAIL"):
        bad.append(t)
for t in bad:
    print("---- %s: %s (%.1fs)" % (t["name"], t["result"], t.get("duration", 0)))
    out = (t.get("stdout") or "") + (t.get("stderr") or "")
    lines = [l for l in out.splitlines() if "Assertion" in l or "FAIL" in l or "CRASH" in l
             or "ERROR" in l or "Synthesis" in l or "expected" in l.lower()]
    for l in (lines or out.splitlines())[-25:]:
        print("    " + l)
PY
}

rc=0 failed=""
stage "tests (build)"
meson test -C build -v --num-processes 2 --print-errorlogs || { rc=1; failed="$failed build"; }
stage "tests (build-asan: AddressSanitizer + UndefinedBehaviorSanitizer)"
meson test -C build-asan -v --num-processes 2 --print-errorlogs --timeout-multiplier 3 ||
    { rc=1; failed="$failed build-asan"; }
stage "fuzz (build-fuzz: libFuzzer, ${KVT_FUZZ_SECONDS:-8} s per harness)"
if [ $fuzz_build -eq 1 ]; then
    meson test -C build-fuzz --suite fuzz -v --print-errorlogs || { rc=1; failed="$failed build-fuzz"; }
else
    echo "SKIP: $fuzz_why"
fi
stage "multi-loop tests (build-tsan: kvtierd under ThreadSanitizer, --loops 2)"
# Each report goes to a file of its own (log_path) as well as failing the daemon's exit; none may
# be written. Short: the two-loop tests and the suites that stress the connections' paths. Two
# tests at a time (--jobs=2): they wait on their daemons more than they compute, and server_loops
# took 30-34 s so against 58 s one at a time (docs/testing.md).
mkdir -p "$tmp/tsan"
tsan_rc=0
for t in server_loops client_batch server_limits; do
    TSAN_OPTIONS="log_path=$tmp/tsan/report:exitcode=66" KVT_TEST_LOOPS=2 \
        KVT_TEST_KVTIERD="$PWD/build-tsan/server/kvtierd" KVT_BUILD_ROOT="$PWD/build" \
        KVT_SOURCE_ROOT="$PWD" build/tests/test_$t --jobs=2 || tsan_rc=1
done
if ls "$tmp"/tsan/report* >/dev/null 2>&1; then
    cat "$tmp"/tsan/report*
    tsan_rc=1
fi
if [ $tsan_rc -ne 0 ]; then
    rc=1
    failed="$failed build-tsan"
    echo "== build-tsan: a test failed or ThreadSanitizer reported (above)"
fi
stage_times
if [ $rc -ne 0 ]; then
    echo "== FAILED in:$failed"
    for d in $failed; do
        [ "$d" = build-tsan ] && continue
        echo "== failures in $d"
        summary "$d"
    done
else
    echo "== all tests passed in build, build-asan, build-fuzz and build-tsan"
fi
exit $rc
