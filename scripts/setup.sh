#!/usr/bin/env bash
# Installs the Debian packages kvtier builds with (and, unless --run-only, tests with) when any
# is missing, then configures the build directory given as the next argument (default: build)
# with meson's extra options after it:
#   setup.sh [--run-only] [DIR [MESON OPTIONS...]]
# `make run` asks for --run-only: a machine that only runs kvtierd gets no test tools.
set -euo pipefail

# What kvtierd and libkvtier need to build.
run_pkgs=(gcc pkg-config meson ninja-build
          libjemalloc-dev liburing-dev libhiredis-dev libxxhash-dev)
# What only the tests and benchmarks use: Criterion, the format check, a redis-server for the
# remote tier's tests, fio (bench_tiers' NVMe ceiling) and promtool (from prometheus, which
# checks the /metrics text), clang with its sanitizer and libFuzzer runtimes (the fuzz build),
# python3-venv for the tests' venvs (scripts/pyenv.sh would install it itself, but test.sh makes
# two venvs at once, and two apt-get runs at once fail on dpkg's lock).
test_pkgs=(libcriterion-dev clang-format redis-server redis-tools fio prometheus clang
           libclang-rt-dev python3-venv)

pkgs=("${run_pkgs[@]}")
if [ "${1:-}" = "--run-only" ]; then
    shift
else
    pkgs+=("${test_pkgs[@]}")
fi

missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    # Debian's prometheus package would start its server from the postinst when systemd runs;
    # we only want promtool, so keep services from starting.
    printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
    $sudo chmod +x /usr/sbin/policy-rc.d
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
        "${missing[@]}"
    $sudo rm -f /usr/sbin/policy-rc.d
fi

# nvcc lives outside PATH on some machines; meson finds the toolkit by itself (CUDA_PATH, else
# /usr/local/cuda): this only helps tools.
if [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="$PATH:/usr/local/cuda/bin"
fi

dir=${1:-build}
shift || true
if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" "$@"
elif [ $# -gt 0 ]; then
    # An existing build directory takes the options asked for now; one configured before an
    # option existed does not know it yet, and is set up again with it.
    meson configure "$dir" "$@" 2>/dev/null || meson setup --reconfigure "$dir" "$@"
fi
ninja -C "$dir"
