"""The ranks of a one-node run, started directly by the launcher instead of by torchrun's agent.

`torch.distributed.run --standalone` starts an agent process that imports torch before the first
rank starts (1.4 s on a 2-core CPU) and tears it down after the last one ends. A 2-rank CPU run of
the demo model (6 steps, tests/deepspeed_runs.py `base_run`) took 8.8 s under torchrun and 7.5-8.0 s
started here (measured 2026-11-26 on the 2-core CI machine; `make test` makes about 70 such
launches, the demo about 20). Several nodes still meet through torchrun's c10d rendezvous
(memfit.train.launch.command).

What torchrun's agent did for memfit's ranks, done here the same way:
- each rank's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK,
  ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch/distributed/elastic/agent/server/
  local_elastic_agent.py `_start_workers`), read by `torch.distributed`'s env:// rendezvous;
- the rendezvous port: a free port of this host, the way torch picks one
  (torch/distributed/elastic/utils/distributed.py `get_free_port`: bind port 0, read, close);
- a rank that fails stops the others: SIGTERM, SIGKILL after 30 s (torch/distributed/elastic/
  multiprocessing/api.py `PContext.close(death_sig=SIGTERM, timeout=30)`); SIGTERM sent to the
  launcher reaches every rank the same way;
- the exit code: 0 when every rank exits 0. Otherwise the first failing rank's own code, where
  torchrun returned 1: a rank's OOM_EXIT_CODE or the kernel's SIGKILL reaches the probe as is.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import IO

from memfit.train.rank_server import ENV as RANK_SERVER_ENV
from memfit.train.rank_server import OFF as RANK_SERVER_OFF
from memfit.train.rank_server import ServerRank

# torch/distributed/elastic/multiprocessing/api.py: PContext.close's default timeout before SIGKILL
STOP_GRACE_S = 30.0
POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; torch's get_free_port does the same)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ignore_sigusr1_preexec() -> None:
    """A rank's (or torchrun's) preexec: SIGUSR1 ignored (inherited through exec and by torchrun's
    ranks; a training rank sets its own handler). SLURM signals every process of a step, and the
    default action would kill it."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def rank_env(rank: int, nproc: int, port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """What torchrun's agent sets for local rank `rank` of a one-node, `nproc`-rank run."""
    world = str(nproc)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": world,
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
    }


class LocalRanks:
    """`nproc` copies of `cmd`, one per rank, handled like one process (the `subprocess.Popen`
    methods launch uses: wait, send_signal, kill)."""

    def __init__(
        self,
        cmd: Sequence[str],
        nproc: int,
        env: Mapping[str, str],
        port: int,
        stdout: IO | int | None = None,
        ignore_sigusr1: bool = False,
    ) -> None:
        self.args = list(cmd)
        self.procs: list[subprocess.Popen | ServerRank] = []
        # a rank start-up server (memfit.train.rank_server: the slow tests', the CPU workflow's), for
        # memfit's own ranks; MEMFIT_RANK_SERVER=off: none
        server = env.get(RANK_SERVER_ENV) if self.args[1:3] == ["-m", "memfit.cli"] else None
        server = None if server == RANK_SERVER_OFF else server
        try:
            for r in range(nproc):
                rank_env_ = {**env, **rank_env(r, nproc, port)}
                if server:
                    self.procs.append(
                        ServerRank(server, self.args, rank_env_, stdout, stdout is not None, ignore_sigusr1)
                    )
                    continue
                self.procs.append(
                    subprocess.Popen(
                        self.args,
                        env=rank_env_,
                        stdout=stdout,
                        stderr=subprocess.STDOUT if stdout is not None else None,
                        preexec_fn=ignore_sigusr1_preexec if ignore_sigusr1 else None,
                    )
                )
        except BaseException:
            self.kill()
            raise
        self.first_failure: int | None = None
        self.kill_at: float | None = None

    def poll(self) -> int | None:
        """None while a rank runs; then 0, or the exit code of the rank that failed first."""
        codes = [p.poll() for p in self.procs]
        for code in codes:
            if code not in (None, 0) and self.first_failure is None:
                self.first_failure = code
                self.send_signal(signal.SIGTERM)  # the others would wait for it in a collective
        if all(code is not None for code in codes):
            return self.first_failure or 0
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            self.kill()
        return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_S)
        return rc

    def send_signal(self, signum: int) -> None:
        """`signum` to every rank still running; after a SIGTERM, SIGKILL follows STOP_GRACE_S later."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass
        if signum == signal.SIGTERM and self.kill_at is None:
            self.kill_at = time.monotonic() + STOP_GRACE_S

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
