#!/usr/bin/env python3
"""check_exports.py: libkvtier exports its API and nothing else (issue 38: it exported 128
symbols, 74 of them the wire codec's and the logger's).

The API is the functions client/kvtier.h declares. Every one of them must carry KVT_API (the
library is built with hidden visibility: a declaration without it names a function the library
does not export), and the library's dynamic symbol table (`nm -D --defined-only`) must hold
exactly those functions: one more is an internal leaking out, one fewer a declared function
missing.

    check_exports.py HEADER LIBRARY [NM]     exit 0: they agree; 1: each difference listed
"""

import re
import subprocess
import sys


def declarations(text: str) -> dict:
    """{function name: True when declared with KVT_API} of a C header: its top-level
    declarations (outside any struct, union or enum body) that declare a function, typedefs
    aside."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = "\n".join(line for line in text.split("\n") if not line.lstrip().startswith("#"))
    text = text.replace('extern "C" {', " ")
    out = {}
    depth = 0
    stmt = []
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth = max(depth - 1, 0)
        if depth == 0 and ch == ";":
            s = " ".join("".join(stmt).split())
            stmt = []
            if s.startswith("typedef") or "(" not in s:
                continue
            m = re.match(r"^(.*?)\b([A-Za-z_]\w*)\s*\(", s)
            if m and "}" not in m.group(1):
                out[m.group(2)] = re.search(r"\bKVT_API\b", m.group(1)) is not None
        elif depth == 0 and ch != "}":
            stmt.append(ch)
        elif ch == "}":
            stmt = []
    return out


def exported(lib: str, nm: str) -> set:
    out = subprocess.run([nm, "-D", "--defined-only", lib], capture_output=True, text=True,
                         check=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            names.add(parts[2].split("@")[0])
    return names


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    header, lib = sys.argv[1], sys.argv[2]
    nm = sys.argv[3] if len(sys.argv) > 3 else "nm"
    with open(header, encoding="utf-8") as f:
        decl = declarations(f.read())
    syms = exported(lib, nm)
    bad = []
    bad += ["%s: declared in %s without KVT_API (so not exported)" % (n, header)
            for n in sorted(decl) if not decl[n]]
    bad += ["%s: declared in %s but not exported by %s" % (n, header, lib)
            for n in sorted(decl) if decl[n] and n not in syms]
    bad += ["%s: exported by %s but not declared in %s (an internal leaking out)" % (n, lib,
                                                                                     header)
            for n in sorted(syms - set(decl))]
    for b in bad:
        print(b)
    if bad:
        print("check_exports: %d difference(s) between %s and %s" % (len(bad), header, lib),
              file=sys.stderr)
        return 1
    if not decl:
        print("check_exports: no function found in %s" % header, file=sys.stderr)
        return 1
    print("check_exports: %s exports the %d functions %s declares, and nothing else"
          % (lib, len(decl), header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
