#!/usr/bin/env bash
# Builds kvtier and starts it on embedded defaults. Until kvtierd exists this runs the radix
# benchmark on the shared conversation trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build -Dbuildtype=release
if [ -x build/server/kvtierd ]; then
    exec build/server/kvtierd "$@"
fi
exec build/bench/bench_radix ../shared/traces/mooncake-conversation.jsonl --page-size 16
