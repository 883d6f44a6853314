#!/usr/bin/env python3
"""check_self_contained.py: fails when a tracked file of the repository refers to a folder
outside it, so that a clone needs nothing beside it (the traces, the code conventions, the
engines' notes and the GPU pack all live in the repository).

A reference is a path made of one or more `../` steps followed by a name. It is fine when, read
from the folder of the file that names it or from the root (docs name paths from the root,
build files from their own folder), it lands on something that exists inside the repository;
otherwise it points outside (or nowhere) and is listed. Absolute paths
into the development machine's work area (the folder `/work`) are refused as well. Data files (traces)
and the licence texts are not read.

    check_self_contained.py [ROOT]      exit 0: none found; 1: each one listed
"""

import os
import re
import subprocess
import sys

REL = re.compile(r"(?<![\w.])((?:\.\./)+[\w.-]+)")
ABS = re.compile(r"(?<![\w.])(/work/[\w.-]+)")
SKIP_SUFFIX = (".jsonl", ".png", ".json", ".bin")


def tracked(root: str) -> list:
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True,
                             check=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith((".git", "build", ".gpu"))]
            found += [os.path.relpath(os.path.join(d, f), root) for f in files]
        return found


def inside(root: str, base: str, ref: str) -> bool:
    target = os.path.normpath(os.path.join(base, ref))
    return not os.path.relpath(target, root).startswith("..") and os.path.exists(target)


def main() -> int:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    bad = []
    for rel in tracked(root):
        if rel.endswith(SKIP_SUFFIX) or "/LICENSE" in rel or rel.startswith("LICENSE"):
            continue
        if rel.startswith("fuzz/corpus/"):
            continue
        path = os.path.join(root, rel)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except (UnicodeDecodeError, OSError):
            continue
        here = os.path.dirname(path)
        for n, line in enumerate(lines, 1):
            for m in REL.finditer(line):
                ref = m.group(1)
                if not inside(root, here, ref) and not inside(root, root, ref):
                    bad.append("%s:%d: %s" % (rel, n, ref))
            for m in ABS.finditer(line):
                bad.append("%s:%d: %s" % (rel, n, m.group(1)))
    for b in bad:
        print("outside the repository: " + b)
    print("self-contained: %d tracked files read, %d references outside the repository"
          % (len(tracked(root)), len(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
