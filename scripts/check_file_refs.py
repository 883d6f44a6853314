#!/usr/bin/env python3
"""check_file_refs.py: fails when a comment or a document names a source file (`*.c`, `*.h`,
`*.py`) that the repository does not have, so that a file split or renamed cannot leave its old
name behind in the prose that sends a reader to it (issue 38: five comments of server/ still
sent readers to the request handlers' and the settings' files by names they had lost).

What is read: the comments of C files (`/* */`, `//`; `#include` lines are not prose), the
comments and docstrings of Python files, the `#` comments of meson.build files, and the whole
text of the Markdown documents except CHANGELOG.md (history names files as they were then).

A name with a folder (`server/conn.c`) must be a tracked path or the tail of one; a bare name
(`conn.c`) the name of some tracked file. Files meson generates from a `NAME.in` template count
as present, as do the few names below that are not ours (another project's files) or are a
file's installed name. A reference into an older commit (`git show REV:path`) is history.

    check_file_refs.py [ROOT]      exit 0: none found; 1: each one listed with file:line
"""

import io
import os
import re
import sys
import tokenize

from check_self_contained import tracked  # the tracked files, or a walk without git

NAME = re.compile(r"(?<![\w./\-:$%])((?:[\w\-]+/)*[\w\-]+\.(?:c|h|py))\b(?![\w(\-])")
# Names that are right although no tracked file has them, each with why.
KNOWN = {
    "config.h": "meson's configure_file output (meson.build)",
    "kvtier-plot.py": "replay/plot.py's installed name (replay/meson.build)",
    "libexecdir/kvtier/kvtier-plot.py": "replay/plot.py's installed path",
    "srt/arg_groups/hicache_hook.py": "SGLang's file",
    "v1/worker/gpu/kv_connector.py": "vLLM's file (its model runner's connector calls)",
    "xxhash.h": "libxxhash's header (Debian's libxxhash-dev)",
    "xxh_x86dispatch.c": "libxxhash's runtime dispatch (its source)",
    "storage.c": "memcached's (docs/architecture.md compares the door with it)",
    "extstore.h": "memcached's",
}
C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def c_prose(text: str) -> list:
    """(line, text) of each comment of a C file."""
    out = []
    for m in C_COMMENT.finditer(text):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(0)))
    return out


def py_prose(text: str) -> list:
    """(line, text) of each comment and docstring of a Python file (a string that is a statement
    of its own)."""
    out = []
    prev = tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
            elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT,
                                                          tokenize.DEDENT):
                out.append((tok.start[0], tok.string))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def hash_prose(text: str) -> list:
    """(line, text) of each `#` comment of a meson.build file."""
    out = []
    for i, line in enumerate(text.split("\n"), 1):
        j = line.find("#")
        if j >= 0:
            out.append((i, line[j:]))
    return out


def prose_of(rel: str, text: str) -> list:
    base = os.path.basename(rel)
    if rel.endswith((".c", ".h", ".c.in", ".h.in")):
        return c_prose(text)
    if rel.endswith(".py"):
        return py_prose(text)
    if base == "meson.build":
        return hash_prose(text)
    if rel.endswith(".md") and base != "CHANGELOG.md":
        return [(1, text)]
    return []


def main() -> int:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    files = tracked(root)
    paths = set(files)
    for p in files:  # what meson makes from a template
        if p.endswith(".in"):
            paths.add(p[:-3])
    names = {os.path.basename(p) for p in paths}

    def exists(name: str) -> bool:
        if name in KNOWN:
            return True
        if "/" not in name:
            return name in names
        return name in paths or any(p.endswith("/" + name) for p in paths)

    bad = []
    for rel in files:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        for line, chunk in prose_of(rel, text):
            for k, part in enumerate(chunk.split("\n")):
                for m in NAME.finditer(part):
                    if re.search(r"git show \S*$", part[:m.start()]):
                        continue
                    if not exists(m.group(1)):
                        bad.append("%s:%d: %s" % (rel, line + k, m.group(1)))
    for b in bad:
        print(b)
    sys.stdout.flush()
    if bad:
        print("check_file_refs: %d name(s) of files that do not exist (rename them to the file "
              "that now holds what they meant)" % len(bad), file=sys.stderr)
        return 1
    print("check_file_refs: every *.c, *.h and *.py file named in comments and docs exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
