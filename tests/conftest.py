import os
import sys
import tempfile
from pathlib import Path

import pytest

# The checks against public measurements (benchmarks/memfit_validation) are not part of the
# library: tests import them from benchmarks/, as the benchmark scripts do (their own folder).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

# No downloads, ever: models come from the repo or local paths.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Traces and inventories go to a cache of this test process (and the commands it starts), not the
# user's ~/.cache/memfit/traces: every run starts cold, as on a fresh CI machine.
_TRACE_CACHE = tempfile.TemporaryDirectory(prefix="memfit-test-traces-")
os.environ["MEMFIT_TRACE_CACHE"] = _TRACE_CACHE.name
# and content digests of models and data (memfit.train.identity) likewise
os.environ["MEMFIT_DIGEST_CACHE"] = os.path.join(_TRACE_CACHE.name, "sha256.json")


def pytest_addoption(parser):
    parser.addoption(
        "--sweeps",
        action="store_true",
        help="also run the tests marked `sweep` (the rest of a sweep whose representative case the suite runs)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "sweep: a case of a sweep (ZeRO stages x levers) beyond the suite's representative one; "
        "skipped unless --sweeps (benchmarks/sweeps.sh)",
    )
    _share_cores(config)


def _share_cores(config):
    """Under pytest-xdist (`make test-fast`: a worker per core), each worker gets its share of the
    cores, for torch's threads and for the estimator's trace children (memfit.estimate.trace.trace
    `trace_workers`), instead of all of them each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        from memfit.train.launch import threads_per_rank  # the same even share memfit gives ranks

        share = threads_per_rank(workers)
        torch.set_num_threads(share)
        os.environ.setdefault("MEMFIT_TRACE_WORKERS", str(share))


REPO = Path(__file__).resolve().parents[1]
_RANK_SERVER: dict = {}


def pytest_collection_finish(session):
    """The slow tests' DeepSpeed ranks fork from a rank server that has imported torch, DeepSpeed
    and transformers once (memfit.train.rank_server: about 5 s of each launch's 9-11 s), started
    here so that it imports while the first tests run. MEMFIT_TEST_RANK_SERVER=0 starts every rank
    as its own interpreter, as `memfit launch` does for users; the tests that check the launcher's
    own process handling (tests/test_rank_server.py, test_train's kill -9) start interpreters."""
    if os.environ.get("MEMFIT_TEST_RANK_SERVER", "1") == "0" or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if not any(item.get_closest_marker("slow") for item in session.items):
        return
    from memfit.train.launch import start_rank_server as start
    from memfit.train.rank_server import ENV

    path = os.path.join(_TRACE_CACHE.name, "ranks.sock")
    log = open(os.path.join(_TRACE_CACHE.name, "rank-server.log"), "w")  # noqa: SIM115 - closed at the end
    proc = start(path, 2, stdout=log)
    _RANK_SERVER.update(proc=proc, log=log)
    os.environ[ENV] = path


def pytest_sessionfinish(session, exitstatus):
    if proc := _RANK_SERVER.pop("proc", None):
        proc.terminate()
        proc.wait(timeout=30)
        _RANK_SERVER.pop("log").close()


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The embedded demo model, built once per test session (about 2 s)."""
    from memfit.workflow.demo import build_demo_model

    out = tmp_path_factory.mktemp("demo") / "demo-tiny"
    build_demo_model(REPO / "config/models/demo-tiny.json", REPO / "data/demo", out)
    return out


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    """The demo's tokenizer (trained on data/demo, as build_demo_model trains it), saved once per session."""
    from memfit.workflow import demo

    path = tmp_path_factory.mktemp("tok")
    demo.train_tokenizer(REPO / "data/demo").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="session")
def mixed_dpo_pairs(demo_model, tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """Four of the demo's DPO pairs tokenized by memfit (max_len 24) with mixed prompt and response
    lengths, so padding and masking differ across rows, and their source records: the batch the
    TRL parity tests (test_trl_parity, test_pref_losses) compare on."""
    import json

    from memfit import data

    out = tmp_path_factory.mktemp("mixed_pairs")
    data.prepare("dpo", REPO / "data/demo/dpo.jsonl", demo_model, out, max_len=24, eval_fraction=0.05)
    rows = data.load_split(out, "train")
    chosen, seen = [], set()
    for r in rows:
        key = (len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"]))
        if key not in seen:
            seen.add(key)
            chosen.append(r)
    chosen = chosen[:4]
    chosen += [r for r in rows if r not in chosen][: 4 - len(chosen)]
    assert len(chosen) == 4 and len({len(r["chosen_ids"]) + len(r["prompt_ids"]) for r in chosen}) > 1
    lines = (REPO / "data/demo/dpo.jsonl").read_text().splitlines()
    return chosen, [json.loads(lines[r["row"] - 1]) for r in chosen]


@pytest.fixture(scope="session")
def demo_data(demo_model, tmp_path_factory) -> Path:
    """The demo SFT and DPO data prepared for the demo model (max_len 32), once per session.

    Held out: 1% (56 SFT rows, 16 DPO pairs). Every DeepSpeed run of the tests evaluates at its
    start and every few steps; with the 5% the workflow's demo holds out (280 and 80) the
    evaluations were a fifth of each 6-step run's time, and none of the tests needs more rows
    to see the held-out loss fall or two runs evaluate alike."""
    from memfit.data import prepare

    root = tmp_path_factory.mktemp("data")
    for method in ("sft", "dpo"):
        prepare(method, REPO / f"data/demo/{method}.jsonl", demo_model, root / method, max_len=32, eval_fraction=0.01)
    return root


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need CUDA: skipped, with the reason shown, where there is none.
    `@pytest.mark.sweep` cases (the rest of a sweep whose representative case the suite keeps, to
    keep the slow pass short) are skipped, with the reason shown, unless `--sweeps`.

    Under pytest-xdist with `--dist loadgroup`, every `slow` test (multi-process DeepSpeed runs)
    goes to one worker: the session's shared runs (`shared_runs`) are made once, and at most
    one worker's ranks compete for the cores; the other workers run the rest."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("deepspeed"))
    if not config.getoption("--sweeps"):
        skip_sweep = pytest.mark.skip(reason="a sweep case beyond the representative one: benchmarks/sweeps.sh runs it")
        for item in items:
            if item.get_closest_marker("sweep"):
                item.add_marker(skip_sweep)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest marker `gpu`)")
        for item in gpu_tests:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_runs(demo_model, demo_data, tmp_path_factory):
    """DeepSpeed runs made once per session and read by the tests of several files
    (tests/deepspeed_runs.py `SharedRuns`); a test copies a run directory before changing it."""
    from deepspeed_runs import SharedRuns

    return SharedRuns(demo_model, demo_data, tmp_path_factory.mktemp("shared-runs"))
