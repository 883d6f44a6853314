"""run.py: runs the kvtier package's pytest suite (tests/python) with the Python of
$KVT_BUILD_ROOT/pyenv, the venv scripts/pyenv.sh makes (scripts/test.sh runs it first). Without
that venv, or in a sanitizer build, the test is skipped (exit 77) with the reason."""

import os
import sys

build = os.environ.get("KVT_BUILD_ROOT", "build")
here = os.path.dirname(os.path.abspath(__file__))
if len(sys.argv) > 1 and sys.argv[1] == "--sanitized":
    print("SKIP: the pytest suite runs in the release build only: an ASan build's libkvtier "
          "inside python needs libasan preloaded and leak checks off for the interpreter, and "
          "torch under ASan is slow; libkvtier runs under ASan in the Criterion suites "
          "(client_batch, server_*)")
    sys.exit(77)
py = os.path.join(build, "pyenv", "bin", "python")
if not os.access(py, os.X_OK):
    print("SKIP: no Python environment at %s/pyenv (bash scripts/pyenv.sh %s makes it; "
          "scripts/test.sh does)" % (build, build))
    sys.exit(77)
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ left in the source tree
os.execv(py, [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", here])
