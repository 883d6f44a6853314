#!/usr/bin/env bash
# GPU check for the HBM tier, for a machine with an NVIDIA GPU: builds with CUDA required
# (-Dcuda=enabled), runs the HBM tier tests on the real device (a skipped CUDA test is a failure
# here), runs the DRAM tier tests (its region is pinned with cudaHostRegister when a GPU is
# usable), and measures HBM <-> pinned-DRAM copy bandwidth through the tier against plain
# cudaMemcpy of the same size (bench_tiers --only hbm). Prints one JSON object per line on
# stdout; everything else goes to stderr.
#
#   bash scripts/gpu-check.sh [BUILD_DIR] [MIB_PER_CASE]     (defaults: build-gpu, 2048)
#
# Exit status: 0 all passed; 1 a build, test or benchmark failed; 2 no usable GPU (after
# building, so that the script is checked on machines without one too).
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-gpu}
mib=${2:-2048}
export PATH="$PATH:/usr/local/cuda/bin"

json() { printf '{"check":"%s","status":"%s"%s}\n' "$1" "$2" "${3:+,$3}"; }

if command -v nvidia-smi >/dev/null 2>&1; then
    gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
        head -1 | sed 's/"/\\"/g')
    if [ -n "$gpu" ]; then
        json gpu found "\"nvidia_smi\":\"${gpu}\""
    else
        json gpu "nvidia-smi lists no GPU"
    fi
else
    json gpu "no nvidia-smi"
fi

if ! bash scripts/setup.sh "$dir" -Dcuda=enabled >&2; then
    json build failed "\"dir\":\"$dir\""
    exit 1
fi
if ! grep -q '^#define KVT_HAVE_CUDA 1' "$dir/config.h"; then
    json build "built without CUDA" "\"dir\":\"$dir\""
    exit 1
fi
json build ok "\"dir\":\"$dir\""

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvt-gpu-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# A tiny probe through the tier itself: does the HBM tier's cuda backend come up?
TMPDIR="$tmp" "$dir/tests/test_tier_hbm" --jobs=1 --verbose >"$tmp/hbm.log" 2>&1
hbm_rc=$?
cat "$tmp/hbm.log" >&2
if grep -q 'SKIP.*tier_hbm::cuda_round_trips' "$tmp/hbm.log"; then
    json hbm_tests "skipped: no usable CUDA device" "\"log\":\"$(grep -m1 'no usable CUDA' "$tmp/hbm.log" | sed 's/"/\\"/g')\""
    exit 2
fi
passed=$(grep -c '^\[PASS\]' "$tmp/hbm.log" || true)
failed=$(grep -c '^\[FAIL\]' "$tmp/hbm.log" || true)
if [ "$hbm_rc" -ne 0 ] || [ "$failed" -ne 0 ]; then
    json hbm_tests failed "\"passed\":$passed,\"failed\":$failed"
    exit 1
fi
json hbm_tests ok "\"passed\":$passed,\"failed\":0"

TMPDIR="$tmp" "$dir/tests/test_tier_dram" --jobs=1 >"$tmp/dram.log" 2>&1
dram_rc=$?
cat "$tmp/dram.log" >&2
if [ "$dram_rc" -ne 0 ]; then
    json dram_tests_pinned failed
    exit 1
fi
json dram_tests_pinned ok

# Bandwidth: the tier's cudaMemcpyAsync copies (queue depth 32, 4 streams) from and to pinned
# DRAM-tier blocks, next to plain cudaMemcpy of the same size from the same pinned memory.
if ! "$dir/bench/bench_tiers" --only hbm --mib-per-case "$mib" --dir "$tmp" >"$tmp/bench.json"; then
    cat "$tmp/bench.json"
    json hbm_bench failed
    exit 1
fi
cat "$tmp/bench.json"
if ! grep -q '"tier":"hbm"' "$tmp/bench.json"; then
    json hbm_bench "no hbm figures"
    exit 1
fi
json hbm_bench ok
exit 0
