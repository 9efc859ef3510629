#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_evidence.py needs beyond PyTorch, for the GPU machine's
# Python and platform, into wheelhouse/ (git-ignored). Run where the network is; carry the folder.
#
#   benchmarks/fetch_gpu_wheels.sh 3.11 manylinux_2_28_x86_64   # python version, platform tag
#
# On the device machine (no network, PyTorch with CUDA preinstalled):
#   pip install --no-index --find-links wheelhouse deepspeed peft transformers accelerate \
#       safetensors tokenizers pyarrow pyyaml tqdm bitsandbytes liger-kernel
#   pip install --no-index --find-links wheelhouse flash-attn   # only if a wheel was found
set -euo pipefail
PY=${1:?usage: $0 PYTHON_VERSION (e.g. 3.11) [PLATFORM (default manylinux2014_x86_64)]}
PLAT=${2:-manylinux2014_x86_64}
DEST=${WHEELHOUSE:-wheelhouse}
mkdir -p "$DEST"
common=(--only-binary=:all: --python-version "$PY" --platform "$PLAT" --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform any -d "$DEST")
# required (torch itself is preinstalled there: --no-deps keeps pip from fetching another one,
# the second line adds the pure-Python dependencies)
pip download "${common[@]}" --no-deps deepspeed peft transformers accelerate safetensors tokenizers \
    pyarrow pyyaml tqdm huggingface-hub regex packaging psutil py-cpuinfo ninja hjson msgpack \
    numpy filelock fsspec requests pydantic pydantic-core annotated-types typing-extensions \
    typing-inspection urllib3 idna certifi charset-normalizer hf-xet
# optional: their rows are recorded as "skipped: <reason>" when absent
pip download "${common[@]}" --no-deps bitsandbytes || echo "bitsandbytes: no wheel for $PY/$PLAT" >&2
pip download "${common[@]}" --no-deps liger-kernel triton || echo "liger-kernel: no wheel" >&2
# flash-attn publishes few PyPI wheels (mostly sdists); a wheel must match torch + CUDA + cxx11 ABI
pip download "${common[@]}" --no-deps flash-attn || echo "flash-attn: no wheel for $PY/$PLAT (rows will be skipped)" >&2
ls -1 "$DEST"
