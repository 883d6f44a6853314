#!/usr/bin/env bash
# The Python environment of the package's tests and benchmark: a venv at $1/pyenv (default
# build/pyenv) with torch (the CPU wheel, pinned: any other version downloads GBs of CUDA
# wheels), numpy, pytest, cffi and meson-python (to build the package), and the kvtier package
# (`pip install .`: python/ with its own libkvtier) installed into it. Creates the venv once;
# reinstalls the package only when its files changed; quiet when all is current.
#
# pyenv.sh --sglang [DIR]: the venv $DIR/pyenv-sglang of the one test that needs SGLang's real
# host KV pool (tests/meson.build's python_sglang_hostpool). The pool imports torchvision, and
# PyPI's torchvision for the CPU torch 2.13.0 does not load here; torch 2.14.1 with torchvision
# 0.29.1 (CUDA builds, on this machine's disk, that run on the CPU; about 5.5 GB) do. Only SGLang
# goes in beside them (scripts/engines/sglang.sh, with $hostpool=1). $venv/.ready says that all
# of it installed: without it that test skips, printing why.
set -euo pipefail
cd "$(dirname "$0")/.."

sglang=0
if [ "${1:-}" = "--sglang" ]; then
    sglang=1
    shift
fi
dir=${1:-build}
if [ $sglang = 1 ]; then
    venv="$dir/pyenv-sglang"
    reqs="torch==2.14.1 torchvision==0.29.1 numpy pytest cffi>=1.15 meson-python"
    engines=(scripts/engines/sglang.sh)
    export torch=2.14.1 torchvision=0.29.1 hostpool=1
    rm -f "$venv/.ready"
else
    venv="$dir/pyenv"
    reqs="torch==2.13.0 numpy pytest cffi>=1.15 meson-python matplotlib"
    engines=(scripts/engines/*.sh)
fi

# Debian's python3 makes venvs only with python3-venv (ensurepip) installed.
if ! python3 -c 'import ensurepip' 2>/dev/null; then
    echo "pyenv: installing python3-venv" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends python3-venv
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "pyenv: creating $venv" >&2
    python3 -m venv "$venv"
fi
if [ "$(cat "$venv/.reqs" 2>/dev/null)" != "$reqs" ]; then
    echo "pyenv: installing $reqs" >&2
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q $reqs
    echo "$reqs" >"$venv/.reqs"
fi
# The package itself: a real install (not editable) of the wheel `pip install .` builds (python/
# and libkvtier inside it, built by meson-python: pyproject.toml), so that the tests' check of the
# installed copy proves it works; redone whenever a file it is made of changed. No build
# isolation: the venv's meson-python and meson (first on PATH) build it, with no download.
stamp=$(find python client common proto meson.build meson_options.txt pyproject.toml -type f \
    -not -path '*/__pycache__/*' -not -name 'libkvtier.so*' -print0 |
    sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
if [ "$(cat "$venv/.kvtier" 2>/dev/null)" != "$stamp" ]; then
    echo "pyenv: installing the kvtier package (pip install .)" >&2
    PATH="$(cd "$venv/bin" && pwd):$PATH" "$venv/bin/python" -m pip install -q --no-deps \
        --no-build-isolation --force-reinstall .
    echo "$stamp" >"$venv/.kvtier"
fi
# The serving engines the connectors are tested against (vLLM, SGLang, LMCache): one script each
# in scripts/engines/, run with $venv and $pip set, redone when the script changes. An engine
# that cannot be installed (its registry unreachable, say) does not stop the rest: the script's
# log is kept in $venv/engine-NAME.log and the tests of that connector skip, naming it.
for f in "${engines[@]}"; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .sh)
    sum=$(sha1sum "$f" | cut -d' ' -f1)
    [ "$(cat "$venv/.engine-$name" 2>/dev/null)" = "$sum" ] && continue
    echo "pyenv: installing engine $name ($f)" >&2
    if venv="$venv" pip="$venv/bin/python -m pip" bash "$f" >"$venv/engine-$name.log" 2>&1; then
        echo "$sum" >"$venv/.engine-$name"
    else
        echo "pyenv: engine $name not installed; its connector's tests will skip" \
            "(see $venv/engine-$name.log)" >&2
        rm -f "$venv/.engine-$name"
    fi
done
if [ $sglang = 1 ]; then
    [ -e "$venv/.engine-sglang" ] || exit 1
    touch "$venv/.ready"
fi
