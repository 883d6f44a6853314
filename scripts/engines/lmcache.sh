#!/usr/bin/env bash
# LMCache for kvtier.lmcache's tests (tests/python/test_lmcache.py), beside the pinned CPU torch.
# lmcache 0.5.6 declares any torch but also CUDA packages (cupy, nvtx, ...) a CPU run does not
# need, and numpy<=2.2.6 (it runs with the venv's newer numpy). So lmcache goes in with
# --no-deps and a constraint holding torch at 2.13.0, then exactly what importing its config,
# metadata, memory management, LocalCPUBackend, storage manager and RemoteConnector needs
# (scripts/engines/README.md, tried on this machine kind):
#   pyyaml requests cachetools sortedcontainers numba prometheus_client>=0.18,<=0.24.1
#   py-cpuinfo psutil aiohttp aiofile msgspec pyzmq>=25 transformers>=5.4 cryptography
#   xxhash>=3.4 blake3>=0.4
# Run by scripts/pyenv.sh with $venv and $pip set.
set -euo pipefail
: "${venv:?}" "${pip:?}"
cons="$venv/constraints-lmcache.txt"
# transformers at the version vllm.sh pins: lmcache asks only >=5.4, and the newest (5.25.0 on
# 2026-12-07) was installed here and then replaced by vllm.sh's 5.22.2, byte-compiled twice.
printf 'torch==2.13.0\ntransformers==5.22.2\n' >"$cons"
$pip install -q -c "$cons" --no-deps lmcache==0.5.6
$pip install -q -c "$cons" pyyaml requests cachetools sortedcontainers numba \
    'prometheus_client>=0.18,<=0.24.1' py-cpuinfo psutil aiohttp aiofile msgspec 'pyzmq>=25' \
    'transformers>=5.4' cryptography 'xxhash>=3.4' 'blake3>=0.4'
# The check the tests rely on: the connector base, the config and the CPU backend import.
"$venv/bin/python" -c 'import lmcache.v1.storage_backend.connector.base_connector, lmcache.v1.config, lmcache.v1.storage_backend.local_cpu_backend'
