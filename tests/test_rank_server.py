"""The rank start-up server the slow tests fork their DeepSpeed ranks from
(memfit.train.rank_server): a rank it forks trains exactly as a started interpreter does, its exit
code and output reach the launcher as a child's would, and it dies with its launcher."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deepspeed_runs import base_run, run

from memfit.train.launch import _children
from memfit.train.launch import start_rank_server as start
from memfit.train.rank_server import ENV, ServerRank

pytestmark = pytest.mark.slow

# what a run measures rather than computes: times, and the host RSS (a forked rank maps what the
# server imported for every kind of run)
MEASURED = ("tokens_per_s", "step_time_s", "host_rss_bytes")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this module's own (the session's, if any, is left alone): (socket path, process)."""
    path = str(tmp_path_factory.mktemp("server") / "ranks.sock")
    proc = start(path, 2)
    yield path, proc
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not Path(path).exists()


def _memfit(*args):
    return [sys.executable, "-m", "memfit.cli", *args]


def test_a_forked_rank_trains_exactly_as_a_started_interpreter(server, demo_model, demo_data, tmp_path, monkeypatch):
    """Losses, evaluation, memory and the exported weights of one run, bit for bit, either way."""
    monkeypatch.delenv(ENV, raising=False)
    plain = run(base_run(demo_model, demo_data, tmp_path / "plain", zero=2))
    monkeypatch.setenv(ENV, server[0])
    forked = run(base_run(demo_model, demo_data, tmp_path / "forked", zero=2))

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in MEASURED} for r in rows]

    assert strip(forked) == strip(plain)
    assert (tmp_path / "forked/model/model.safetensors").read_bytes() == (
        tmp_path / "plain/model/model.safetensors"
    ).read_bytes()
    log = (tmp_path / "forked/log.txt").read_text()
    assert "step 6: eval loss" in log  # the ranks' output reached the launcher's log


def test_exit_codes_and_output_reach_the_launcher(server, tmp_path):
    path, _ = server
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        bad = ServerRank(path, _memfit("no-such-command"), dict(os.environ), stdout=f, stderr_to_stdout=True)
        assert bad.wait(timeout=120) == 2  # argparse's usage error, as `python -m memfit.cli` exits
    assert "no-such-command" in out.read_text()
    ok = ServerRank(path, _memfit("launch", "--help"), dict(os.environ), stdout=subprocess.PIPE)
    assert ok.wait(timeout=120) == 0
    assert "Start all ranks of a run on this node." in ok.stdout.read().decode()


def test_a_forked_rank_dies_with_its_launcher(server, demo_model, demo_data, tmp_path):
    """kill -9 of the launcher: the server SIGKILLs its ranks (a started rank dies by PR_SET_PDEATHSIG)."""
    path, server_proc = server
    cfg = base_run(demo_model, demo_data, tmp_path / "long", zero=0)
    cfg.max_steps, cfg.save_every, cfg.eval_every = 10_000, 0, 0
    Path(cfg.out_dir).mkdir(parents=True)
    cfg.save(Path(cfg.out_dir) / "run.json")
    code = (
        "import sys; from pathlib import Path; from memfit.train.launch import launch; "
        f"sys.exit(launch(Path('{cfg.out_dir}/run.json'), 2, log=Path('{cfg.out_dir}/log.txt')))"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, ENV: path})
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count('"train"') >= 2):
        time.sleep(0.2)
    ranks = _children(server_proc.pid)
    assert len(ranks) == 2, (Path(cfg.out_dir) / "log.txt").read_text()[-2000:]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(Path(f"/proc/{pid}").exists() for pid in ranks):
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)
    steps = [json.loads(r)["step"] for r in metrics.read_text().splitlines()]
    assert max(steps) < 10_000


def test_an_unreachable_server_raises_and_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """A launcher whose server is gone gets the error naming the socket and how to start one, and
    keeps no pipe or socket of the rank that never started (it may go on, or exit, cleanly)."""
    from memfit.train import rank_server

    monkeypatch.setattr(rank_server, "CONNECT_WAIT_S", 0.0)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="no rank server listens there"):
        ServerRank(str(tmp_path / "gone.sock"), _memfit("--help"), dict(os.environ), stdout=subprocess.PIPE)
    assert set(os.listdir("/proc/self/fd")) == before


def test_a_server_exits_when_the_process_that_started_it_is_gone(tmp_path):
    """The workflow's server (memfit.workflow.ranks) outlives no Snakemake killed with SIGKILL: it
    serves only while the process that started it lives."""
    path = tmp_path / "ranks.sock"
    code = (
        "import sys; from memfit.train.launch import start_rank_server as start; "
        f"print(start({str(path)!r}, 2).pid, flush=True)"  # then this process exits, not stopping it
    )
    starter = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid = int(starter.stdout)
    deadline = time.monotonic() + 50  # the server imports first (about 10 s), then sees its parent gone
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.5)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the rank server {pid} still runs 50 s after the process that started it exited")
    assert not path.exists()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie its new parent has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
