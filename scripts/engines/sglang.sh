#!/usr/bin/env bash
# SGLang for kvtier.sglang's tests (tests/python/test_sglang.py), beside the venv's pinned torch.
# sglang 0.5.23 pins torch==2.14.1 and a CUDA stack; a plain install would download several GB.
# So sglang goes in with --no-deps and a constraint holding the venv's torch ($torch, default
# the CPU 2.13.0 of build/pyenv), then exactly what importing its HiCache storage interface
# (sglang.srt.mem_cache.hicache_storage and .storage.backend_factory) asks for
# (scripts/engines/README.md, tried on this machine kind):
#   numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
#   pydantic_core pyzmq>=25.1.2 tqdm IPython pydantic aiohttp
# (sglang imports triton when loaded: about 1 GB).
# SGLang's host KV pool (mem_cache.pool_host) imports sglang.srt.configs, hence transformers and
# torchvision. PyPI's torchvision for torch 2.13 is a CUDA build that does not load here, so the
# zero-copy tests against a real host pool skip in build/pyenv; with $hostpool=1 (scripts/pyenv.sh
# --sglang: torch 2.14.1 + torchvision 0.29.1, which load here) this script also installs what the
# host pool imports, at the versions sglang 0.5.23 pins, and checks that it imports; and what its
# scheduler's cache (mem_cache.unified_radix_cache, whose per-step check_hicache_events logs the
# backend's get_stats with --enable-metrics) and its metrics collector import: openai,
# partial_json_parser, prometheus_client.
# Run by scripts/pyenv.sh with $venv and $pip set (and $torch, $torchvision, $hostpool).
set -euo pipefail
: "${venv:?}" "${pip:?}"
cons="$venv/constraints-sglang.txt"
echo "torch==${torch:-2.13.0}" >"$cons"
[ -z "${torchvision:-}" ] || echo "torchvision==$torchvision" >>"$cons"
$pip install -q -c "$cons" --no-deps sglang==0.5.23
$pip install -q -c "$cons" numpy orjson psutil pybase64 requests triton packaging pillow \
    starlette msgspec pydantic_core 'pyzmq>=25.1.2' tqdm IPython pydantic aiohttp
# The check the tests rely on: the storage interface and its factory import.
"$venv/bin/python" -c 'import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory'
if [ "${hostpool:-0}" = 1 ]; then
    $pip install -q -c "$cons" transformers==5.19.0 tokenizers==0.23.2 dill \
        apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf \
        openai==2.8.0 partial_json_parser==0.2.1.1.post7 prometheus_client==0.26.0
    "$venv/bin/python" -c 'import sglang.srt.mem_cache.memory_pool, sglang.srt.mem_cache.pool_host.mha'
    "$venv/bin/python" -c 'import sglang.srt.mem_cache.unified_radix_cache, sglang.srt.observability.metrics_collector'
fi
