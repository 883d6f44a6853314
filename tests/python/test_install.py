"""test_install.py: the package as installed by `pip install ./python` (scripts/pyenv.sh does it
into build/pyenv) imports from site-packages and finds libkvtier through KVTIER_LIB; a wrong
KVTIER_LIB is an ImportError that says where it looked; the README's example works."""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest
from conftest import BUILD_ROOT, SOURCE_ROOT

LIB = os.path.join(BUILD_ROOT, "client", "libkvtier.so")


def run_python(code, cwd, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVT_BUILD_ROOT")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=60)


def test_the_installed_package_loads_libkvtier_from_kvtier_lib(tmp_path):
    if sys.prefix == sys.base_prefix:
        pytest.skip("not in a venv: scripts/pyenv.sh installs the package into build/pyenv")
    assert importlib.metadata.version("kvtier") == "0.1.0"
    r = run_python("import kvtier; print(kvtier.__file__); print(kvtier.library_path)", tmp_path,
                   KVTIER_LIB=LIB)
    assert r.returncode == 0, r.stderr
    where, lib = r.stdout.split()
    assert "site-packages" in where and lib == LIB


def test_a_wrong_kvtier_lib_says_where_it_looked(tmp_path):
    r = run_python("import kvtier", tmp_path, KVTIER_LIB=str(tmp_path / "nope.so"),
                   PYTHONPATH=os.path.join(SOURCE_ROOT, "python"))
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "KVTIER_LIB" in r.stderr and "nope.so" in r.stderr


def test_the_readme_example(daemon):
    text = open(os.path.join(SOURCE_ROOT, "README.md")).read()
    section = text[text.index("## Use it from Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    r = run_python(code, os.path.dirname(daemon.unix), KVTIER_LIB=LIB,
                   PYTHONPATH=os.path.join(SOURCE_ROOT, "python"))
    assert r.returncode == 0, r.stderr
