"""Bad input, table-driven: every case is refused with exit code 2 (or the named exception), a
message that names the problem (the flag, key, row or file), and no partial output.

CLI cases run in-process through `memfit.cli.main` (fast); the broken pipe and one Snakemake
case run as real subprocesses.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memfit import cli, data
from memfit.workflow import demo
from memfit.workflow.config import ConfigError, WorkflowConfig, load_yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = ROOT / "data" / "demo"
TINY = ROOT / "config" / "models" / "demo-tiny.json"
EST = ["estimate", "--model", "llama-3.1-8b", "--gpu", "a100-80gb"]
FIT = ["fit", "--maximize", "seq_len", "--model", "llama-3.1-8b", "--gpu", "a100-80gb"]

# ---------------------------------------------------------------------------- the CLI
# (argv after `memfit`, substring the error must contain); {tmp} is the test's tmp_path
CLI_CASES = [
    (EST + ["--num-gpus", "0"], "--num-gpus must be > 0"),
    (EST + ["--num-gpus", "-1"], "--num-gpus must be > 0"),
    (EST + ["--num-nodes", "0"], "--num-nodes must be > 0"),
    (EST + ["--seq-len", "0"], "--seq-len must be > 0"),
    (EST + ["--micro-batch", "-2"], "--micro-batch must be > 0"),
    (EST + ["--grad-accum", "0"], "--grad-accum must be > 0"),
    (EST + ["--sub-group-size", "0"], "--sub-group-size must be > 0"),
    (EST + ["--sub-group-size", "-5"], "--sub-group-size must be > 0"),
    (EST + ["--budget-gib", "0"], "--budget-gib must be > 0"),
    (EST + ["--budget-gb", "-5"], "--budget-gb must be > 0"),
    (EST + ["--host-memory-gib", "0"], "--host-memory-gib must be > 0"),
    (EST + ["--host-memory-gb", "-1"], "--host-memory-gb must be > 0"),
    (EST + ["--host-memory-gib", "64", "--host-memory-gb", "64"], "not both"),
    (EST + ["--headroom", "1.5"], "--headroom must be in [0, 1)"),
    (EST + ["--headroom", "-0.1"], "--headroom must be in [0, 1)"),
    (EST + ["--offload-ratio", "0"], "--offload-ratio must be in (0, 1]"),
    (EST + ["--lora-rank", "0", "--finetune", "lora"], "--lora-rank must be > 0"),
    (EST + ["--seq-len", "1000000"], "beyond llama-3.1-8b's context"),
    (EST + ["--lora-rank", "8"], "--lora-rank does nothing with --finetune full"),
    (EST + ["--lora-targets", "q_proj"], "--lora-targets does nothing with --finetune full"),
    (EST + ["--ref", "model"], "--ref does nothing with --method sft"),
    (EST + ["--pin-memory"], "--pin-memory does nothing without"),
    (EST + ["--trace-cache", "{tmp}/c"], "--trace-cache does nothing without --activations traced"),
    (
        EST + ["--activations", "traced", "--trace-cache", "{tmp}/file/sub"],
        "--trace-cache {tmp}/file/sub",
    ),
    (EST + ["--method", "dpo", "--ref", "adapter"], "ref=adapter needs finetune=lora or qlora"),
    (
        ["estimate", "--model", "{tmp}/latin1", "--gpu", "a100-80gb"],
        "{tmp}/latin1/config.json: not UTF-8",
    ),
    (["estimate", "--model", "{tmp}/empty", "--gpu", "a100-80gb"], "has no config.json"),
    (
        ["estimate", "--model", "{tmp}/weird", "--gpu", "a100-80gb"],
        "model_type 'weirdnet' is not in transformers' AutoModelForCausalLM mapping",
    ),
    (["estimate", "--model", "no-such-model", "--gpu", "a100-80gb"], "no-such-model"),
    (["estimate", "--model", "llama-3.1-8b", "--gpu", "no-such-gpu"], "no-such-gpu"),
    (FIT + ["--num-gpus", "0"], "--num-gpus must be > 0"),
    (FIT + ["--budget-gib", "0"], "--budget-gib must be > 0"),
    (FIT + ["--lora-rank", "4"], "--lora-rank does nothing"),
    (FIT + ["--headroom", "1"], "--headroom must be in [0, 1)"),
    (["train", "--config", "{tmp}/absent.json"], "{tmp}/absent.json: no such run config"),
    (["train", "--config", "{tmp}/broken.json"], "{tmp}/broken.json: not valid JSON (line 1"),
    (["train", "--config", "{tmp}/list.json"], "{tmp}/list.json: expected a JSON object"),
    (["train", "--config", "{tmp}/partial.json"], "missing run config key(s) model_path"),
    (["train", "--config", "{tmp}/unknown.json"], "unknown run config keys ['nonsense']"),
    (["train", "--config", "{tmp}"], "is a directory"),
    (["launch", "--config", "{tmp}/latin1.json"], "{tmp}/latin1.json: not UTF-8"),
    (["launch", "--config", "{tmp}/broken.json", "--nproc", "2"], "not valid JSON"),
    # issue 41: hidden caps, non-finite numbers, flags silently ignored
    (EST + ["--host-memory-gib", "inf"], "--host-memory-gib must be a finite number, got inf"),
    (EST + ["--budget-gib", "nan"], "--budget-gib must be a finite number, got nan"),
    (EST + ["--headroom", "nan"], "--headroom must be a finite number"),
    (EST + ["--nccl-mib", "-1"], "--nccl-mib must be >= 0"),
    (EST + ["--num-gpus", "100000"], "--num-gpus 100000 is more than one node holds (at most 16"),
    (EST + ["--micro-batch", "200000"], "--micro-batch 200000 is above 65,535"),
    (EST + ["--loss-chunk-tokens", "1024"], "--loss-chunk-tokens does nothing with --loss-impl full"),
    (EST + ["--loss-impl", "chunked", "--loss-chunk-tokens", "0"], "--loss-chunk-tokens must be >= 1"),
    (EST + ["--mlp-tile-tokens", "512"], "--mlp-tile-tokens does nothing without --tiled-mlp"),
    (FIT + ["--seq-len", "1024"], "--seq-len does nothing with --maximize seq_len"),
    (
        ["fit", "--maximize", "micro_batch", "--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--micro-batch", "4"],
        "--micro-batch does nothing with --maximize micro_batch",
    ),
    (FIT + ["--host-memory-gb", "inf"], "--host-memory-gb must be a finite number"),
    (EST + ["--step-time-calibration", "{tmp}/absent.json"], "--step-time-calibration {tmp}/absent.json: no such file"),
]


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """The files the CLI cases name."""
    tiny = json.loads(TINY.read_text())
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "config.json").write_bytes('{"model_type": "llama", "x": "é"}'.encode("latin-1"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "weird").mkdir()
    (tmp_path / "weird" / "config.json").write_text(json.dumps(tiny | {"model_type": "weirdnet"}))
    (tmp_path / "file").write_text("a file, not a directory")
    (tmp_path / "broken.json").write_text('{"method": "sft",')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "partial.json").write_text('{"method": "sft"}')
    (tmp_path / "unknown.json").write_text(json.dumps(_run_config(tmp_path) | {"nonsense": 1}))
    (tmp_path / "latin1.json").write_bytes('{"method": "é"}'.encode("latin-1"))
    (tmp_path / "run.json").write_text(json.dumps(_run_config(tmp_path)))
    return tmp_path


def _run_config(tmp: Path) -> dict:
    return {
        "method": "sft",
        "model_path": str(tmp / "model"),
        "data_dir": str(tmp / "data"),
        "out_dir": str(tmp / "out"),
        "candidate": {"zero": 0},
    }


@pytest.mark.parametrize(("argv", "needle"), CLI_CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CLI_CASES])
def test_cli_refuses_with_one_sentence(argv, needle, inputs, capsys):
    argv = [a.replace("{tmp}", str(inputs)) for a in argv]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2
    assert needle.replace("{tmp}", str(inputs)) in err
    assert "Traceback" not in err and "does not fit" not in err.lower()
    assert err.count("\n") == 1, err  # one line
    assert out == ""  # no partial output
    assert not (inputs / "c").exists()  # nothing created for a refused --trace-cache


def test_launch_refuses_zero_ranks(inputs, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--config", str(inputs / "run.json"), "--nproc", "0"])
    assert exc.value.code == 2
    assert "--nproc must be >= 1, got 0" in capsys.readouterr().err
    assert not (inputs / "out").exists()


def test_beyond_context_is_allowed_when_asked(capsys):
    rc = cli.main(EST + ["--seq-len", "200000", "--allow-beyond-context", "--json"])
    assert rc in (0, 1)
    # a100-80gb: no calibration file, the uncalibrated margin
    assert json.loads(capsys.readouterr().out)["headroom"] == 0.07


def test_fit_seq_len_ignores_the_default_seq_len(tmp_path, capsys):
    """`fit --maximize seq_len` on a model whose context is below the --seq-len default."""
    rc = cli.main(["fit", "--maximize", "seq_len", "--model", str(TINY), "--gpu", "a100-80gb", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["seq_len"] == 128  # the whole context fits


def test_broken_pipe_exits_quietly():
    """`memfit estimate ... | head -c 10` (a config that fits: exit 0 whether or not the pipe closed first): no BrokenPipeError."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    cmd = f"{sys.executable} -m memfit.cli estimate --model llama-3.1-8b --gpu a100-80gb --finetune lora | head -c 10"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout == "llama-3.1-"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 0


