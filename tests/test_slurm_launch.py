"""Multi-node launch: the torchrun command each node runs under `srun`, and the refusal to
run a multi-node config on one node without a rendezvous."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.train.launch import (
    LaunchError,
    Rendezvous,
    command,
    expand_nodelist,
    rendezvous_from_env,
)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
        ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
        ("h100-[008-010]", ["h100-008", "h100-009", "h100-010"]),
    ],
)
def test_expand_nodelist_matches_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu[a-b]", ""])
def test_expand_nodelist_refuses_what_it_cannot_parse(bad):
    with pytest.raises(LaunchError):
        expand_nodelist(bad)


def test_single_node_needs_no_rendezvous_and_starts_its_ranks_itself():
    assert rendezvous_from_env({}, 1) is None
    cmd = command(Path("run.json"), 8)
    assert "torch.distributed.run" not in cmd and cmd[-4:] == ["memfit.cli", "train", "--config", "run.json"]


def test_multi_node_outside_slurm_is_an_error_not_a_single_node_run():
    with pytest.raises(LaunchError, match="num_nodes=4 needs a rendezvous"):
        rendezvous_from_env({}, 4)


def test_srun_env_gives_every_node_the_first_host_as_endpoint():
    env = {"SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_NODEID": "2", "SLURM_JOB_ID": "4242"}
    rdzv = rendezvous_from_env(env, 4)
    assert rdzv == Rendezvous(nnodes=4, node_rank=2, host="gpu07", port=29500, run_id="4242")
    cmd = command(Path("run.json"), 8, rdzv)
    assert "--standalone" not in cmd
    assert {
        "--nnodes=4",
        "--node-rank=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu07:29500",
    } <= set(cmd)
    assert "--rdzv-id=4242" in cmd and "--nproc-per-node=8" in cmd


def test_allocation_smaller_than_num_nodes_is_refused():
    with pytest.raises(LaunchError, match="has 2 host"):
        rendezvous_from_env({"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NODEID": "0"}, 4)


def test_node_rank_out_of_range_is_refused():
    with pytest.raises(LaunchError, match="out of range"):
        rendezvous_from_env({"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NODEID": "2"}, 2)


def test_explicit_rendezvous_for_other_schedulers():
    env = {"MEMFIT_RDZV_HOST": "10.0.0.1", "MEMFIT_NODE_RANK": "1", "MEMFIT_RDZV_PORT": "31000"}
    assert rendezvous_from_env(env, 2) == Rendezvous(nnodes=2, node_rank=1, host="10.0.0.1", port=31000)


def test_sigusr1_reaches_the_ranks_and_spares_torchrun(tmp_path):
    """SLURM's --signal=USR1@secs reaches every process of a step: the torchrun stand-in started
    with launch's preexec survives it (SIG_IGN), and the launcher's forward reaches its children."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from memfit.train.launch import _children, _forward
    from memfit.train.local_ranks import ignore_sigusr1_preexec

    got = tmp_path / "rank-got-usr1"
    rank = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGUSR1, lambda *a: pathlib.Path(sys.argv[1]).write_text('x'))\n"
        "print('ready', flush=True)\n"
        "for _ in range(200):\n"
        "    time.sleep(0.05)\n"
        "    if pathlib.Path(sys.argv[1]).exists(): sys.exit(4)\n"
    )
    agent = (  # like torchrun: starts the rank, waits, passes on its exit code
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {rank!r}, sys.argv[1]], stdout=subprocess.PIPE)\n"
        "print(p.stdout.readline().decode().strip(), flush=True)\n"
        "sys.exit(p.wait())\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", agent, str(got)],
        stdout=subprocess.PIPE,
        preexec_fn=ignore_sigusr1_preexec,
    )
    assert proc.stdout.readline().strip() == b"ready"
    os.kill(proc.pid, signal.SIGUSR1)  # what SLURM does to every process of the step
    time.sleep(0.3)
    assert proc.poll() is None and not got.exists()  # torchrun survives, does not pass it on
    assert len(_children(proc.pid)) == 1
    _forward(proc, signal.SIGUSR1, to_ranks=True)
    assert proc.wait(timeout=20) == 4 and got.exists()  # the rank saw it and exited 4
