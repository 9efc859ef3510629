"""The workflow's rank start-up server (memfit.workflow.ranks): started for a run on the CPU
accelerator on one machine only, and never over one a user or the test suite named."""

import pytest

from memfit.train.rank_server import ENV
from memfit.workflow import ranks

CPU = {"gpus": ["cpu"], "num_gpus": 2, "plan_only": False}


@pytest.mark.parametrize(
    ("config", "local_exec", "environ", "expected"),
    [
        (CPU, True, {}, True),  # snakemake --cores all with the embedded default
        (CPU, False, {}, False),  # --profile slurm: each job's ranks in its own allocation
        (CPU | {"plan_only": True}, True, {}, False),  # nothing launches ranks
        (CPU | {"gpus": ["h100-80gb"]}, True, {}, False),  # a forked CUDA context is unusable
        (CPU | {"gpus": ["cpu", "h100-80gb"]}, True, {}, False),
        (CPU, True, {ENV: "off"}, False),  # the user's opt-out
        (CPU, True, {ENV: "/tmp/x/ranks.sock"}, False),  # the test suite's own server, used as it is
    ],
)
def test_a_server_is_started_only_for_cpu_ranks_on_this_machine(config, local_exec, environ, expected):
    assert ranks.wanted(config, local_exec=local_exec, environ=environ) is expected


def test_off_starts_interpreters(monkeypatch):
    """MEMFIT_RANK_SERVER=off: `memfit launch` starts each of memfit's ranks as an interpreter; "off"
    is not taken for a socket path (asking a server there would fail at once here)."""
    import sys

    from memfit.train import rank_server
    from memfit.train.local_ranks import LocalRanks

    monkeypatch.setattr(rank_server, "CONNECT_WAIT_S", 0.0)
    ranks_ = LocalRanks([sys.executable, "-m", "memfit.cli", "--help"], 2, {ENV: "off"}, port=0)
    assert ranks_.wait(timeout=60) == 0
    assert all(type(p).__name__ == "Popen" for p in ranks_.procs)
