#!/usr/bin/env bash
# The one command that proves memfit on a GPU: on a bare machine with PyTorch (CUDA) preinstalled
# and no network, install the carried wheels, run the whole workflow of config/gpu-demo.yaml
# (calibrate, traced estimate, probes, select, SFT then DPO with checkpoints, verify_resume,
# report), then the stages of benchmarks/gpu_evidence.py in the time left, and leave in DEST:
#   gpu_check.json      each job's status and seconds, the selected configurations, predicted vs
#                       measured peaks and step times, the resume verdicts, the report's path, ok
#   gpu_check.log       everything this script printed (the workflow's own output included)
#   gpu_evidence.json   the evidence (started from the committed benchmarks/results/ file of this
#                       GPU, so stages already measured are not run again), gpu_evidence.log,
#                       probe_logs.tgz
#   logs.tgz            the workflow's logs/, .snakemake/log/ and the run JSONs; report.html
#
#   benchmarks/fetch_gpu_wheels.sh                          # here, once: wheelhouse/ (about 50 MiB)
#   benchmarks/gpu_check.sh wheelhouse DEST [BUDGET_S] [STAGE|--force ...]   # there
#
# BUDGET_S (default 590) is the wall time it may take in all: the workflow is stopped at
# BUDGET_S - 30 s (the summary and packing take a few seconds) and no evidence probe starts that
# would end after BUDGET_S - 80 s (a probe may overrun by a minute). On one H200 the install took
# 28 s and config/gpu-demo.yaml's workflow about 540 s (2026-11-28: benchmarks/results/gpu_check_h200/),
# so give it the 10-minute call's 590 s; the evidence stages then need a second call on the warm
# machine. A call that finds this script's run folder from an earlier call on the same machine
# goes on with it (Snakemake's --rerun-incomplete: what finished stays finished). STAGEs default
# to every stage of gpu_evidence.py not yet in the committed evidence, in its order; `--force` measures them again. Exit status: the workflow's summary
# (0: ok), or with MEMFIT_GPU_CHECK_CONFIG=- gpu_evidence.py's. WHEEL_DIR "-"
# installs nothing (a machine that has memfit's dependencies); MEMFIT_GPU_CHECK_CONFIG=- runs the
# evidence stages alone (as benchmarks/gpu_evidence_device.sh, which measured the committed
# benchmarks/results/gpu_evidence_*.json, did); it and
# MEMFIT_GPU_CHECK_ARGS (default: none; split at whitespace) name another workflow config and
# extra snakemake arguments, which is how it was tried on the CPU: MEMFIT_GPU_CHECK_CONFIG=config/config.yaml
# benchmarks/gpu_check.sh - /tmp/check 1500 (docs/gpus.md#one-command-on-a-lent-gpu). The workflow
# runs in MEMFIT_GPU_CHECK_RUN (default /tmp/memfit-gpu-check: a checkout of links, so this
# clone's own results/ are left alone).
set -uo pipefail
WHEELS=${1:?usage: $0 WHEEL_DIR|- DEST_DIR [BUDGET_S] [STAGE|--force ...]}
DEST=${2:?destination folder}
BUDGET=${3:-590}
shift $(($# < 3 ? $# : 3))
mkdir -p "$DEST" || exit 1
DEST=$(cd "$DEST" && pwd)  # both named from the caller's directory
[ "$WHEELS" = "-" ] || WHEELS=$(cd "$WHEELS" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
CONFIG=${MEMFIT_GPU_CHECK_CONFIG:-config/gpu-demo.yaml}
read -r -a EXTRA <<<"${MEMFIT_GPU_CHECK_ARGS:-}"  # split at whitespace
evidence=()  # gpu_evidence.py's arguments: each STAGE as --stage, options (--force) as they are
for s in "$@"; do
    if [[ $s == --* ]]; then evidence+=("$s"); else evidence+=(--stage "$s"); fi
done
SECONDS=0
exec > >(tee "$DEST/gpu_check.log") 2>&1
tee_pid=$!
say() { printf '\n=== %s (%ds)\n' "$1" "$SECONDS"; }
finish() {  # the verdict, then wait until tee has written every line of it to gpu_check.log
    say "done"
    exec >&- 2>&-
    wait "$tee_pid" 2>/dev/null
    exit "$1"
}

say "install"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/memfit-torch-extensions}
PY=python3
if [ "$WHEELS" != "-" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/memfit-site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/memfit-site:$PWD/src PATH=/tmp/memfit-site/bin:$PATH
else
    [ -x .venv/bin/python ] && PY=$PWD/.venv/bin/python
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY - <<'EOF' || { echo "a dependency is missing: see benchmarks/gpu_wheels.py"; exit 1; }
import sys, torch, deepspeed, transformers, peft, snakemake
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "deepspeed", deepspeed.__version__,
      "transformers", transformers.__version__, "peft", peft.__version__, "snakemake", snakemake.__version__)
EOF
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$CUDA" = 1 ]; then
    # as the ranks will see it (memfit.train.launch.launch_env: Hopper images' "9.0a" is unreadable to DeepSpeed)
    [ -n "${TORCH_CUDA_ARCH_LIST:-}" ] && export TORCH_CUDA_ARCH_LIST=$($PY -c \
        "import os; from memfit.train.launch import deepspeed_arch_list as f; print(f(os.environ['TORCH_CUDA_ARCH_LIST']))")
    # the first engine JIT-builds FusedAdam (nvcc, about a minute): start it now, beside the model
    # build and data preparation (torch's extension builder locks its folder: an engine waits)
    $PY -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" \
        >"$DEST/fused_adam_build.log" 2>&1 &
fi

REPO=$PWD
RUN=${MEMFIT_GPU_CHECK_RUN:-/tmp/memfit-gpu-check}
wf_rc=0
wf_s=0
ok_rc=0
if [ "$CONFIG" != "-" ]; then
    say "workflow: $CONFIG ${EXTRA[*]}"
    # in a checkout of links, as CI runs its second workflow: this clone's results/ stay as they are
    mkdir -p "$RUN" || exit 1
    for f in Snakefile workflow config data src envs scripts; do ln -sfn "$REPO/$f" "$RUN/$f"; done
    cd "$RUN" || exit 1
    # an earlier call stopped at its limit leaves Snakemake's lock only if it was killed
    [ -n "$(ls -A .snakemake/locks 2>/dev/null)" ] && $PY -m snakemake --unlock --configfile "$CONFIG" >/dev/null 2>&1
    limit=$((BUDGET - 30 - SECONDS))
    [ "$limit" -ge 60 ] || limit=60  # timeout 0 would mean no limit
    timeout --signal=INT --kill-after=20 "$limit" \
        $PY -m snakemake --cores all --rerun-incomplete --configfile "$CONFIG" "${EXTRA[@]}"
    wf_rc=$?
    wf_s=$SECONDS
    log=$(ls -t .snakemake/log/*.snakemake.log 2>/dev/null | head -1)
    # the config's `run:` puts its outputs under results/<run>/ (config/gpu-demo.yaml: results/gpu-demo)
    RES=$($PY -c "from memfit.workflow.config import WorkflowConfig as W, load_yaml as y; import sys; print(W(y(sys.argv[1])).results_dir)" "$CONFIG" 2>/dev/null || echo results)
    $PY -m memfit.report.run_summary --results "$RES" ${log:+--log "$log"} --out "$DEST/gpu_check.json"
    ok_rc=$?
    cd "$REPO" || exit 1
fi

# gpu_evidence.py lets a probe run a minute past its deadline: the deadline leaves that minute
left=$((BUDGET - 80 - SECONDS))
ev_rc=0
if [ "$CUDA" = 1 ] && [ "$left" -gt 30 ]; then
    gpu=$($PY -c "from memfit.estimate.models.detect import detect_gpu; print(detect_gpu())")
    [ -f "benchmarks/results/gpu_evidence_$gpu.json" ] && cp "benchmarks/results/gpu_evidence_$gpu.json" "$DEST/gpu_evidence.json"
    say "evidence: ${evidence[*]:-every stage not yet measured} within ${left}s"
    $PY benchmarks/gpu_evidence.py "${evidence[@]}" --gpu "$gpu" --out "$DEST/gpu_evidence.json" \
        --work /tmp/memfit-gpu-work --deadline "$left" 2>&1 | tee "$DEST/gpu_evidence.log"
    ev_rc=${PIPESTATUS[0]}
    tar czf "$DEST/probe_logs.tgz" -C /tmp/memfit-gpu-work probe 2>/dev/null
else
    say "evidence: skipped (CUDA $CUDA, ${left}s left)"
fi

say "pack"
if [ "$CONFIG" != "-" ]; then
    (cd "$RUN" && tar czf "$DEST/logs.tgz" logs .snakemake/log \
        $(find results -name '*.json' -not -path '*/exports/*' 2>/dev/null) 2>/dev/null)
    [ -f "$RUN/${RES:-results}/report.html" ] && cp "$RUN/${RES:-results}/report.html" "$DEST/report.html"
    $PY - "$DEST/gpu_check.json" "$wf_rc" "$wf_s" "$SECONDS" "$CONFIG" <<'EOF'
import json, sys
path, rc, wf_s, total_s, config = sys.argv[1:]
doc = json.load(open(path))
doc.update(config=config, workflow_exit_code=int(rc), workflow_s=int(wf_s), total_s=int(total_s))
json.dump(doc, open(path, "w"), indent=1, default=str)
print(f"workflow exit {rc} in {wf_s} s; ok={doc['ok']}; not finished: {doc['not_finished'] or 'none'}")
for r in doc["runs"]:
    sel, res = r.get("selected") or {}, r.get("resume") or {}
    print(f"{r['model']}/{r['gpu']}/{r['method']}: selected {sel.get('id')} ({sel.get('source')}), "
          f"resume {res.get('expected')}: passed={res.get('passed')} bitwise={res.get('weights_bitwise_equal')}")
EOF
    finish "$ok_rc"
fi
finish "$ev_rc"
