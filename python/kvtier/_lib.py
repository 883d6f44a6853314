"""_lib.py: loads libkvtier with cffi in ABI mode (no compiler needed when installing) and
declares client/kvtier.h to cffi: the header itself, read when the package is imported, so
that no declaration, code or constant is copied here by hand (issue 38: a hand copy had drifted
and lacked EAGAIN). The wheel carries the header beside its libkvtier (client/meson.build); a
source checkout reads client/kvtier.h. Read at import rather than turned into a module at build
time, because the package is also imported straight from ``python/`` (the tests, a checkout),
where no build step would refresh a generated file: one path for both, never stale; parsing
it costs a few tens of milliseconds, once.

Where libkvtier comes from, first match wins:

1. ``$KVTIER_LIB``: a path to the library (a file name without a slash is looked up by the
   dynamic loader). If it is set and fails to load, that is an error, not a fallback.
2. Next to the package: ``kvtier/libkvtier.so`` (the wheel's own copy: ``pip install .`` from
   the repository root builds it there) or ``kvtier/libkvtier.so.0``.
3. ``$KVT_BUILD_ROOT/client/libkvtier.so`` (the meson build tree the tests run from).
4. ``<source>/build/client/libkvtier.so`` when the package is imported from a source checkout
   (``python/kvtier`` beside ``build/``).
5. The dynamic loader's search path, by name: ``libkvtier.so.0`` (``meson install`` puts it in
   the library directory; run ``ldconfig`` or set ``LD_LIBRARY_PATH``).

cffi rather than ctypes: ``ffi.from_buffer`` borrows any buffer, read-only ones included
(``bytes``, a read-only numpy array), without a copy, where ctypes' ``from_buffer`` insists on
writable buffers; and cffi releases the GIL around every C call, so that other Python threads
(and an asyncio loop using the executor form) run while a call waits on the daemon.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import cffi  # type: ignore[import-untyped]

HEADER = "kvtier.h"


def header_candidates() -> List[Path]:
    """Where client/kvtier.h is looked for, in order: beside the modules (the wheel's copy,
    which client/meson.build installs with its libkvtier), then the source checkout's
    ``client/kvtier.h`` (the package imported from ``python/``)."""
    here = Path(__file__).resolve().parent
    return [here / HEADER, here.parent.parent / "client" / HEADER]


def find_header() -> Path:
    for p in header_candidates():
        if p.is_file():
            return p
    raise ImportError(
        "kvtier: client/kvtier.h, which declares libkvtier's API to this package, is not "
        "beside the package nor in a source checkout around it; install the package with "
        "`pip install .` from the kvtier repository's root (that puts the header in it). "
        "Tried: " + "; ".join(str(p) for p in header_candidates()))


def cdef_of(text: str) -> Tuple[str, Dict[str, int], Dict[str, str]]:
    """cffi's declarations of a C header (kvtier.h), and its integer and string macros.

    The header is prepared as a small preprocessor would, for cffi's parser: comments out,
    ``#ifdef __cplusplus`` blocks out, other directives dropped, the KVT_API marker (visibility,
    nothing cffi needs) removed, and each integer macro (``#define KVT_KEY_TOKENS 4``) both
    declared to cffi (``lib.KVT_KEY_TOKENS``) and put in place of its name where declarations
    use it (an array's length). String macros (``KVT_KEYS_TAG``) come back in the third value.
    """
    text = re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: "\n" * m.group(0).count("\n"), text,
                  flags=re.S)
    ints: Dict[str, int] = {}
    strs: Dict[str, str] = {}
    body = []
    skip = 0
    for line in text.split("\n"):
        d = line.strip()[1:].split() if line.strip().startswith("#") else None
        if d is None:
            body.append("" if skip else line)
            continue
        body.append("")
        if not d:
            continue
        if skip:
            skip += {"if": 1, "ifdef": 1, "ifndef": 1, "endif": -1}.get(d[0], 0)
        elif d[:2] == ["ifdef", "__cplusplus"]:
            skip = 1
        elif d[0] == "define" and len(d) >= 3:
            value = " ".join(d[2:])
            if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)[uUlL]*", value):
                ints[d[1]] = int(value.rstrip("uUlL"), 0)
            elif re.fullmatch(r'"[^"\\]*"', value):
                strs[d[1]] = value[1:-1]
    src = re.sub(r"\bKVT_API\b", "", "\n".join(body))
    for name, value in ints.items():
        src = re.sub(r"\b%s\b" % name, str(value), src)
    defines = "".join("#define %s %d\n" % kv for kv in ints.items())
    return defines + src, ints, strs


header = find_header()
CDEF, INTS, STRINGS = cdef_of(header.read_text(encoding="utf-8"))
ffi = cffi.FFI()
ffi.cdef(CDEF)


def candidates() -> List[str]:
    """The places tried for libkvtier, in order (see the module's docstring)."""
    env = os.environ.get("KVTIER_LIB")
    if env:
        return [env]
    here = Path(__file__).resolve().parent
    paths = [here / "libkvtier.so", here / "libkvtier.so.0"]
    build = os.environ.get("KVT_BUILD_ROOT")
    if build:
        paths.append(Path(build) / "client" / "libkvtier.so")
    paths.append(here.parent.parent / "build" / "client" / "libkvtier.so")
    out = [str(p) for p in paths if p.exists()]
    out.append("libkvtier.so.0")
    return out


def load() -> Any:
    tried = []
    for c in candidates():
        try:
            lib = ffi.dlopen(c)
        except OSError as e:
            tried.append("%s (%s)" % (c, e))
            if os.environ.get("KVTIER_LIB"):
                break
            continue
        global path
        path = c
        return lib
    raise ImportError(
        "kvtier: libkvtier not found; install the package with `pip install .` from the "
        "kvtier repository's root (that builds libkvtier into it), or set KVTIER_LIB to the "
        "library's path (meson: build/client/libkvtier.so), or install it (meson install). "
        "Tried: " + "; ".join(tried))


path = ""
lib = load()


def codes() -> Dict[str, int]:
    """The status codes client/kvtier.h declares (``KVT_CLIENT_EINVAL`` and the others of its
    enum), by their short name: {"EINVAL": the value of KVT_CLIENT_EINVAL, ...}."""
    return {n[len("KVT_CLIENT_"):]: getattr(lib, n) for n in dir(lib)
            if n.startswith("KVT_CLIENT_E")}


@contextlib.contextmanager
def put_flags(c: Any, gaps: bool) -> Iterator[None]:
    """The PUTs and RESERVEs of the libkvtier client ``c`` inside the block carry the GAPS flag
    when ``gaps`` (kvt_client_set_put_flags; docs/protocol.md, "Chains with gaps"); the flags
    set before come back after. The caller holds the client's lock."""
    if not gaps:
        yield
        return
    was = lib.kvt_client_set_put_flags(c, lib.KVT_CLIENT_PUT_GAPS)
    try:
        yield
    finally:
        lib.kvt_client_set_put_flags(c, was)
