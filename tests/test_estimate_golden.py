"""No behaviour change: `estimate()`, `fit()` and the CLI table against outputs recorded before the
estimator was split into a package (tests/fixtures/estimate_golden.json).

The fixture holds each case's inputs and its recorded output; regenerate it only for an intended
change of the estimate (`python tests/test_estimate_golden.py --write`) and say why in the commit.
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path

import pytest

from memfit.estimate import Settings, estimate, fit, render
from memfit.estimate.models import catalog
from memfit.space import Candidate

FIXTURE = Path(__file__).parent / "fixtures" / "estimate_golden.json"

MODELS = [
    "llama-3.1-8b",
    "qwen2-7b",
    "qwen2.5-72b",
    "qwen3-8b",
    "glm-4-9b",
    "gemma-3-4b",
    "gemma-3-27b",
    "mistral-7b",
    "llama-2-7b",
]
GPUS = ["a100-80gb", "h100-80gb", "rtx4090", "v100-32gb", "a10", "cpu"]
SETTINGS = [
    {},
    {"scaled_buckets": False},
    {"overlap_comm": False},
    {"lora_targets": ["q_proj", "v_proj"]},
    {"lora_alpha_dropout": True},
    {"expandable_segments": True},
    {"variable_length": False},
    {"optimizer_impl": "foreach"},
    {"optimizer_impl": "single"},
    {"sub_group_size": 50_000_000},
    {"reduce_bucket_size": 200_000_000, "stage3_prefetch_bucket_size": 10_000_000},
]


def _cases(n: int = 260, seed: int = 14, methods: tuple[str, ...] = ("sft", "dpo")) -> list[dict]:
    """A fixed random sample over models, GPUs, methods and every candidate axis."""
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        zero = rng.choice([0, 1, 2, 3])
        finetune = rng.choice(["full", "lora", "qlora"])
        cand = {
            "zero": zero,
            "offload_optimizer": "none" if zero == 0 else rng.choice(["none", "cpu"]),
            "offload_param": rng.choice(["none", "cpu"]) if zero == 3 else "none",
            "pin_memory": rng.random() < 0.3,
            "grad_ckpt": rng.random() < 0.5,
            "attn": rng.choice(["flash", "sdpa", "eager"]),
            "finetune": finetune,
            "lora_rank": rng.choice([8, 16, 64]),
            "micro_batch": rng.choice([1, 2, 4]),
            "seq_len": rng.choice([128, 512, 2048, 4096]),
            "grad_accum": rng.choice([1, 4]),
            "precision": rng.choice(["bf16", "bf16", "fp16", "fp32"]),
            "ref": rng.choice(["model", "precomputed"] + (["adapter"] if finetune != "full" else [])),
        }
        if zero == 3 and cand["offload_optimizer"] == "cpu" and rng.random() < 0.4:
            cand["offload_ratio"] = rng.choice([0.3, 0.5, 0.9])
        try:
            Candidate(**cand)
        except ValueError:
            continue
        settings = dict(rng.choice(SETTINGS))
        if settings.get("lora_targets") and finetune == "full":
            settings = {}
        out.append(
            {
                "model": rng.choice(MODELS),
                "gpu": rng.choice(GPUS),
                "num_gpus": rng.choice([1, 2, 4, 8]),
                "num_nodes": rng.choice([1, 1, 1, 2]),
                "method": rng.choice(methods),
                "cand": cand,
                "host_memory_gb": rng.choice([None, None, 256.0]),
                "budget_bytes": rng.choice([None, None, 24 * 10**9]),
                "settings": settings,
            }
        )
    return out


FIT_CASES = [
    {
        "model": "llama-3.1-8b",
        "gpu": "a100-80gb",
        "num_gpus": 1,
        "method": "sft",
        "cand": {"zero": 3, "grad_ckpt": True, "attn": "flash"},
        "maximize": "seq_len",
    },
    {
        "model": "glm-4-9b",
        "gpu": "a100-80gb",
        "num_gpus": 8,
        "method": "dpo",
        "cand": {"zero": 3, "grad_ckpt": True, "attn": "flash", "seq_len": 1024},
        "maximize": "micro_batch",
    },
    {
        "model": "gemma-3-4b",
        "gpu": "rtx4090",
        "num_gpus": 4,
        "method": "sft",
        "cand": {"zero": 2, "finetune": "lora", "attn": "sdpa"},
        "maximize": "seq_len",
    },
    {
        "model": "qwen2.5-72b",
        "gpu": "rtx4090",
        "num_gpus": 1,
        "method": "sft",
        "cand": {"zero": 0},
        "maximize": "seq_len",
    },
]


def _settings(raw: dict) -> Settings:
    raw = dict(raw)
    if raw.get("lora_targets") is not None:
        raw["lora_targets"] = tuple(raw["lora_targets"])
    return Settings(**raw)


def _run(case: dict) -> dict:
    arch, gpu = catalog.model(case["model"]), catalog.gpu(case["gpu"])
    cand = Candidate(**case["cand"])
    e = estimate(
        arch,
        gpu,
        case["num_gpus"],
        case["num_nodes"],
        case["method"],
        cand,
        case["host_memory_gb"],
        case["budget_bytes"],
        _settings(case["settings"]),
    )
    table = render(e, arch, gpu, cand, case["num_gpus"], case["num_nodes"], case["method"])
    return {"estimate": e.to_dict(), "table": table}


def _run_fit(case: dict) -> dict:
    arch, gpu = catalog.model(case["model"]), catalog.gpu(case["gpu"])
    best, e = fit(arch, gpu, case["num_gpus"], 1, case["method"], Candidate(**case["cand"]), case["maximize"])
    return {"best": best, "estimate": e.to_dict() if e else None}


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("i", range(260))
def test_estimate_matches_recorded_output(i):
    case = _load()["estimate"][i]
    got = json.loads(json.dumps(_run(case["input"])))
    assert got == case["output"], f"case {i}: {case['input']}"


# the preference methods beside DPO (issue #44), recorded when the estimator first priced them
METHOD_CASES = functools.partial(_cases, 48, 44, ("rm", "orpo", "simpo", "kto"))


@pytest.mark.parametrize("i", range(48))
def test_preference_method_matches_recorded_output(i):
    case = _load()["methods"][i]
    got = json.loads(json.dumps(_run(case["input"])))
    assert got == case["output"], f"method case {i}: {case['input']}"


def test_method_fixture_covers_the_four_methods_and_their_verdicts():
    cases = _load()["methods"]
    assert {c["input"]["method"] for c in cases} == {"rm", "orpo", "simpo", "kto"}
    assert {c["input"]["cand"]["finetune"] for c in cases} == {"full", "lora", "qlora"}
    outputs = [c["output"]["estimate"] for c in cases]
    assert any(o["fits"] for o in outputs) and any(not o["fits"] and not o["invalid"] for o in outputs)
    # a reward model never holds vocabulary logits
    rm = [o for c, o in zip(cases, outputs, strict=True) if c["input"]["method"] == "rm" and not o["invalid"]]
    assert rm and all(o["breakdown"]["logits"] == 0 for o in rm)


@pytest.mark.parametrize("i", range(len(FIT_CASES)))
def test_fit_matches_recorded_output(i):
    case = _load()["fit"][i]
    got = json.loads(json.dumps(_run_fit(case["input"])))
    assert got == case["output"], f"fit case {i}: {case['input']}"


def test_fixture_covers_the_axes():
    cases = [c["input"] for c in _load()["estimate"]]
    models = {c["model"] for c in cases}
    assert {"gemma-3-4b", "glm-4-9b"} <= models or {"gemma-3-27b", "glm-4-9b"} <= models
    for key, values in [
        ("zero", {0, 1, 2, 3}),
        ("finetune", {"full", "lora", "qlora"}),
        ("grad_ckpt", {True, False}),
        ("offload_optimizer", {"none", "cpu"}),
        ("attn", {"flash", "sdpa", "eager"}),
    ]:
        assert {c["cand"][key] for c in cases} == values, key
    assert {c["method"] for c in cases} == {"sft", "dpo"}
    outputs = [c["output"]["estimate"] for c in _load()["estimate"]]
    assert any(o["fits"] for o in outputs) and any(not o["fits"] and not o["invalid"] for o in outputs)
    assert any(o["invalid"] for o in outputs)


def write() -> None:
    data = {
        "estimate": [{"input": c, "output": _run(c)} for c in _cases()],
        "fit": [{"input": c, "output": _run_fit(c)} for c in FIT_CASES],
        "methods": [{"input": c, "output": _run(c)} for c in METHOD_CASES()],
    }
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__" and "--write" in sys.argv:
    write()
