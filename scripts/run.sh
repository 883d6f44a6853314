#!/usr/bin/env bash
# Builds kvtier (installing only the packages it needs to run, not the test tools) and starts
# kvtierd on embedded defaults in the working directory, with the arguments given (`make run
# ARGS="--dram-bytes 2G"`). The NVMe tier's file is created sparse unless the arguments say
# otherwise (--nvme-sparse, or a --config file, which may set it): preallocating 4 GiB on a
# first try takes a while and the disk space at once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --run-only build -Dbuildtype=release
sparse=(--nvme-sparse=yes)
for a in "$@"; do
    case "$a" in
    --nvme-sparse | --nvme-sparse=* | --config | --config=*) sparse=() ;;
    esac
done
exec build/server/kvtierd "${sparse[@]}" "$@"
