#!/usr/bin/env bash
# vLLM for kvtier.vllm's tests (tests/python/test_vllm.py), beside the pinned CPU torch.
# vllm pins torch==2.14.0 and a CUDA stack; a plain install would download several GB. So vllm
# goes in with --no-deps and a constraint holding torch at 2.13.0, then exactly what importing
# its KV connector interface (vllm.distributed.kv_transfer, vllm.config, vllm.v1.request) needs
# (../shared/ENGINES.md, tried on this machine):
#   packaging psutil pyzmq>=25 urllib3 regex numpy pydantic>=2.12 transformers>=5.16.1,<5.23
#   aiohttp>=3.14.4 requests>=2.33 pillow>=13 pybase64 cachetools cbor2 msgspec cloudpickle
#   uvloop py-cpuinfo prometheus_client>=0.18 llguidance>=1.7,<1.8
# and, also --no-deps, xgrammar==0.2.8 apache-tvm-ffi (xgrammar's own dependencies pull triton,
# about 1 GB, which the connector interface does not use).
# Run by scripts/pyenv.sh with $venv and $pip set.
set -euo pipefail
: "${venv:?}" "${pip:?}"
cons="$venv/constraints-vllm.txt"
echo "torch==2.13.0" >"$cons"
$pip install -q -c "$cons" --no-deps vllm==0.34.0
$pip install -q -c "$cons" packaging psutil 'pyzmq>=25' urllib3 regex numpy 'pydantic>=2.12' \
    'transformers>=5.16.1,<5.23' 'aiohttp>=3.14.4' 'requests>=2.33' 'pillow>=13' pybase64 \
    cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo 'prometheus_client>=0.18' \
    'llguidance>=1.7,<1.8'
$pip install -q -c "$cons" --no-deps xgrammar==0.2.8 apache-tvm-ffi
# The check the tests rely on: the connector base and the factory import.
"$venv/bin/python" -c 'import vllm.distributed.kv_transfer.kv_connector.v1.base, vllm.distributed.kv_transfer.kv_connector.factory'