def test_closed_stdout_exits_quietly():
    """The reader closed the pipe before anything was written: still no traceback."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "memfit.cli",
                "estimate",
                "--model",
                "llama-3.1-8b",
                "--gpu",
                "a100-80gb",
                "--json",
            ],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 0


# ---------------------------------------------------------------------- the workflow config
def _base() -> dict:
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    raw["models"]["demo-tiny"] = {"path": "resources/demo-tiny", "build": str(TINY)}
    raw["data"] |= {"sft": str(DEMO_DATA / "sft.jsonl"), "dpo": str(DEMO_DATA / "dpo.jsonl")}
    return raw


def _model_dir(tmp: Path, *, config: dict | None = None, tokenizer=True, weights=True, cfg_file=True) -> Path:
    d = tmp / "mymodel"
    d.mkdir()
    if cfg_file:
        (d / "config.json").write_text(json.dumps(config or json.loads(TINY.read_text())))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    return d


def _with_model(**kw):
    def edit(raw, tmp):
        raw["models"] = {"mymodel": {"path": str(_model_dir(tmp, **kw))}}

    return edit


def _set(path: str, value):
    def edit(raw, tmp):
        node = raw
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


def _edits(*pairs):
    def edit(raw, tmp):
        for path, value in pairs:
            _set(path, value)(raw, tmp)

    return edit


WEIRD = json.loads(TINY.read_text()) | {"model_type": "weirdnet"}
CONFIG_CASES = [
    (_set("headroom", -0.1), "headroom"),
    (_set("headroom", "lots"), "headroom"),
    (_set("num_gpus", 0), "num_gpus"),
    (_set("data.max_len", 4096), "data.max_len: 4096 is beyond models.demo-tiny's context of 128"),
    (_set("search.seq_len", 1000), "search.seq_len: 1000 is beyond"),
    (_set("train.save_every", 0), "train.save_every: 0 writes no checkpoints"),
    (_set("train.keep_last", 1), "train.keep_last: 1 is less than the minimum of 2"),
    (_set("gpus", ["mi300x"]), "gpus[0]: mi300x is for planning only"),
    (_set("gpus", ["no-such-gpu"]), "gpus[0]"),
    (_set("search.ref", ["adapter"]), "search.ref: 'adapter'"),
    (_set("models", {"m": {"path": "/no/such/dir"}}), "models.m.path"),
    (_set("data.sft", "/no/such/file.jsonl"), "data.sft: /no/such/file.jsonl does not exist"),
    (_with_model(cfg_file=False), "config.json is missing"),
    (_with_model(tokenizer=False), "models.mymodel.path: no tokenizer"),
    (_with_model(weights=False), "models.mymodel.path: no weights"),
    (_with_model(config=WEIRD), "model_type 'weirdnet' is not in transformers' AutoModelForCausalLM mapping"),
    # issue 41: the real reason when no combination of search: can be trained, and hardware refused up front
    (
        _edits(("search.zero", [0, 2]), ("search.offload_param", ["cpu"])),
        "search: no combination can be trained: search.zero [0, 2], search.offload_param ['cpu']: "
        "parameter offload (offload_param=cpu) needs ZeRO-3",
    ),
    (
        _edits(("search.activation_offload", [True]), ("search.grad_ckpt", [False])),
        "search.activation_offload [True]: activation_offload needs grad_ckpt",
    ),
    (
        _set("search.sequence_parallel", [3]),
        "search: no combination can be trained: search.sequence_parallel: 3 does not divide the 2 ranks",
    ),
    (_set("train.global_batch", 30), "train.global_batch: 30 is not a multiple of micro_batch x data-parallel ranks"),
    (
        _set("search.attn", ["flash"]),
        "gpus[0]: every candidate of search: is one cpu cannot run: search.attn ['flash']",
    ),
    (
        _edits(("gpus", ["v100-32gb"]), ("plan_only", True), ("search.precision", ["bf16"])),
        "gpus[0]: every candidate of search: is one v100-32gb cannot run: search.precision ['bf16']: v100-32gb has no bf16",
    ),
    (
        _edits(("gpus", ["v100-32gb"]), ("plan_only", True), ("search.attn", ["flash"])),
        "search.attn ['flash']: FlashAttention-2 does not run on v100-32gb",
    ),
    (_set("search.offload_optimizer", ["cpu"]), "offloading to the host from the host (gpu=cpu) has no meaning"),
    (_with_model(config=json.loads(TINY.read_text()) | {"hidden_size": -64}), "hidden_size = -64 must be positive"),
    (_with_model(config=json.loads(TINY.read_text()) | {"model_type": "bert"}), "model_type 'bert' is an encoder-only"),
]


@pytest.mark.parametrize(("edit", "needle"), CONFIG_CASES, ids=[n[:40] for _, n in CONFIG_CASES])
def test_workflow_config_refused(edit, needle, tmp_path):
    raw = _base()
    edit(raw, tmp_path)
    with pytest.raises(ConfigError) as exc:
        WorkflowConfig.load(copy.deepcopy(raw))
    assert needle in str(exc.value)


def test_base_config_is_valid(tmp_path):
    """The cases above fail for their own reason, not because the base is broken; and a local
    model directory without `build:` is accepted."""
    WorkflowConfig.load(_base())
    raw = _base()
    _with_model()(raw, tmp_path)
    assert WorkflowConfig.load(raw).built_models() == []


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("models:\n  x: {path: [a\nheadroom: 0.1\n", "YAML syntax error at line 3, column 9"),
        ("models:\n\t- x\n", "YAML syntax error at line 2, column 1"),
        ("- just\n- a list\n", "expected a YAML mapping"),
    ],
)
def test_yaml_errors_name_line_and_column(text, needle, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_yaml(f)
    assert str(f) in str(exc.value) and needle in str(exc.value)


def test_snakemake_dry_run_refuses_save_every_zero(tmp_path):
    raw = _base()
    raw["train"]["save_every"] = 0
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--configfile",
            str(tmp_path / "c.yaml"),
            "-d",
            str(tmp_path / "wd"),
            "-s",
            str(ROOT / "Snakefile"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "train.save_every: 0 writes no checkpoints" in proc.stdout + proc.stderr
    assert not (tmp_path / "wd" / "results").exists()


# ------------------------------------------------------------------------------ data files
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    demo.train_tokenizer(DEMO_DATA).save_pretrained(path)
    return path


DATA_CASES = [
    ("sft", b'{"prompt": "1 + 1"}\n', "line 1", "missing"),
    ("sft", b'{"prompt": 5, "response": "2"}\n', "key 'prompt'", "expected a string"),
    ("sft", b'{"messages": "hi"}\n', "key 'messages'", "expected a list"),
    ("sft", b"", "", "no rows"),
    ("sft", '{"prompt": "é", "response": "2"}\n'.encode("latin-1"), "line 1", "not UTF-8"),
    ("sft", b"not json\n", "line 1", "not JSON"),
    ("dpo", b'{"prompt": "1 + 1", "chosen": "2"}\n', "key 'rejected'", "missing"),
    (
        "dpo",
        b'{"prompt": "1 + 1", "chosen": "2", "rejected": ["3"]}\n',
        "key 'rejected'",
        "expected a string",
    ),
]


@pytest.mark.parametrize(("method", "content", "where", "problem"), DATA_CASES)
def test_data_refused(method, content, where, problem, tok_dir, tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_bytes(content)
    out = tmp_path / "prepared"
    with pytest.raises(data.DataError) as exc:
        data.prepare(method, src, tok_dir, out, max_len=32)
    msg = str(exc.value)
    assert str(src) in msg and where in msg and problem in msg
    assert not out.exists()


def test_data_missing_file(tok_dir, tmp_path):
    with pytest.raises(data.DataError, match="no such file"):
        data.prepare("sft", tmp_path / "absent.jsonl", tok_dir, tmp_path / "out", max_len=32)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ issue 41: the rest of the answers
# config.json values (`memfit estimate --model <dir>`): (the edit, what the message must name)
HF_CASES = [
    ({"hidden_size": -64}, "hidden_size = -64 must be positive"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0 must be positive"),
    ({"intermediate_size": 0}, "intermediate_size = 0 must be positive"),
    ({"max_position_embeddings": -1}, "max_position_embeddings = -1 must be positive"),
    ({"num_attention_heads": 2.5}, "num_attention_heads = 2.5 is not a whole number (float)"),
    ({"hidden_size": 256.0}, "hidden_size = 256.0 is not a whole number (float)"),
    ({"vocab_size": "many"}, "vocab_size = 'many' is not a whole number (a string)"),
    ({"vocab_size": "1000"}, "vocab_size = '1000' is not a whole number (a string)"),
    ({"hidden_size": True}, "hidden_size = True is not a whole number (bool)"),
    ({"num_key_value_heads": 3}, "num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
    ({"hidden_size": 250, "head_dim": None}, "hidden_size = 250 is not a multiple of num_attention_heads = 4"),
    ({"num_experts_per_tok": -1}, "num_experts_per_tok = -1 must be 0 or more"),
    ({"model_type": "gpt_neox", "vocab_size": -5}, "vocab_size = -5 must be positive"),
    ({"model_type": "bert"}, "model_type 'bert' is an encoder-only model"),
    ({"model_type": "roberta"}, "model_type 'roberta' is an encoder-only model"),
    ({"model_type": "bart", "is_encoder_decoder": True}, "model_type 'bart' is an encoder-decoder"),
    ({"model_type": "xlm"}, "model_type 'xlm' without causal: true is an encoder"),
    (
        {"text_config": {"model_type": "gemma3_text", "hidden_size": 0}, "model_type": "gemma3"},
        "text_config.hidden_size = 0",
    ),
]


@pytest.mark.parametrize(("edit", "needle"), HF_CASES, ids=[n[:40] for _, n in HF_CASES])
def test_config_json_values_named(edit, needle, tmp_path, capsys):
    """A model directory whose config.json holds a value transformers refuses (or builds as an
    encoder): exit 2, the file, the key and the value named, never 'lacks ...' or int()'s error."""
    (tmp_path / "config.json").write_text(json.dumps(json.loads(TINY.read_text()) | edit))
    rc = cli.main(["estimate", "--model", str(tmp_path), "--gpu", "a100-80gb", "--seq-len", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and str(tmp_path / "config.json") in err, err
    assert "invalid literal" not in err and "lacks" not in err and "Traceback" not in err


def test_encoder_set_as_decoder_is_estimated(tmp_path, capsys):
    """The refusal is about what the config says: a BERT config with is_decoder: true is a causal LM."""
    (tmp_path / "config.json").write_text(
        json.dumps(json.loads(TINY.read_text()) | {"model_type": "bert", "is_decoder": True})
    )
    rc = cli.main(["estimate", "--model", str(tmp_path), "--gpu", "a100-80gb", "--seq-len", "64", "--attn", "sdpa"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "value", "bound"),
    [
        (["--maximize", "micro_batch", "--seq-len", "1"], 65535, "memfit's micro batch bound"),
        (["--maximize", "seq_len"], 128, "context (max_position_embeddings)"),
    ],
)
def test_fit_says_when_the_answer_is_the_search_bound(argv, value, bound, capsys):
    """`fit` on a tiny model: the answer is the bound of the search, and the output says so."""
    rc = cli.main(["fit", *argv, "--model", str(TINY), "--gpu", "a100-80gb"])
    out = capsys.readouterr().out
    assert rc == 0 and f"that fits with 7% headroom: {value} (the search's bound" in out and bound in out
    assert "not a memory limit" in out
    cli.main(["fit", *argv, "--model", str(TINY), "--gpu", "a100-80gb", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got[argv[1]] == value and got["limited_by"].endswith(f": {value}") and bound in got["limited_by"]


def test_fit_limited_by_memory_says_memory(capsys):
    assert (
        cli.main(
            [
                "fit",
                "--maximize",
                "seq_len",
                "--model",
                "llama-3.1-8b",
                "--gpu",
                "a100-80gb",
                "--num-gpus",
                "8",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["limited_by"] == "memory"


def test_lora_rank_with_full_finetune_warns(capsys):
    """search.lora_rank with finetune [full]: the config is valid (a template may keep it ready),
    and the user is told that no candidate uses it."""
    raw = _base()
    raw["search"]["lora_rank"] = [8, 32]
    WorkflowConfig.load(raw)
    err = capsys.readouterr().err
    assert "memfit: warning: search.lora_rank: [8, 32] does nothing with search.finetune ['full']" in err
    raw["search"]["finetune"] = ["full", "lora"]
    WorkflowConfig.load(raw)
    assert "warning" not in capsys.readouterr().err


def test_too_few_rows_for_one_global_batch(tok_dir, tmp_path):
    """prepare_data kept fewer rows than train.global_batch: refused after prepare_data (before
    calibration and probes), naming the rows, the global batch and both keys to change."""
    from memfit.workflow.search_checks import rows_problem

    src = tmp_path / "few.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{i} + 1", "response": str(i + 1)}) + "\n" for i in range(10)))
    data.prepare("sft", src, tok_dir, tmp_path / "prepared", max_len=32, eval_fraction=0.0)
    cfg = WorkflowConfig(_base())  # train.global_batch: 32
    problem = rows_problem(cfg, "sft", tmp_path / "prepared" / "stats.json")
    assert "10 training rows" in problem and "fewer than one global batch (train.global_batch: 32)" in problem
    assert "add rows to data.sft or lower train.global_batch" in problem
    raw = _base()
    raw["train"]["global_batch"] = 8
    assert rows_problem(WorkflowConfig(raw), "sft", tmp_path / "prepared" / "stats.json") is None


def test_snakemake_names_line_of_a_broken_default_config(tmp_path):
    """The default config/config.yaml with a YAML syntax error: file, line and column on the console."""
    wf = tmp_path / "wf"
    (wf / "config").mkdir(parents=True)
    (wf / "Snakefile").write_text((ROOT / "Snakefile").read_text())
    for name in ("workflow", "src", "scripts", "envs"):
        (wf / name).symlink_to(ROOT / name)
    (wf / "config" / "config.yaml").write_text("models:\n  x: {path: [a\nheadroom: 0.1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n"], capture_output=True, text=True, cwd=wf, timeout=300
    )
    assert proc.returncode != 0
    assert f"{wf / 'config' / 'config.yaml'}: YAML syntax error at line 3, column 9" in proc.stdout + proc.stderr


def test_check_config_names_line_of_a_configfile(tmp_path, capsys):
    """`memfit check-config FILE`: what Snakemake's --configfile reader cannot say."""
    bad = tmp_path / "c.yaml"
    bad.write_text("models:\n\t- x\n")
    assert cli.main(["check-config", str(bad)]) == 2
    assert f"memfit check-config: {bad}: YAML syntax error at line 2, column 1" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_base()))
    assert cli.main(["check-config", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: valid\n"


# ------------------------------------------------------------------------------ the docs' table
def _docs_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "errors.md").read_text()
    table = text.split("## Bad inputs and the answers they get", 1)[1].split("<!-- rows from other parts of #41 -->")[0]
    rows = []
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| input") and "`tests/" in line:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append(cells)
    return rows


def _needles() -> set[str]:
    cases = [n for _, n in CLI_CASES] + [n for _, n in CONFIG_CASES] + [n for _, n in HF_CASES]
    return {n.replace("{tmp}", "DIR") for n in cases} | {p for *_, p in DATA_CASES}


def test_docs_table_rows_are_tested():
    """docs/errors.md's table of bad inputs cannot drift: at least 100 rows, each naming a test
    that exists and a message that test asserts (a case's needle, or text in the test's file)."""
    rows = _docs_rows()
    assert len(rows) >= 100, len(rows)
    needles = _needles()
    for inp, where, message, exit_code, test in rows:
        path, name = test.strip("`").split("::")
        source = (ROOT / path).read_text()
        assert f"def {name}(" in source, test
        said = message.strip("`").replace("\\|", "|")
        assert any(said in n for n in needles) or said.replace("DIR", "{tmp}") in source, (said, test)
        assert inp and where and exit_code
