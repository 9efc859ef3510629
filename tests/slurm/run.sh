#!/usr/bin/env bash
# memfit under a real SLURM on this machine (issue #9). Not part of CI (it installs packages,
# starts daemons as root and takes several minutes); run it by hand from the repo root:
#   bash tests/slurm/run.sh [WORKDIR]      # default /tmp/memfit-slurm-run
# What it does, each step checked (exit 1 with the reason otherwise):
#   0. apt-get install slurm-wlm munge (Debian bookworm: SLURM 22.05) if missing; start munged,
#      slurmctld and two slurmd (memfit-n1, memfit-n2) on localhost (tests/slurm/cluster.sh).
#   1. A small config of the embedded default (SFT only, one candidate, 40 steps) through
#      `snakemake --profile slurm` plus a workflow profile that overrides the site parts (local
#      partition, no conda, squeue status): every non-local job submitted with sbatch, the DAG
#      completes. While `train` runs, `scancel --signal=USR1 <train job>` after its first
#      checkpoint: the ranks checkpoint and exit, Snakemake resubmits the job (restart-times)
#      and it resumes from that checkpoint.
#   2. The same config run locally (`snakemake --cores 2`): `memfit compare-results --rtol 1e-5`
#      finds the same selection, the same losses step by step, the same trained weights and the
#      same resume verdict. Measured step times (the calibration's, the probes') differ between
#      the two runs and are reported as "timing:" lines, not compared (issue #41). The search space
#      is one candidate, so the selection cannot turn on those timings and the training is compared.
#   3. The config on 2 nodes x 1 rank through SLURM (up to train, 10 steps): the probe and train
#      are jobs of 2 nodes; the train log shows both launchers meeting at the first node.
# MEMFIT_SLURM_STAGES="1 3" runs some stages only; MEMFIT_SLURM_REUSE=1 uses a cluster that
# an earlier run.sh (still running) started instead of starting one.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(realpath -m "${1:-/tmp/memfit-slurm-run}")
CLUSTER=$WORK/cluster
PY=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PY ]] || PY=$(command -v python)
SNAKEMAKE=("$PY" -m snakemake)
export PATH=$(dirname "$PY"):$PATH
export MEMFIT_RDZV_PORT=${MEMFIT_RDZV_PORT:-29731}
say() { printf '\n== %s  %s\n' "$(date -u +%H:%M:%S)" "$*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  say "installing slurm-wlm and munge"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
# SLURM_JOB_NODELIST names nodes by NodeName: the rendezvous host must resolve
for n in memfit-n1 memfit-n2; do
  getent hosts "$n" >/dev/null || echo "127.0.0.1 $n" >>/etc/hosts
done

STAGES=" ${MEMFIT_SLURM_STAGES:-1 2 3} "
mkdir -p "$WORK"
if [[ ${MEMFIT_SLURM_REUSE:-0} == 1 ]]; then
  export SLURM_CONF=/etc/slurm/slurm.conf
  sinfo -N || fail "MEMFIT_SLURM_REUSE=1 but no cluster answers"
else
  trap 'bash "$ROOT/tests/slurm/cluster.sh" stop "$CLUSTER"' EXIT
  say "starting slurmctld + 2 slurmd"
  bash "$ROOT/tests/slurm/cluster.sh" start "$CLUSTER"
  export SLURM_CONF=$CLUSTER/slurm.conf
fi
sbatch --version

# -- a workdir with a small config of the embedded default ----------------------------------
setup() {  # setup DIR NUM_NODES NUM_GPUS MAX_STEPS SAVE_EVERY
  local dir=$1
  rm -rf "$dir"
  mkdir -p "$dir/profile"
  ln -s "$ROOT/data" "$dir/data"
  ln -s "$ROOT/config" "$dir/config"
  "$PY" - "$ROOT/config/config.yaml" "$dir/config.yaml" "$2" "$3" "$4" "$5" <<'PY'
import sys, yaml
src, dst = sys.argv[1], sys.argv[2]
nodes, ranks, steps, every = (int(a) for a in sys.argv[3:7])
cfg = yaml.safe_load(open(src))
cfg.update(methods=["sft"], num_nodes=nodes, num_gpus=ranks)
cfg["estimate"] = {"activations": "analytic"}
cfg["search"].update(zero=[0], grad_ckpt=[False], micro_batch=[8], loss_impl=["full"])
cfg["probe"].update(top_k=1, steps=2)
cfg["train"].update(save_every=every, keep_last=3, eval_every=20, log_every=5)
cfg["train"]["sft"]["max_steps"] = steps
cfg["slurm"] = {"partition": "local", "runtime_min": {"train": 30, "verify_resume": 30}}
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
PY
  # the override of the site profile (slurm/config.yaml): this cluster's partition, no conda
  cat >"$dir/profile/config.yaml" <<'YAML'
use-conda: false
jobs: 4
latency-wait: 5
restart-times: 2
default-resources:
  slurm_partition: local
  runtime: 30
  mem_mb: 2000
slurm-status-command: squeue
slurm-init-seconds-before-status-checks: 5
slurm-keep-successful-logs: true
YAML
}

run_slurm() {  # run_slurm DIR [TARGET...]
  local dir=$1
  shift
  (cd "$dir" && "${SNAKEMAKE[@]}" -s "$ROOT/Snakefile" --configfile config.yaml \
    --profile "$ROOT/slurm" --workflow-profile profile "$@" >snakemake.log 2>&1) ||
    { tail -40 "$dir/snakemake.log"; fail "snakemake --profile slurm in $dir"; }
}

jobs_of() {  # the SLURM jobs of this session: id, comment (rule_<name>...), state, nodes
  squeue --states=all -h -o '%i|%k|%T|%D' | sort -n
}

# -- 1. the DAG through SLURM, with a preempted train job ------------------------------------
A=$WORK/one-node
if [[ $STAGES == *" 1 "* ]]; then
setup "$A" 1 2 40 10
say "1. snakemake --profile slurm (1 node x 2 ranks); USR1 to train after its first checkpoint"
t0=$(date +%s)
run_slurm "$A" &
SNAKE=$!
ck=$A/results/demo-tiny/cpu/sft/train/checkpoints
signalled=""
while kill -0 $SNAKE 2>/dev/null; do
  if [[ -z $signalled ]] && compgen -G "$ck/*/COMPLETE" >/dev/null; then
    id=$(squeue -h -t RUNNING -o '%i|%k' | awk -F'|' '$2 ~ /^rule_train/ {print $1}' | head -1)
    if [[ -n $id ]]; then
      say "scancel --signal=USR1 $id (train; checkpoints: $(ls "$ck" | tr '\n' ' '))"
      scancel --signal=USR1 "$id"
      signalled=$id
    fi
  fi
  # the resubmitted job rewrites the rule's log: keep the first attempt's
  log=$A/logs/demo-tiny/cpu/sft/train.log
  if [[ -n $signalled && ! -s $A/train.attempt1.log ]] && grep -qs "signal received" "$log"; then
    sleep 2
    cp "$log" "$A/train.attempt1.log"
  fi
  sleep 1
done
wait $SNAKE
t1=$(date +%s)
say "1. done in $((t1 - t0)) s"
jobs_of | tee "$A/jobs.txt"
[[ -n $signalled ]] || fail "train finished before it could be signalled"
ntrain=$(grep -c '|rule_train' "$A/jobs.txt")
[[ $ntrain -ge 2 ]] || fail "train was not resubmitted ($ntrain job)"
log=$A/logs/demo-tiny/cpu/sft/train.log
grep -q "signal received: checkpointed step" "$A/train.attempt1.log" ||
  fail "no checkpoint on USR1 in the first attempt's $log"
grep -q "resumed from" "$log" || fail "the resubmitted train did not resume ($log)"
grep -h "signal received\|exit code" "$A/train.attempt1.log"
grep -h "resumed from" "$log"
[[ -f $A/results/report.html ]] || fail "no report"
submitted=$(grep -c "has been submitted with SLURM jobid" "$A/snakemake.log")
echo "sbatch submissions: $submitted (local rules: select_config, report, all)"
fi

# -- 2. the same config locally: same decisions and losses -----------------------------------
B=$WORK/local
if [[ $STAGES == *" 2 "* ]]; then
setup "$B" 1 2 40 10
say "2. the same config locally (snakemake --cores 2)"
t0=$(date +%s)
(cd "$B" && "${SNAKEMAKE[@]}" -s "$ROOT/Snakefile" --configfile config.yaml --cores 2 \
  >snakemake.log 2>&1) || { tail -40 "$B/snakemake.log"; fail "local run"; }
say "2. done in $(($(date +%s) - t0)) s"
# Not bit for bit: on a loaded machine even a local run's own verify_resume differs from its
# run in the 7th digit (losses_bitwise_equal false); stage 1 vs 2 measured 2.0e-6 at most.
"$PY" -m memfit.cli compare-results "$B/results" "$A/results" --rtol 1e-5 ||
  fail "SLURM and local results differ"
fi

# -- 3. two nodes ----------------------------------------------------------------------------
C=$WORK/two-nodes
if [[ $STAGES == *" 3 "* ]]; then
setup "$C" 2 1 10 5
say "3. snakemake --profile slurm (2 nodes x 1 rank), up to train"
t0=$(date +%s)
run_slurm "$C" results/demo-tiny/cpu/sft/train/summary.json
say "3. done in $(($(date +%s) - t0)) s"
jobs_of | awk -F'|' '$4 == 2' | tee "$C/two-node-jobs.txt"
grep -q '|rule_train' "$C/two-node-jobs.txt" || fail "train was not a 2-node job"
log=$C/logs/demo-tiny/cpu/sft/train.log
grep -m2 -- "--rdzv-endpoint=memfit-n1:$MEMFIT_RDZV_PORT" "$log" ||
  fail "no 2-node rendezvous in $log"
grep -m1 "^\$ srun --overlap --nodes=2" "$log" || fail "no per-node srun in $log"
fi
say "all checks passed (SLURM $(sbatch --version | awk '{print $2}'))"
