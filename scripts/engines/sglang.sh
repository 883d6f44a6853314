#!/usr/bin/env bash
# SGLang for kvtier.sglang's tests (tests/python/test_sglang.py), beside the pinned CPU torch.
# sglang 0.5.23 pins torch==2.14.1 and a CUDA stack; a plain install would download several GB.
# So sglang goes in with --no-deps and a constraint holding torch at 2.13.0, then exactly what
# importing its HiCache storage interface (sglang.srt.mem_cache.hicache_storage and
# .storage.backend_factory) asks for (../shared/ENGINES.md, tried on this machine):
#   numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
#   pydantic_core pyzmq>=25.1.2 tqdm IPython pydantic aiohttp
# (sglang imports triton when loaded: about 1 GB). Not installed: what SGLang's host KV pool
# (pool_host) would add, transformers and torchvision; PyPI's torchvision for torch 2.13 is a
# CUDA build that does not load here, so the zero-copy tests against a real host pool skip here
# unless run in a venv with torch 2.14.1 + torchvision 0.29.1 (docs/engines.md).
# Run by scripts/pyenv.sh with $venv and $pip set.
set -euo pipefail
: "${venv:?}" "${pip:?}"
cons="$venv/constraints-sglang.txt"
echo "torch==2.13.0" >"$cons"
$pip install -q -c "$cons" --no-deps sglang==0.5.23
$pip install -q -c "$cons" numpy orjson psutil pybase64 requests triton packaging pillow \
    starlette msgspec pydantic_core 'pyzmq>=25.1.2' tqdm IPython pydantic aiohttp
# The check the tests rely on: the storage interface and its factory import.
"$venv/bin/python" -c 'import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory'
