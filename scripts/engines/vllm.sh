#!/usr/bin/env bash
# vLLM for kvtier.vllm's tests (tests/python/test_vllm.py) and bench_vllm, beside the pinned CPU
# torch. vllm pins torch==2.14.0 and a CUDA stack; a plain install would download several GB.
# So vllm goes in with --no-deps and a constraint holding torch at 2.13.0, then exactly what
# importing its KV connector interface (vllm.config, vllm.distributed.kv_transfer,
# vllm.v1.request, vllm.v1.core) needs (scripts/engines/README.md, tried on this machine kind), pinned to
# the versions tested: the packages below (their own dependencies resolved by pip), numpy being
# the venv's own; and, also --no-deps, xgrammar and apache-tvm-ffi (xgrammar's dependencies pull
# triton, about 1 GB, which the connector interface does not use). einops: vLLM's ModelConfig
# inspects a model's architecture by importing its model code, which imports einops; the stall
# test builds vLLM's real Scheduler from a tiny local Llama config that way.
# Run by scripts/pyenv.sh with $venv and $pip set.
set -euo pipefail
: "${venv:?}" "${pip:?}"
cons="$venv/constraints-vllm.txt"
echo "torch==2.13.0" >"$cons"
$pip install -q -c "$cons" --no-deps vllm==0.34.0
$pip install -q -c "$cons" packaging==26.4 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 \
    regex==2026.12.2 numpy pydantic==2.14.4 transformers==5.22.2 aiohttp==3.14.5 \
    requests==2.34.2 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 cbor2==6.3.0 \
    msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 \
    prometheus_client==0.26.0 llguidance==1.7.6 einops==0.8.2
$pip install -q -c "$cons" --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
# What the tests rely on: the connector base and the factory import.
"$venv/bin/python" - <<'PY'
import vllm.distributed.kv_transfer.kv_connector.factory
import vllm.distributed.kv_transfer.kv_connector.v1.base
PY
