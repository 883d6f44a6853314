#!/usr/bin/env bash
# A short run of one libFuzzer harness, as make test does it:
#   run.sh HARNESS CORPUS
# runs HARNESS for KVT_FUZZ_SECONDS (8 by default) over a copy of the seed corpus CORPUS (new
# inputs go to the copy, never into the repository). Fails on a crash, a sanitizer report, a leak
# or an input slower than 10 s, printing the input; exits 77 (skipped) when the harness cannot run.
set -uo pipefail
h=$1 corpus=$2
secs=${KVT_FUZZ_SECONDS:-8}
if [ ! -x "$h" ]; then
    echo "fuzz: $h is not built: skipped"
    exit 77
fi
if [ ! -d "$corpus" ]; then
    echo "fuzz: no seed corpus $corpus" >&2
    exit 1
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvt-fuzz.XXXXXX")
mkdir "$work/corpus" "$work/crash"
cp -r "$corpus"/. "$work/corpus"/
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# The harnesses' own files (the NVMe data directories) go to a tmpfs where there is one: the tier
# fsyncs its side files, which on a disk would make each run wait for it.
scratch=$(mktemp -d /dev/shm/kvt-fuzz.XXXXXX 2>/dev/null || mktemp -d "$work/scratch.XXXXXX")
export TMPDIR="$scratch"
"$h" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/crash/" "$work/corpus"
rc=$?
if [ $rc -ne 0 ]; then
    for f in "$work"/crash/*; do
        [ -f "$f" ] || continue
        echo "fuzz: $(basename "$h") failed on $f ($(wc -c <"$f") bytes, kept):"
        od -A d -t x1 "$f" | head -40
    done
    rm -rf "$scratch"
    exit 1
fi
rm -rf "$work" "$scratch"
exit 0
