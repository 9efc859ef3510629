#!/usr/bin/env bash
# Fetch the wheels a bare GPU machine lacks to run memfit (benchmarks/gpu_check.sh), into
# wheelhouse/ (git-ignored): run here, where PyPI is reachable, after `make install`; carry the
# folder to the GPU machine.
#
#   benchmarks/fetch_gpu_wheels.sh [PYTHON_VERSION (default 3.12, the GPU image's)]
#
# What: benchmarks/gpu_wheels.py (memfit's runtime closure at the lock's versions, less what the
# image holds: benchmarks/gpu_image_packages.txt), each with `pip download --no-deps` for that
# Python on manylinux x86-64, so nothing the machine has comes twice. DeepSpeed publishes no
# wheel on PyPI: it is built here from its sdist with DS_BUILD_OPS=0 (no op compiled ahead; the
# GPU machine JIT-builds FusedAdam on first use, gpu_check.sh starts that at once). A package
# published as an sdist only is built here into its (pure-Python) wheel the same way. The
# folder must stay under about 59 MiB: a device call carries 64 MiB with the source.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
DEST=${WHEELHOUSE:-wheelhouse}
VENV_PY=${VENV_PY:-.venv/bin/python}
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
"$VENV_PY" benchmarks/gpu_wheels.py --python "$PY" >"$DEST/requirements.txt"
while read -r req; do
    name=${req%%==*}
    if [ "$name" = deepspeed ] || ! "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: \
        --python-version "$PY" --implementation cp "${platforms[@]}" --platform any -d "$DEST" "$req" 2>/dev/null; then
        echo "building $req from its sdist" >&2
        DS_BUILD_OPS=0 "$VENV_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$req"
    fi
done <"$DEST/requirements.txt"
n=$(ls "$DEST"/*.whl | wc -l)
want=$(wc -l <"$DEST/requirements.txt")
[ "$n" -eq "$want" ] || { echo "fetched $n wheels for $want requirements" >&2; exit 1; }
du -sh "$DEST"
