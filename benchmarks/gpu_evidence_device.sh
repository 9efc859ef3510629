#!/usr/bin/env bash
# benchmarks/gpu_evidence.py in one call on a GPU machine with no network and PyTorch with CUDA
# preinstalled (the device machines memfit is sometimes lent): install the carried wheels, build
# DeepSpeed's FusedAdam while the model is built, run the stages in the order given within a
# deadline (a stage cut short keeps its finished rows and runs again next time), and leave the
# evidence JSON and the probe logs in DEST.
#
#   benchmarks/fetch_gpu_wheels.sh 3.12 manylinux_2_28_x86_64      # where the network is
#   benchmarks/gpu_evidence_device.sh wheelhouse OUT_DIR 480 [STAGE ...]
#   python benchmarks/gpu_evidence.py --write-calibration OUT_DIR/gpu_evidence.json   # back here
set -uo pipefail
WHEELS=${1:?usage: $0 WHEEL_DIR DEST_DIR DEADLINE_S [STAGE ...]}
DEST=${2:?destination folder}
DEADLINE=${3:?seconds after which no probe starts}
shift 3
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(context sft_zero sft_gc_lora step_time dpo_ref qlora attention allocator long_context)
mkdir -p "$DEST"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/memfit-site \
    "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/memfit-site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=/tmp/memfit-torch-extensions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, deepspeed, transformers, peft; print(sys.version.split()[0], 'torch', torch.__version__, \
'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" || exit 1
# the first DeepSpeed engine JIT-builds FusedAdam (nvcc); building it now overlaps the model build
# (torch's extension builder locks its folder, so an engine that gets there first waits for it)
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" \
    >"$DEST/fused_adam_build.log" 2>&1 &
args=()
for s in "${STAGES[@]}"; do  # a stage name, or an option of gpu_evidence.py passed on (--force)
    if [[ $s == --* ]]; then args+=("$s"); else args+=(--stage "$s"); fi
done
python3 benchmarks/gpu_evidence.py "${args[@]}" --out "$DEST/gpu_evidence.json" --work /tmp/memfit-gpu-work \
    --deadline "$DEADLINE" 2>&1 | tee "$DEST/gpu_evidence.log"
rc=${PIPESTATUS[0]}
tar czf "$DEST/probe_logs.tgz" -C /tmp/memfit-gpu-work probe 2>/dev/null
exit "$rc"
