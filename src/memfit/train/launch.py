"""Start every rank of a run on this node and report how it ended.

One node: the ranks are started directly (memfit.train.local_ranks), each run on a free
rendezvous port of its own, so several runs (probes) can share a machine. Several nodes: one
torchrun per node, meeting through its c10d rendezvous. DeepSpeed on the CPU needs
`DS_ACCELERATOR=cpu`, set here when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.train.local_ranks import LocalRanks, free_port, ignore_sigusr1_preexec

# What a nested srun may inherit: the job's identity and where the config is. Anything else was
# set for the step this process runs in (a one-node step under the plugin: SLURM_JOB_NODELIST,
# SLURM_NNODES=1, ...) and makes srun refuse the job's other nodes ("Only allocated 1 nodes
# asked for 2", SLURM 22.05); the plugin's jobstep cleans its own srun's environment the same way.
SRUN_KEEP = frozenset({"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CONF", "SLURM_CLUSTER_NAME"})


def srun_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the SLURM_*/SRUN_*/SBATCH_* variables of the current step (SRUN_KEEP stays)."""
    return {k: v for k, v in env.items() if k in SRUN_KEEP or not k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}


def per_node_srun(nnodes: int, env: Mapping[str, str]) -> list[str] | None:
    """The `srun` prefix that starts one launcher on each of `nnodes` nodes, or None.

    None when no multi-node start is needed here: one node, no SLURM allocation (launch then
    asks for an explicit rendezvous), or this process already is one task of a step spread
    over the nodes (`srun --nodes N --ntasks-per-node 1 memfit launch ...`, as launch.sh does).
    Under snakemake-executor-plugin-slurm a rule runs as one task of a one-node step
    (`srun -n1 ...`, the jobstep plugin) on the job's first node: from there this prefix starts
    a step of its own over all nodes. `--overlap` lets it share the CPUs that first step holds
    (srun(1), SLURM >= 20.11); `--kill-on-bad-exit` ends every node when one fails. Run it
    with `srun_env`.
    """
    if nnodes <= 1 or not env.get("SLURM_JOB_ID"):
        return None
    if env.get("SLURM_STEP_NUM_NODES") == str(nnodes) and env.get("SLURM_STEP_NUM_TASKS") == str(nnodes):
        return None
    return [
        "srun",
        "--overlap",
        f"--nodes={nnodes}",
        f"--ntasks={nnodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        f"--jobid={env['SLURM_JOB_ID']}",
    ]


def nproc_default() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


# Every thread-count variable a math library reads; Snakemake sets all six to a rule's `threads`
# (snakemake/shell.py, `envvars`), and a rank that inherits MKL_NUM_THREADS=2 next to
# OMP_NUM_THREADS=1 runs torch's MKL GEMMs on 2 threads per rank: 4 threads on 2 cores, which
# stalled 3 of 10 training steps of the demo model from 0.12 s to 3.2-5.7 s (measured 2026-11-26,
# config/qlora.yaml's QLoRA ZeRO-0 mb16 run.json on 2 CPU ranks, with and without MKL_NUM_THREADS=2).
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def threads_per_rank(nproc: int) -> int:
    """The cores this process may use (its CPU affinity: a SLURM allocation's cgroup, not the whole
    node), shared evenly by the node's `nproc` ranks, at least one each. On a GPU node too: a
    rank's CPU work (data, DeepSpeedCPUAdam under optimizer offload, which runs OpenMP threads)
    gets its share instead of the rule's whole `threads` per rank (DeepSpeed's own launcher does
    the same with --bind_cores_to_rank, deepspeed/launcher/launch.py)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder can read it: the architecture-specific
    suffixes of CUDA 12+ ("9.0a", "10.0f") dropped. DeepSpeed 0.19.8 sorts the entries by
    `int(part)` of each dotted part (deepspeed/ops/op_builder/builder.py
    `compute_capability_args`), so "9.0a", which CUDA images for Hopper set, fails the first
    engine's FusedAdam build with "invalid literal for int() with base 10: '0a'" (seen on an H100
    image, benchmarks/results/gpu_evidence_h100-80gb.json). FusedAdam needs no sm_90a feature."""
    out = []
    for cc in value.replace(" ", ";").split(";"):
        cc = cc.strip()
        if not cc:
            continue
        base, ptx = cc.removesuffix("+PTX"), "+PTX" if cc.endswith("+PTX") else ""
        readable = ".".join(part.rstrip("af") for part in base.split(".")) + ptx
        if readable not in out:
            out.append(readable)
    return ";".join(out)


