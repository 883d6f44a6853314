#!/usr/bin/env bash
# Installs the Debian packages kvtier builds and tests with, when any is missing, then
# configures the build directory given as $1 (default: build) with meson's extra options $2...
set -euo pipefail

pkgs=(gcc pkg-config meson ninja-build clang-format
      libjemalloc-dev liburing-dev libhiredis-dev libxxhash-dev libcriterion-dev
      redis-server redis-tools fio prometheus)

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
    meson configure "$dir" "$@" # an existing build directory takes the options asked for now
fi
ninja -C "$dir"
