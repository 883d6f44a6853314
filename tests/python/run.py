"""run.py: runs the kvtier package's pytest suite (tests/python) with the venv scripts/pyenv.sh
makes (scripts/test.sh runs it first): $KVT_PYENV, else $KVT_BUILD_ROOT/pyenv, else the source
tree's build/pyenv (so that the sanitizer build, which has no venv of its own, uses the release
build's). Without one the test is skipped (exit 77), saying why.

--sanitized LIBASAN: the build's libkvtier and kvtierd carry AddressSanitizer. Python is not
built with it, so libasan must come first in the process (LD_PRELOAD), and leak checking is off
for the interpreter (CPython and torch keep memory to exit); the daemons the tests start get the
build's own ASAN_OPTIONS back (KVT_DAEMON_ASAN_OPTIONS), leak checks included.
"""

import os
import sys

build = os.environ.get("KVT_BUILD_ROOT", "build")
source = os.environ.get("KVT_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
here = os.path.dirname(os.path.abspath(__file__))

venvs = [os.environ.get("KVT_PYENV", ""), os.path.join(build, "pyenv"),
         os.path.join(source, "build", "pyenv")]
py = next((os.path.join(v, "bin", "python") for v in venvs
           if v and os.access(os.path.join(v, "bin", "python"), os.X_OK)), None)
if py is None:
    print("SKIP: no Python environment at %s/pyenv nor %s/build/pyenv (bash scripts/pyenv.sh "
          "makes it; scripts/test.sh does)" % (build, source))
    sys.exit(77)

if len(sys.argv) > 2 and sys.argv[1] == "--sanitized":
    libasan = sys.argv[2]
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        print("SKIP: sanitizer build, but the compiler names no libasan to preload (%r)" % libasan)
        sys.exit(77)
    os.environ["KVT_DAEMON_ASAN_OPTIONS"] = os.environ.get("ASAN_OPTIONS", "")
    os.environ["ASAN_OPTIONS"] = "detect_leaks=0:protect_shadow_gap=0:abort_on_error=1"
    os.environ["LD_PRELOAD"] = libasan
    os.environ["KVT_PYTEST_SANITIZED"] = "1"
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ left in the source tree
os.execv(py, [py, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", here])