def launch_env(threads_per_rank: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if env.get("TORCH_CUDA_ARCH_LIST"):
        env["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(env["TORCH_CUDA_ARCH_LIST"])
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # DeepSpeed's JIT-compiled ops live with the environment that built them (`make ops`).
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    # ... and are built by this environment's ninja: another ninja version (Debian's 1.11 vs the
    # lock's 1.13) writes an incompatible .ninja_log, so each would recompile every op.
    env_bin = os.path.join(sys.prefix, "bin")
    if env.get("PATH", "").split(os.pathsep)[0] != env_bin:
        env["PATH"] = os.pathsep.join(p for p in (env_bin, env.get("PATH")) if p)
    if threads_per_rank:
        env.update(dict.fromkeys(THREAD_VARS, str(threads_per_rank)))
    return env


class LaunchError(RuntimeError):
    """A run cannot be started as configured (e.g. several nodes without a rendezvous)."""


# torchrun's c10d rendezvous port; any free port on the first node works, all nodes must agree.
RDZV_PORT = 29500


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one multi-node run meet (torchrun `--rdzv-backend=c10d`)."""

    nnodes: int
    node_rank: int
    host: str
    port: int = RDZV_PORT
    run_id: str = "memfit"


def start_rank_server(path: str, nproc: int, stdout=None) -> subprocess.Popen:
    """A rank start-up server (memfit.train.rank_server) listening at `path`, its imports made with the environment a rank of an `nproc`-rank
    run gets (`launch_env`), so what the libraries read at import is what a rank reads. It serves
    until SIGTERM, or until the process that started it is gone (a workflow killed with SIGKILL
    leaves no server behind)."""
    cmd = [sys.executable, "-m", "memfit.train.rank_server", path, str(os.getpid())]
    return subprocess.Popen(
        cmd, env=launch_env(threads_per_rank(nproc)), stdout=stdout, stderr=subprocess.STDOUT if stdout else None
    )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist such as `gpu[01-03,7],login1` into host names, in order.

    Same result as `scontrol show hostnames` for the forms SLURM writes into
    SLURM_JOB_NODELIST (prefix + bracketed comma list of numbers/ranges, zero padding kept;
    see slurm/src/common/hostlist.c). Nested or multi-dimensional brackets are refused.
    """
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)", part)
        if m is None:
            if "[" in part or "]" in part:
                raise LaunchError(f"cannot parse SLURM nodelist {nodelist!r} at {part!r}")
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise LaunchError(f"cannot parse SLURM nodelist {nodelist!r}: bad range {r!r}")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{width}d}{suffix}")
    if not hosts:
        raise LaunchError(f"SLURM nodelist {nodelist!r} names no host")
    return hosts


def rendezvous_from_env(env: Mapping[str, str], nnodes: int) -> Rendezvous | None:
    """The rendezvous of a multi-node run started by `srun` (one launcher per node).

    Returns None for a single-node run. For nnodes > 1 it needs SLURM_JOB_NODELIST and
    SLURM_NODEID (set by srun on every node) or MEMFIT_RDZV_HOST + MEMFIT_NODE_RANK
    (any other scheduler); otherwise it raises instead of silently running on one node.
    """
    if nnodes < 1:
        raise LaunchError(f"num_nodes must be >= 1, got {nnodes}")
    if nnodes == 1:
        return None
    run_id = env.get("SLURM_JOB_ID", "memfit")
    if env.get("MEMFIT_RDZV_HOST") and env.get("MEMFIT_NODE_RANK") is not None:
        host, rank = env["MEMFIT_RDZV_HOST"], int(env["MEMFIT_NODE_RANK"])
    elif env.get("SLURM_JOB_NODELIST") and env.get("SLURM_NODEID") is not None:
        hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
        if len(hosts) < nnodes:
            raise LaunchError(
                f"num_nodes={nnodes} but SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r} has {len(hosts)} host(s)"
            )
        host, rank = hosts[0], int(env["SLURM_NODEID"])
    else:
        raise LaunchError(
            f"num_nodes={nnodes} needs a rendezvous: run one launcher per node under `srun` "
            "(SLURM_JOB_NODELIST, SLURM_NODEID) or set MEMFIT_RDZV_HOST and MEMFIT_NODE_RANK"
        )
    if not 0 <= rank < nnodes:
        raise LaunchError(f"node rank {rank} out of range for num_nodes={nnodes}")
    port = int(env.get("MEMFIT_RDZV_PORT", RDZV_PORT))
    return Rendezvous(nnodes=nnodes, node_rank=rank, host=host, port=port, run_id=run_id)


