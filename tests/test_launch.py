"""memfit.train.launch: the torchrun command and environment, exit codes, logs, timeouts and signals.

The rank processes here are small Python programs standing in for `memfit train` (the real
multi-rank runs are in test_train.py, marked slow); what is tested is launch's own behaviour.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from memfit.train import launch as launch_mod
from memfit.train import local_ranks
from memfit.train.launch import Rendezvous, command, launch, launch_env
from memfit.train.local_ranks import LocalRanks, free_port
from memfit.train.run_config import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER


def test_one_node_starts_the_ranks_itself_several_meet_under_torchrun(tmp_path):
    rank = [sys.executable, "-m", "memfit.cli", "train", "--config", str(tmp_path / "run.json")]
    assert command(tmp_path / "run.json", 3) == rank  # started 3 times (LocalRanks)
    rdzv = Rendezvous(nnodes=2, node_rank=1, host="gpu01", port=29500, run_id="42")
    assert command(tmp_path / "run.json", 3, rdzv) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu01:29500",
        "--rdzv-id=42",
        "--nproc-per-node=3",
        *rank[1:],
    ]
    # the calibration's ranks (memfit.train.calibrate) start the same way, from their spec
    assert command(tmp_path / "spec.json", 2, rank_command="calibrate")[-4:] == [
        "memfit.cli",
        "calibrate",
        "--spec",
        str(tmp_path / "spec.json"),
    ]


def test_each_rank_gets_torchruns_environment_and_a_rendezvous_port_of_its_run(tmp_path):
    """What torch.distributed's env:// rendezvous and memfit's resume read, per rank."""
    dump = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1] + os.environ['RANK'], 'w'))"
    port = free_port()
    ranks = LocalRanks([sys.executable, "-c", dump, str(tmp_path / "env")], 3, dict(os.environ), port)
    assert ranks.wait(timeout=30) == 0
    envs = [json.loads((tmp_path / f"env{r}").read_text()) for r in range(3)]
    for r, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(r),
            str(r),
            "3",
            "3",
        )
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port))


def test_a_failing_rank_stops_the_others_and_its_exit_code_is_the_runs(tmp_path, monkeypatch):
    """Rank 1 runs out of memory (exit 3) while rank 0 would wait for it in a collective forever:
    rank 0 gets SIGTERM (and SIGKILL if it ignores that) and the run's code is rank 1's."""
    monkeypatch.setattr(local_ranks, "STOP_GRACE_S", 1.0)
    code = (
        "import os, signal, sys, time\n"
        "if os.environ['RANK'] == '1': time.sleep(0.5); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # a rank stuck in a collective
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    ranks = LocalRanks([sys.executable, "-c", code], 2, dict(os.environ), free_port())
    assert ranks.wait(timeout=30) == 3
    assert time.monotonic() - start < 20
    assert all(p.poll() is not None for p in ranks.procs)


def test_env_selects_the_cpu_accelerator_without_cuda_and_keeps_what_the_user_set(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the accelerator is DeepSpeed's default")
    for var in ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's choice wins over the default
    env = launch_env(threads_per_rank=3)
    assert env["DS_ACCELERATOR"] == "cpu"
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["HF_HUB_OFFLINE"] == "0"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert launch_env()["DS_ACCELERATOR"] == "cuda"
    assert "OMP_NUM_THREADS" not in launch_env()


def test_every_math_library_gets_the_ranks_thread_count_not_the_rules(monkeypatch):
    """Snakemake exports a rule's `threads` (2 for 2 CPU ranks) to six thread variables; a rank
    left with MKL_NUM_THREADS=2 beside OMP_NUM_THREADS=1 oversubscribes the cores (steps of 0.12 s
    stalled to as much as 5.7 s). Each rank gets its share in all six."""
    from memfit.train.launch import THREAD_VARS

    assert {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"} <= set(THREAD_VARS)
    for var in THREAD_VARS:
        monkeypatch.setenv(var, "2")  # what Snakemake's shell() sets for a rule with threads: 2
    env = launch_env(threads_per_rank=1)
    assert {var: env[var] for var in THREAD_VARS} == dict.fromkeys(THREAD_VARS, "1")


def test_ranks_build_deepspeed_ops_with_this_environments_ninja(monkeypatch):
    """Debian's ninja 1.11 and the lock's 1.13 invalidate each other's .ninja_log: ranks that found
    the system one first on PATH would recompile every DeepSpeed op the venv's ninja built."""
    env_bin = os.path.join(sys.prefix, "bin")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert launch_env()["PATH"].split(os.pathsep) == [env_bin, "/usr/bin", "/bin"]
    monkeypatch.setenv("PATH", os.pathsep.join([env_bin, "/usr/bin"]))
    assert launch_env()["PATH"] == os.pathsep.join([env_bin, "/usr/bin"])  # not added twice


