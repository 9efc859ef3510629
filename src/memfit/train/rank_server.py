"""Ranks forked from a process that has already imported their libraries: the test suite's rank
start-up server.

A 2-rank CPU run of the demo model (tests/deepspeed_runs.py `base_run`, 6 steps) spends most of
its 9-11 s importing: each rank imports torch, DeepSpeed, transformers and the model's code again
(about 5 s of a 6.9 s one-rank run, sampled on the 2-core machine on 2026-11-28), for about 2 s of
set-up and training. The slow tests make about 150 such launches. Where MEMFIT_RANK_SERVER names
this server's Unix socket, `memfit launch` (memfit.train.local_ranks.LocalRanks) asks the server
for each rank instead of starting an interpreter: the server forks a child of its own, already
past those imports, and the child runs the rank's `memfit.cli` command line exactly as the
started interpreter would (`runpy`, the rank's environment, working directory, stdout and
stderr, SIGUSR1 ignored).

Who uses it: tests/conftest.py starts a server for the slow tests, and the workflow starts one for
a run on the CPU accelerator on one machine (memfit.workflow.ranks: the demo's probes, calibration,
training and resume checks are about 15 launches of 2 ranks). `memfit launch` on the command line,
GPU runs and SLURM jobs start interpreters. MEMFIT_RANK_SERVER=off keeps the workflow from
starting one.

What differs from a fresh interpreter, and how it is made the same:
- the imports ran once in the server, with its environment. The server is started with the
  launch environment (`launch_env`: the accelerator, the extensions directory, offline hub), so
  what the libraries read at import time is what a rank would read;
- OpenMP and MKL read their thread counts when torch loads: each child sets torch's thread count
  from its OMP_NUM_THREADS (`torch.set_num_threads`, which sets both);
- a fork copies only the calling thread, so the server forks from its main thread with no other
  Python thread running (it refuses to start if its imports started one). The native threads the
  imports start (one by torch's import, jemalloc's background thread) are idle, as in every
  process torch's DataLoader forks its workers from; jemalloc re-initialises across a fork
  (its pthread_atfork handlers);
- the child's parent is the server, not the launcher. A rank dies with its parent
  (rank._die_with_parent); here the server SIGKILLs a child as soon as its launcher's connection
  closes, which the kernel does when the launcher dies, SIGKILL included;
- the exit status goes back over the connection, in `subprocess.Popen.returncode`'s form.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO

ENV = "MEMFIT_RANK_SERVER"
# What every training or calibration rank imports before its first step (sampled, see above):
# torch, DeepSpeed and its CPU accelerator's op builder, transformers with the tokenizer and the
# causal LM classes, torch._dynamo (imported by transformers at model load) and the rank's own
# modules. Not peft, which only LoRA runs import: it imports bitsandbytes, whose import alone
# changed a full fine-tuning run's tracked peak by 128 bytes (tests/test_rank_server.py compares
# the runs bit for bit), so a LoRA rank imports peft itself as a started one does.
PRELOAD = (
    "torch",
    "deepspeed",
    "deepspeed.ops.op_builder.cpu",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "torch._dynamo",
    "memfit.train.rank",
    "memfit.train.calibrate",
)
OFF = "off"  # MEMFIT_RANK_SERVER=off: every rank a started interpreter, and the workflow starts no server
CONNECT_WAIT_S = 120.0  # the server imports for about 10 s; a launcher may ask before it listens
MAX_MESSAGE = 1 << 20


# ------------------------------------------------------------------------------------------ client
class ServerRank:
    """One rank forked by the server, with the `subprocess.Popen` methods and attributes
    LocalRanks uses (args, pid, stdout, poll, wait, send_signal, kill, returncode)."""

    def __init__(
        self,
        path: str,
        args: Sequence[str],
        env: Mapping[str, str],
        stdout: IO | int | None = None,
        stderr_to_stdout: bool = False,
        ignore_sigusr1: bool = False,
    ) -> None:
        self.args = list(args)
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None
        if self.args[1:3] != ["-m", "memfit.cli"]:
            raise ValueError(f"the rank server runs `python -m memfit.cli ...` only, not {self.args}")
        read_end = None
        if stdout == subprocess.PIPE:
            read_end, out_fd = os.pipe()
        elif stdout is None:
            out_fd = sys.stdout.fileno()
        else:
            out_fd = stdout if isinstance(stdout, int) else stdout.fileno()
        err_fd = out_fd if stderr_to_stdout else sys.stderr.fileno()
        sock = None
        try:
            sock = self.sock = _connect(path)
            request = {"argv": self.args, "env": dict(env), "cwd": os.getcwd(), "ignore_sigusr1": ignore_sigusr1}
            socket.send_fds(sock, [json.dumps(request).encode()], [out_fd, err_fd])
            reply = sock.recv(MAX_MESSAGE)
            if not reply:
                raise RuntimeError(f"the rank server at {path} closed the connection without starting the rank")
            self.pid = int(json.loads(reply)["pid"])
        except BaseException:  # no rank: nothing of this one stays open in the launcher
            if read_end is not None:
                os.close(read_end)
            if sock is not None:
                sock.close()
            raise
        finally:
            if read_end is not None:
                os.close(out_fd)  # the child holds the write end; EOF comes when it exits
        if read_end is not None:
            self.stdout = open(read_end, "rb")  # noqa: SIM115 - the reader (RankOutput) closes it

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.sock], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        assert self.returncode is not None
        return self.returncode

    def _read_exit(self) -> None:
        data = self.sock.recv(MAX_MESSAGE)
        # the server itself gone (killed): its children died with it (PR_SET_PDEATHSIG)
        self.returncode = int(json.loads(data)["returncode"]) if data else -signal.SIGKILL
        self.sock.close()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _connect(path: str) -> socket.socket:
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{ENV}={path}: no rank server listens there after {CONNECT_WAIT_S:.0f} s "
                    f"(start one with `python -m memfit.train.rank_server {path}`, or set {ENV}={OFF} to start "
                    "each rank as its own interpreter)"
                ) from None
            time.sleep(0.1)


# ------------------------------------------------------------------------------------------ server
def preload() -> None:
    """Import what every rank imports; refuse to serve if that started a Python thread (see the module)."""
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        raise RuntimeError(f"the rank server's imports started Python threads {others}: forking it is unsafe")


def serve(path: str, parent: int | None = None) -> None:
    """Fork a rank for each request on `path` until SIGTERM or SIGINT, or until process `parent`
    is no longer this one's parent (it exited; the server was re-parented)."""
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    running: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        while not stop and (parent is None or os.getppid() == parent):
            conns = list(running.values())
            try:
                ready = select.select([listener, *conns], [], [], 0.05)[0]
            except InterruptedError:
                ready = []
            for conn in ready:
                if conn is listener:
                    _accept(listener, running)
                else:  # a launcher wrote nothing more; readable means it closed: it is gone
                    pid = next(p for p, c in running.items() if c is conn)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            _reap(running)
    finally:
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _accept(listener: socket.socket, running: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 2)
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, conn)  # never returns
    except Exception:
        traceback.print_exc()
        conn.close()
        return
    finally:
        for fd in fds:  # the child has its own copies
            os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode())
    running[pid] = conn


def _reap(running: dict[int, socket.socket]) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # the launcher may be gone
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def _child(request: dict, fds: list[int], conn: socket.socket) -> None:
    """The forked rank: the started interpreter's state, then `python -m memfit.cli ...`."""
    code = 1
    try:
        conn.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN if request["ignore_sigusr1"] else signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
            sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
        import torch

        if threads := os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(threads))
        sys.argv = [request["argv"][0], *request["argv"][3:]]
        import runpy

        try:
            runpy.run_module("memfit.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or not all(a.isdigit() for a in args[1:]):
        print("usage: python -m memfit.train.rank_server SOCKET_PATH [PARENT_PID]", file=sys.stderr)
        return 2
    try:
        serve(args[0], int(args[1]) if len(args) == 2 else None)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            print(f"{args[0]}: in use", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
