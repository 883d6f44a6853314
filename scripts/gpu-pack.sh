#!/usr/bin/env bash
# gpu-pack.sh (`make gpu-pack`): packs a CUDA build of this checkout for a GPU machine that has
# no package access, into .gpu/ (ignored by .gitignore; carry it with the checkout).
#
# .gpu/ holds: build/ (release, CUDA on, tests on; object files removed), lib/ (the shared
# libraries the binaries load that are not glibc's or the compiler's), bin/ (redis-server and
# redis-cli), wheels/ (cffi and pycparser for the GPU image's python3, which has numpy, pytest
# and a CUDA torch but not these; --python-version below), tests.json (meson's test list), root
# (this checkout's absolute path, which the build embeds) and run.sh, the runner:
#
#     bash .gpu/run.sh suite [TEST...]   every meson test of .gpu/build, or only those named
#     bash .gpu/run.sh bench             bench_tiers --only hbm: HBM copies against the ceiling;
#                                        bench_gpucopy: engine tensors <-> arena against it
#     bash .gpu/run.sh all               suite, then bench
#     bash .gpu/run.sh -- CMD ARGS...    CMD in the packed environment (redis up, paths set)
#
# Each check prints one line; the runner closes with "N passed, N failed" and exits non-zero
# when any failed. Logs go to $OUT/gpu-logs.tgz ($OUT if set, else .gpu/out). The traces are the
# repository's own (traces/), so the pack refers to nothing outside the checkout.
#
# The checkout and .gpu/ together must stay within 64 MiB (what a GPU run can carry): the script
# measures both and fails when they do not fit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
g=.gpu
limit=$((64 * 1024 * 1024))
pyver=${KVT_GPU_PYTHON:-3.12}

cuda=${CUDA_PATH:-/usr/local/cuda}
if [ ! -x "$cuda/bin/nvcc" ]; then
    echo "gpu-pack: no CUDA toolkit at $cuda (set CUDA_PATH): the pack needs the CUDA build" >&2
    exit 1
fi
export PATH="$cuda/bin:$PATH"

bash scripts/setup.sh $g/build -Dbuildtype=release -Dcuda=enabled -Dtests=enabled
meson introspect --tests $g/build >$g/tests.json
echo "$root" >$g/root

# Libraries: everything ldd resolves for the packed programs, less what every Linux has.
rm -rf $g/lib $g/bin && mkdir -p $g/lib $g/bin
progs=$(find $g/build -type f -perm -u+x ! -name '*.so*' ! -path '*/meson-*' ! -path '*.p/*')
for lib in $(for p in $progs $g/build/client/libkvtier.so /usr/bin/redis-server; do
                 ldd "$p" 2>/dev/null || true
             done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u); do
    case $(basename "$lib") in
    libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | libresolv.so* | \
        libstdc++.so* | libgcc_s.so* | libkvtier.so*) ;;
    libcuda.so*) ;; # the driver: the GPU machine's own
    *) cp -L "$lib" $g/lib/ ;;
    esac
done
cp /usr/bin/redis-server /usr/bin/redis-cli $g/bin/

# The Python package's one compiled dependency, for the GPU image's interpreter.
rm -rf $g/wheels && mkdir -p $g/wheels
if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d $g/wheels cffi \
    pycparser; then
    echo "gpu-pack: could not fetch cffi for Python $pyver: the Python checks will skip" >&2
fi
find $g/build -name '*.o' -delete

cp scripts/gpu-run.sh $g/run.sh
chmod +x $g/run.sh

# What travels: the files git tracks or would track (ignored ones stay behind), and .gpu/.
checkout=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -n1 | cut -f1)
pack=$(du -sb $g | cut -f1)
total=$((checkout + pack))
echo "gpu-pack: .gpu/ is $pack bytes, the checkout $checkout: $total of $limit"
if [ "$total" -gt "$limit" ]; then
    echo "gpu-pack: the checkout and .gpu/ exceed 64 MiB: they cannot travel together" >&2
    exit 1
fi
echo "gpu-pack: carry .gpu and run, from the checkout's root there: bash .gpu/run.sh all"