def rank_argv(config: Path, rank_command: str = "train") -> list[str]:
    """One rank's command line: `memfit train --config run.json` or `memfit calibrate --spec spec.json`."""
    flag = "--config" if rank_command == "train" else "--spec"
    return [sys.executable, "-m", "memfit.cli", rank_command, flag, str(config)]


def command(config: Path, nproc: int, rdzv: Rendezvous | None = None, rank_command: str = "train") -> list[str]:
    """What this node starts: on one node the rank's own command line, started `nproc` times
    (local_ranks.LocalRanks); across nodes torchrun with a c10d rendezvous, which starts `nproc`.
    Each rank runs `memfit <rank_command>`: train (`--config run.json`) or calibrate (`--spec spec.json`)."""
    ranks = rank_argv(config, rank_command)
    if rdzv is None:
        return ranks
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={rdzv.nnodes}",
        f"--node-rank={rdzv.node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv.host}:{rdzv.port}",
        f"--rdzv-id={rdzv.run_id}",
        f"--nproc-per-node={nproc}",
        *ranks[1:],
    ]


def launch(
    config: Path,
    nproc: int,
    log: Path | None = None,
    timeout_s: float | None = None,
    nnodes: int = 1,
    rank_command: str = "train",
    resolve: bool = False,
) -> int:
    """Run all ranks; stdout/stderr go to `log` (appended) or to the console. Returns the exit code.
    `rank_command` train (`config` is a run.json) or calibrate (`config` is a calibration spec,
    memfit.train.calibrate; one node). `resolve`: the ranks read a copy of the run config with the
    digests of its inputs (memfit.train.identity). On the console (no `log`, one node) a refusal
    every rank raises is printed once, exit code REFUSED_EXIT_CODE (memfit.train.rank_output).

    Inside a SLURM job of `nnodes` > 1 nodes started as one task (a Snakemake rule under the
    executor plugin, or a batch script), this starts one launcher per node with `srun`
    (per_node_srun) and waits for them.

    SIGUSR1 (SLURM's `--signal=USR1@secs` before the wall-time kill, or `scancel --signal=USR1`)
    and SIGTERM sent to this process are forwarded: SIGUSR1 to the ranks themselves (they
    checkpoint at the end of the current step and exit), SIGTERM to the ranks (on one node) or to
    torchrun (several nodes), which passes it on; ranks still running 30 s later are SIGKILLed.
    Ranks and torchrun ignore SIGUSR1 until a rank sets its handler: SLURM signals every process
    of a step, and the default action would kill them (and with torchrun every rank:
    rank._die_with_parent).
    """

    if resolve and rank_command == "train":
        from memfit.train.identity import resolve_launch_config

        config = resolve_launch_config(Path(config))
    srun = per_node_srun(nnodes, os.environ) if rank_command == "train" else None
    rdzv = None
    if srun is not None:
        cmd = [*srun, sys.executable, "-m", "memfit.cli", "launch", "--config", str(config)]
        cmd += ["--nproc", str(nproc), "--nnodes", str(nnodes)]
    else:
        rdzv = rendezvous_from_env(os.environ, nnodes)
        cmd = command(config, nproc, rdzv, rank_command)
        if rdzv is not None and log is None:  # one of several nodes: say where it meets the others
            host = os.environ.get("SLURMD_NODENAME", "")
            print(f"[node {rdzv.node_rank} {host}] $ " + " ".join(cmd), file=sys.stderr, flush=True)
    port = free_port() if srun is None and rdzv is None else None  # one node: memfit starts the ranks
    threads = threads_per_rank(nproc)
    out = None
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "a")  # noqa: SIM115 - closed below
        ranks = f"[{nproc} rank(s), MASTER_PORT={port}] " if port is not None else ""
        out.write("$ " + ranks + " ".join(cmd) + "\n")
        out.flush()
    console = None
    if port is not None and out is None and rank_command == "train":
        from memfit.train.rank_output import RankOutput

        console = RankOutput(sys.stdout, sys.stderr)
    proc = _start(cmd, nproc, launch_env(threads), port, out, console, srun is not None)
    forwarded = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            forwarded[sig] = signal.signal(sig, lambda signum, _frame: _forward(proc, signum, to_ranks=srun is None))
    try:
        rc = proc.wait(timeout=timeout_s)
        if console is not None:
            console.join()
        return _exit_code(rc, config, console)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        if out is not None:
            out.close()


