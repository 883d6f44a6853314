"""run.py: runs the kvtier package's pytest suite (tests/python) with the venv scripts/pyenv.sh
makes (scripts/test.sh runs it first): $KVT_PYENV, else $KVT_BUILD_ROOT/pyenv, else the source
tree's build/pyenv (so that the sanitizer build, which has no venv of its own, uses the release
build's). Without one the test is skipped (exit 77), saying why.

--sanitized LIBASAN: the build's libkvtier and kvtierd carry AddressSanitizer. Python is not
built with it, so libasan must come first in the process (LD_PRELOAD, with libstdc++ after it),
and leak checking is off for the interpreter (CPython and torch keep memory to exit); the daemons
the tests start get the build's own ASAN_OPTIONS back (KVT_DAEMON_ASAN_OPTIONS), leak checks
included.

--pyenv NAME: another venv of scripts/pyenv.sh, looked up the same way ($KVT_BUILD_ROOT/NAME,
else build/NAME), used only once it is complete: scripts/pyenv.sh writes NAME/.ready last, and
without it the test is skipped, printing why (the end of $KVT_BUILD_ROOT/NAME.log, where
scripts/test.sh keeps what making it printed). pyenv-sglang (pyenv.sh --sglang) holds the
torch and torchvision that SGLang's host KV pool needs.

Arguments after `--` replace the default tests/python as pytest's arguments (a file, -m MARK).
"""

import os
import sys

build = os.environ.get("KVT_BUILD_ROOT", "build")
source = os.environ.get("KVT_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
here = os.path.dirname(os.path.abspath(__file__))

args = sys.argv[1:]
libasan = None
name = None
while args and args[0] in ("--sanitized", "--pyenv") and len(args) > 1:
    if args[0] == "--sanitized":
        libasan = args[1]
    else:
        name = args[1]
    args = args[2:]
if args and args[0] == "--":
    args = args[1:]
tests = [os.path.join(here, a) if a.endswith(".py") else a for a in args] or [here]

if name is None:
    venvs = [os.environ.get("KVT_PYENV", ""), os.path.join(build, "pyenv"),
             os.path.join(source, "build", "pyenv")]
else:
    venvs = [os.path.join(build, name), os.path.join(source, "build", name)]
venv = next((v for v in venvs if v and os.access(os.path.join(v, "bin", "python"), os.X_OK)),
            None)
if venv is None:
    what = name or "pyenv"
    print("SKIP: no Python environment at %s/%s nor %s/build/%s (bash scripts/pyenv.sh%s makes "
          "it; scripts/test.sh does)" % (build, what, source, what,
                                         " --sglang" if name == "pyenv-sglang" else ""))
    sys.exit(77)
if name is not None and not os.path.exists(os.path.join(venv, ".ready")):
    print("SKIP: %s is incomplete (scripts/pyenv.sh did not finish making it)" % venv)
    log = os.path.join(os.path.dirname(venv), name + ".log")
    if os.path.exists(log):
        with open(log, errors="replace") as f:  # less pip's notes on absent local indexes
            tail = [ln.rstrip() for ln in f if "is ignored: it is neither" not in ln][-15:]
        print("%s ends:\n    %s" % (log, "\n    ".join(tail)))
    for log in sorted(f for f in os.listdir(venv) if f.startswith("engine-")):
        print("see also %s" % os.path.join(venv, log))
    sys.exit(77)
py = os.path.join(venv, "bin", "python")

if libasan is not None:
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        print("SKIP: sanitizer build, but the compiler names no libasan to preload (%r)" % libasan)
        sys.exit(77)
    os.environ["KVT_DAEMON_ASAN_OPTIONS"] = os.environ.get("ASAN_OPTIONS", "")
    os.environ["ASAN_OPTIONS"] = "detect_leaks=0:protect_shadow_gap=0:abort_on_error=1"
    # libstdc++ right after it: libasan's __cxa_throw interceptor looks for the real one when
    # it starts, and python links no libstdc++; without it the first C++ exception aborts the
    # process (triton 3.8, in build/pyenv-sglang, throws and catches one as it loads).
    os.environ["LD_PRELOAD"] = libasan + " libstdc++.so.6"
    os.environ["KVT_PYTEST_SANITIZED"] = "1"
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ left in the source tree
os.execv(py, [py, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", *tests])