def fake_ranks(monkeypatch, code: str) -> None:
    """Launch starts `python -c code` as each rank (the config path is in sys.argv[1])."""
    monkeypatch.setattr(
        launch_mod,
        "command",
        lambda config, nproc, rdzv=None, rank_command="train": [sys.executable, "-c", code, str(config)],
    )


def run_json(tmp_path: Path) -> Path:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"out_dir": str(tmp_path / "out")}))
    return path


def test_exit_code_and_output_go_to_the_appended_log(tmp_path, monkeypatch):
    fake_ranks(monkeypatch, "import sys; print('rank says hi'); sys.exit(5)")
    log = tmp_path / "logs" / "train.log"
    log.parent.mkdir()
    log.write_text("earlier attempt\n")
    assert launch(run_json(tmp_path), 2, log=log) == 5
    text = log.read_text()
    assert text.startswith("earlier attempt\n$ ")  # appended, with the command line first
    assert "rank says hi" in text


def test_a_run_that_outlives_its_timeout_is_killed_and_raises(tmp_path, monkeypatch):
    import subprocess

    fake_ranks(monkeypatch, "import time; time.sleep(60)")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        launch(run_json(tmp_path), 1, log=tmp_path / "log", timeout_s=1)
    assert time.monotonic() - start < 30


def test_preempted_ranks_report_the_preempted_exit_code(tmp_path, monkeypatch):
    # stopped ranks exit 1 (torchrun too, across nodes); the marker rank 0 wrote says the ranks saved
    code = (
        "import json, sys, pathlib; out = pathlib.Path(json.load(open(sys.argv[1]))['out_dir']);"
        f"out.mkdir(); (out / {PREEMPTED_MARKER!r}).write_text('{{}}'); sys.exit(1)"
    )
    fake_ranks(monkeypatch, code)
    assert launch(run_json(tmp_path), 2, log=tmp_path / "log") == PREEMPTED_EXIT_CODE
    other = tmp_path / "other"  # no marker: a plain failure stays a failure
    other.mkdir()
    fake_ranks(monkeypatch, "import sys; sys.exit(1)")
    assert launch(run_json(other), 2, log=other / "log") == 1


def test_sigterm_to_the_launcher_reaches_the_ranks(tmp_path, monkeypatch):
    """SLURM's warning before the wall-time kill goes to the job step; the ranks must get it."""
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    fake_ranks(monkeypatch, code)

    def send_when_ready():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # SIGTERM goes to every rank of this node (across nodes to torchrun, which passes it
        # on; SIGUSR1 to torchrun's children, the ranks: tests/test_slurm_launch.py)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=send_when_ready)
    sender.start()
    rc = launch(run_json(tmp_path), 1, log=tmp_path / "log", timeout_s=30)
    sender.join()
    assert rc == 42
    # the launcher's handlers are removed afterwards
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before


def test_ranks_share_the_cores_this_job_may_use(monkeypatch):
    """A SLURM job of 8 cores on a 64-core node: its 2 ranks get 4 threads each, 16 ranks 1 each."""
    from memfit.train.launch import threads_per_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert (threads_per_rank(2), threads_per_rank(8), threads_per_rank(16)) == (4, 1, 1)


@pytest.mark.parametrize(
    "arch, readable", [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("7.5 8.6 9.0a 10.0f", "7.5;8.6;9.0;10.0")]
)
def test_ranks_get_an_arch_list_deepspeeds_jit_builder_can_read(monkeypatch, arch, readable):
    """An H100 image's TORCH_CUDA_ARCH_LIST=9.0a failed every DeepSpeed engine's FusedAdam build
    (benchmarks/results/gpu_evidence_h100-80gb.json, first run): the ranks get it without the
    architecture-specific suffix, and DeepSpeed's own parser reads what they get."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    class Op(CUDAOpBuilder):
        def __init__(self):
            super().__init__(name="memfit_arch_probe")

        def absolute_name(self):
            return self.name

        def sources(self):
            return []

    op = Op()
    op.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
    with pytest.raises(ValueError, match="invalid literal"):
        op.compute_capability_args()
    env = launch_env()
    assert env["TORCH_CUDA_ARCH_LIST"] == readable
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"])
    op.compute_capability_args()  # no error


def test_the_cuda_arch_list_of_a_hopper_image_is_one_deepspeed_can_read():
    from memfit.train.launch import deepspeed_arch_list

    # CUDA images for Hopper set "9.0a": DeepSpeed 0.19.8 int()s each dotted part and fails FusedAdam's build
    assert deepspeed_arch_list("9.0a") == "9.0"
    assert deepspeed_arch_list("8.0 8.6;9.0a+PTX;10.0f") == "8.0;8.6;9.0+PTX;10.0"
    assert deepspeed_arch_list("9.0;9.0a") == "9.0"