def _exit_code(rc: int, config: Path, console) -> int:
    from memfit.train.run_config import PREEMPTED_EXIT_CODE, REFUSED_EXIT_CODE

    if rc != 0 and _preempted(config):
        return PREEMPTED_EXIT_CODE  # stopped by the signal (torchrun exits 1); the ranks saved
    if rc != 0 and console is not None and console.refused:
        return REFUSED_EXIT_CODE  # every rank refused the run: bad input
    return rc


def _start(cmd: list[str], nproc: int, env: dict[str, str], port: int | None, out, console, srun: bool):
    """The ranks (one node: LocalRanks, their output through `console` when given) or the one
    process that starts them (torchrun; srun, whose per-node launchers take the resolved config).
    On each node (a per-node launcher comes here again), before any rank loads a JIT-built op, a
    build lock a killed build left is removed (startup.clear_stale_build_locks)."""
    if not srun:
        from memfit.train.startup import clear_stale_build_locks

        clear_stale_build_locks(env["TORCH_EXTENSIONS_DIR"])
    if port is not None:
        stdout = subprocess.PIPE if console is not None else out
        ranks = LocalRanks(cmd, nproc, env, port, stdout=stdout, ignore_sigusr1=True)
        for p in ranks.procs if console is not None else ():
            console.attach(p.stdout)
        return ranks
    from memfit.train.identity import RESOLVED_ENV

    return subprocess.Popen(
        cmd,
        env=srun_env(env) | {RESOLVED_ENV: "1"} if srun else env,
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        preexec_fn=None if srun else ignore_sigusr1_preexec,
    )


def _forward(proc: subprocess.Popen | LocalRanks, signum: int, to_ranks: bool) -> None:
    """Pass a stop signal on: to every rank of this node's LocalRanks; SIGUSR1 to torchrun's
    children (the ranks), everything else (and anything to srun, which forwards it to every
    node's launcher) to the child itself."""
    if isinstance(proc, LocalRanks):
        proc.send_signal(signum)
        return
    if to_ranks and signum == signal.SIGUSR1:
        for pid in _children(proc.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return
    proc.send_signal(signum)


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (Linux /proc; torchrun starts the ranks as its children)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # after "pid (comm)": state, ppid (proc(5))
            out.append(int(stat.parent.name))
    return out


def _preempted(config: Path) -> bool:
    import json

    from memfit.train.run_config import PREEMPTED_MARKER

    out_dir = json.loads(Path(config).read_text()).get("out_dir")
    return bool(out_dir) and (Path(out_dir) / PREEMPTED_MARKER).exists()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memfit launch", description="Start all ranks of a run on this node.")
    ap.add_argument("--config", required=True, type=Path, help="run config JSON")
    ap.add_argument("--nproc", type=int, default=nproc_default(), help="ranks per node (GPUs; 2 on the CPU)")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes; >1 needs srun (SLURM) or MEMFIT_RDZV_HOST")
    args = ap.parse_args(argv)
    if args.nproc < 1:
        ap.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.nnodes < 1:
        ap.error(f"--nnodes must be >= 1, got {args.nnodes}")
    from memfit.train.identity import resolve_launch_config
    from memfit.train.run_config import REFUSED_EXIT_CODE

    try:  # before any rank starts: the run config, the model and data directories, their digests
        config = resolve_launch_config(args.config)
    except (ValueError, TypeError) as e:
        print(f"memfit launch: error: {e}", file=sys.stderr)
        return REFUSED_EXIT_CODE
    return launch(config, args.nproc, nnodes=args.nnodes)
