"""test_package.py: the package's own shape (issue 38). Its modules import each other in one
direction only (no circle, not even through imports inside functions); each imports alone in a
fresh interpreter; and libkvtier's declarations reach it from client/kvtier.h, with no copy of
them (a cdef, a status code's value) written into a module by hand."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Set

import pytest
from conftest import SOURCE_ROOT

import kvtier

PACKAGE = os.path.join(SOURCE_ROOT, "python", "kvtier")
# The subpackages that import their engine as they load (kvtier.vllm); the others import theirs
# lazily (kvtier.sglang, kvtier.lmcache: module __getattr__).
ENGINE_OF = {"kvtier.vllm": "vllm"}


def modules() -> Dict[str, str]:
    """{dotted name: path} of every module of the package (a package is its __init__.py)."""
    out = {}
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(PACKAGE))
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(d, f)
    return out


def imports_of(name: str, path: str, known: Dict[str, str]) -> Set[str]:
    """The package's modules that module `name` imports anywhere in its code (at the top, in a
    function, under TYPE_CHECKING): each import names its module, and `from M import x` also
    the module M.x when x is one."""
    is_pkg = path.endswith("__init__.py")
    here = name if is_pkg else name.rpartition(".")[0]
    out: Set[str] = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = pkg + ("." + base if base else "")
            targets = [(base, [a.name for a in node.names])]
        else:
            continue
        for mod, names in targets:
            if mod in known:
                out.add(mod)
            out.update(mod + "." + n for n in names if mod + "." + n in known)
    out.discard(name)
    return out


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import circle of graph (as a path that ends where it starts), or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_modules_import_each_other_in_one_direction():
    known = modules()
    assert "kvtier.client" in known and "kvtier.vllm.store" in known
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    assert "kvtier.keys" in graph["kvtier.client"], "the walk sees client's imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_find_cycle_finds_a_circle_through_an_import_inside_a_function(tmp_path):
    """The walk itself: an import inside a function counts (that is how the old circle hid)."""
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import y\n")
    known = {"p.a": str(tmp_path / "a.py"), "p.b": str(tmp_path / "b.py")}
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    assert find_cycle(graph) in (["p.a", "p.b", "p.a"], ["p.b", "p.a", "p.b"])


def alone() -> List[str]:
    """The modules to import alone. A module of an engine's subpackage (kvtier.vllm.store) is
    imported through the subpackage: importing it runs the subpackage's __init__ first, which
    imports every module of it, so each would repeat the subpackage's own import (and load the
    engine again, seconds each)."""
    return sorted(m for m in modules() if ".".join(m.split(".")[:2]) not in ENGINE_OF
                  or m in ENGINE_OF)


@pytest.mark.parametrize("name", alone())
def test_each_module_imports_alone_in_a_fresh_interpreter(name):
    engine = ENGINE_OF.get(name)
    if engine and importlib.util.find_spec(engine) is None:
        pytest.skip("%s imports %s, which is not installed here" % (name, engine))
    # The package's __init__ (which imports most modules, in its own order) is left out unless
    # it is the module tested: kvtier stands in as a bare package, so that the module loads only
    # what it imports itself, first.
    code = "import %s" % name
    if name != "kvtier":
        code = ("import sys, types; p = types.ModuleType('kvtier'); p.__path__ = [%r]; "
                "sys.modules['kvtier'] = p; " % PACKAGE) + code
    code += "; import sys; print(sorted(m for m in sys.modules if m.startswith('kvtier')))"
    env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE_ROOT, "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert name in loaded
    if name not in ("kvtier", "kvtier.aio") and not name.startswith(tuple(ENGINE_OF)):
        assert "kvtier.aio" not in loaded, "%s alone loads only what it imports" % name


def test_every_function_of_the_header_reaches_the_package():
    text = open(os.path.join(SOURCE_ROOT, "client", "kvtier.h")).read()
    names = set(re.findall(r"^KVT_API\b[^;]*?\b(kvt_\w+)\(", text, re.M))
    assert len(names) >= 54
    for n in sorted(names):
        assert callable(getattr(kvtier._lib.lib, n)), n
    assert kvtier._lib.header.name == "kvtier.h"


def test_no_module_copies_a_declaration_or_a_code_by_hand():
    """Only _lib.py gives cffi declarations, and only the header's; no module writes a status
    code's value (-30800..-30899) itself."""
    for name, path in modules().items():
        src = open(path).read()
        tree = ast.parse(src, path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "cdef"):
                assert name == "kvtier._lib" and isinstance(node.args[0], ast.Name), \
                    "%s:%d: a cdef of its own" % (path, node.lineno)
        m = re.search(r"-\s*308\d\d\b", src)
        assert m is None, "%s: a status code written by hand (%s)" % (path, m.group(0))
