"""The `kernels: liger` lever (run config `kernels`, docs/speed.md; memfit.train.liger).

Liger-Kernel's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy run on a CUDA GPU; on the CPU
they run here under Triton's interpreter (TRITON_INTERPRET=1): the same Triton kernels, executed in
numpy. With them, memfit's SFT loss and DPO loss (full and LoRA) and every gradient equal memfit's
own full-logits loss in fp32 on the demo model. Where the package is missing, or neither a GPU nor
the interpreter is there, a run asking for it is refused before anything loads, naming the key.
The tests that run Liger's kernels are skipped where liger-kernel and triton are not installed
(`pip install '.[liger]'`; not part of the CPU CI: triton alone is about 1 GB installed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from collections import Counter

import pytest
import torch

from memfit import cli, data
from memfit.space import Candidate
from memfit.train.modeling import load_model
from memfit.train.steps import StepRunner

HAVE_LIGER = all(importlib.util.find_spec(p) is not None for p in ("liger_kernel", "triton"))
# Triton's interpreter is chosen when triton.jit decorates a function (triton/runtime/jit.py reads
# TRITON_INTERPRET then), its own library's too: it must be set before anything imports Triton.
_TOO_LATE = "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if HAVE_LIGER and not torch.cuda.is_available() and not _TOO_LATE:
    os.environ["TRITON_INTERPRET"] = "1"  # Liger's kernels on the CPU (memfit.train.liger.interpreted)
needs_liger = pytest.mark.skipif(
    not HAVE_LIGER or (_TOO_LATE and not torch.cuda.is_available()),
    reason="liger-kernel and triton are not installed (pip install '.[liger]')"
    if not HAVE_LIGER
    else "Triton was imported before this module could set TRITON_INTERPRET=1: run with it in the environment",
)


@pytest.fixture
def restore_llama_module(monkeypatch):
    """Liger patches transformers' modeling_llama module (the rotary function, the RMSNorm and MLP
    classes later models are built from); put them back after each test, so a reference model built
    in a later test is transformers' own."""
    from transformers.models.llama import modeling_llama as ml

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(ml, name, getattr(ml, name))


@pytest.fixture(scope="module")
def rows(demo_model, tmp_path_factory, repo):
    """Two SFT rows and two DPO pairs of the demo of different lengths (padding and masking differ)."""
    out = tmp_path_factory.mktemp("liger")
    got = {}
    for method in ("sft", "dpo"):
        data.prepare(method, repo / f"data/demo/{method}.jsonl", demo_model, out / method, max_len=24)
        split = data.load_split(out / method, "train")
        length = (lambda r: len(r["input_ids"])) if method == "sft" else (lambda r: len(r["chosen_ids"]))
        first = split[0]
        got[method] = [first, next(r for r in split if length(r) != length(first))]
    return got


def _step(demo_model, rows, method: str, finetune: str, kernels: str):
    """One micro batch's loss, metrics and gradients (fp32, sdpa) with kernels none or liger."""
    from memfit.train import liger

    ref = {"dpo": "adapter" if finetune == "lora" else "precomputed"}.get(method)
    cand = Candidate.from_dict({"attn": "sdpa", "precision": "fp32", "finetune": finetune, "lora_rank": 8, "ref": ref})
    torch.manual_seed(0)
    model = load_model(str(demo_model), cand, trainable=True)
    if finetune == "lora":  # B != 0, so the adapter changes the policy and its gradients reach A
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    if kernels == "liger":
        said = liger.apply(model)
        assert "RMSNorm x9, SwiGLU x4, RoPE (liger)" in said  # 4 layers x 2 norms + the final one
    model.train()
    if method == "dpo" and ref == "precomputed":
        rows = [dict(r, ref_chosen_logps=-30.0, ref_rejected_logps=-31.5) for r in rows]
    runner = StepRunner(method, model, None, 0, ref=ref, loss_impl="liger" if kernels == "liger" else "full")
    loss, metrics, tokens = runner.loss(rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), metrics, tokens, grads


@needs_liger
@pytest.mark.parametrize("method", ["sft", "dpo"])
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_liger_loss_and_gradients_equal_memfits_full_loss(demo_model, rows, restore_llama_module, method, finetune):
    """fp32: the loss, DPO's metrics (log-probs, rewards) and every trainable gradient through Liger's
    kernels agree with memfit's full-logits loss: the same semantics (TRL's), other kernels."""
    full = _step(demo_model, rows[method], method, finetune, "none")
    lig = _step(demo_model, rows[method], method, finetune, "liger")
    assert lig[0] == pytest.approx(full[0], abs=1e-5)
    assert lig[1].keys() == full[1].keys()
    for key, value in full[1].items():
        assert lig[1][key] == pytest.approx(value, abs=1e-4), key
    assert lig[2] == full[2]
    assert lig[3].keys() == full[3].keys() and len(full[3]) > 0
    for name, g in full[3].items():
        torch.testing.assert_close(lig[3][name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-8, msg=name)


@needs_liger
def test_liger_runs_its_triton_kernels(demo_model, rows, restore_llama_module, monkeypatch):
    """The equality above is Liger's kernels at work, not a fallback to torch: one SFT step launches
    Liger's RMSNorm, RoPE, SwiGLU and cross-entropy kernels, forward and backward."""
    if torch.cuda.is_available():
        pytest.skip("counts the Triton interpreter's launches: on a GPU the kernels are compiled")
    from triton.runtime import interpreter as interp

    launched: Counter[str] = Counter()
    call = interp.GridExecutor.__call__

    def counting(self, *args, **kwargs):
        launched[self.fn.__name__] += 1
        return call(self, *args, **kwargs)

    monkeypatch.setattr(interp.GridExecutor, "__call__", counting)
    _step(demo_model, rows["sft"], "sft", "full", "liger")
    names = set(launched)
    for part in ("rms_norm_forward", "rms_norm_backward", "swiglu", "rope", "cross_entropy"):
        assert any(part in n for n in names), (part, sorted(names))
    assert any("swiglu" in n and "backward" in n for n in names)
    # the loss's kernel runs in the forward (log-probs) and again in the backward (the gradient,
    # recomputed chunk by chunk with the upstream per-token gradient folded in)
    assert launched["liger_cross_entropy_kernel"] >= 2


@needs_liger
def test_liger_needs_a_plain_linear_head(demo_model, restore_llama_module):
    """An adapter on the head (lm_head among lora_targets) is not a plain linear layer: refused by
    name rather than trained through the wrong weight."""
    from memfit.train.liger import LigerHead

    cand = Candidate.from_dict({"attn": "sdpa", "precision": "fp32", "finetune": "lora", "lora_rank": 8})
    model = load_model(str(demo_model), cand, trainable=True, lora={"targets": ["q_proj", "lm_head"]})
    with pytest.raises(ValueError, match="kernels: liger needs the model's output head to be a plain linear"):
        LigerHead(model)


def _run_config(tmp_path, demo_model, demo_data, method="sft", **extra):
    cfg = {
        "method": method,
        "model_path": str(demo_model),
        "data_dir": str(demo_data / ("sft" if method == "sft" else "dpo")),
        "out_dir": str(tmp_path / "out"),
        "candidate": {"zero": 0, "precision": "fp32", "seq_len": 32, "micro_batch": 2, "ref": "model"},
        "max_steps": 1,
        **extra,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "method, kernels, expected",
    [
        ("sft", "fast", "kernels: 'fast' is not allowed (allowed: 'none', 'liger')"),
        ("kto", "liger", "kernels: liger applies to sft and dpo only, not kto"),
    ],
)
def test_bad_kernels_value_is_refused_at_the_cli(tmp_path, demo_model, demo_data, capsys, method, kernels, expected):
    path = _run_config(tmp_path, demo_model, demo_data, method, kernels=kernels)
    assert cli.main(["launch", "--config", str(path), "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine with liger-kernel the run is allowed")
def test_liger_without_gpu_or_package_is_refused_before_loading(tmp_path, demo_model, demo_data, capsys, monkeypatch):
    """No CUDA GPU and no interpreter (or no liger-kernel at all): the rank refuses before it loads
    the model, `memfit launch` prints the reason once and exits 2."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = _run_config(tmp_path, demo_model, demo_data, kernels="liger")
    assert cli.main(["launch", "--config", str(path), "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    why = "needs a CUDA GPU" if HAVE_LIGER else "needs the liger-kernel package"
    assert f"kernels: liger {why}" in err and "set kernels: none" in err and "Traceback" not in err
    assert not list((tmp_path / "out").glob("checkpoints/*"))


@needs_liger
def test_liger_for_a_model_type_it_does_not_cover_is_refused(tmp_path):
    from memfit.train import liger

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "memfit-unknown"}))
    why = liger.problem(str(tmp_path))
    assert why is not None and why.startswith("kernels: liger has no kernels for model type 'memfit-unknown'")
    assert "llama" in why and str(tmp_path / "config.json") in why


# --------------------------------------------------------------------------- exports
@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_exports_carry_the_liger_kernels(tmp_path, monkeypatch, method):
    """TRL/TrainingArguments `use_liger_kernel`, LLaMA-Factory `enable_liger_kernel`, OpenRLHF
    `--ds.use_liger_kernel`: set with kernels liger, absent without; each a field or flag the trainer
    declares (checked as tests/test_exports.py checks the others)."""
    from test_exports import LLAMAFACTORY_FIELDS, OPENRLHF_FLAGS, _exported, _on_this_machine, _plan
    from transformers import HfArgumentParser, TrainingArguments

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # TrainingArguments sets it; restored after
    assert "enable_liger_kernel" in LLAMAFACTORY_FIELDS and "--ds.use_liger_kernel" in OPENRLHF_FLAGS[method]
    for kernels in ("liger", "none"):
        plan = _plan(tmp_path / kernels, method, {"zero": 2, "precision": "bf16"}, kernels=kernels)
        y, argv, _, _, _ = _exported(plan)
        from memfit import exports

        hf = json.loads(exports.write_all(plan)["hf_args"].read_text())
        hf.pop("_memfit")
        (args,) = HfArgumentParser(TrainingArguments).parse_dict(_on_this_machine(hf), allow_extra_keys=False)
        on = kernels == "liger"
        assert args.use_liger_kernel is on
        assert y.get("enable_liger_kernel", False) is on
        assert ("--ds.use_liger_kernel" in argv) is on


# --------------------------------------------------------------------------- DeepSpeed
@pytest.fixture(scope="module")
def small_data(demo_model, tmp_path_factory, repo):
    """The first 40 demo rows of each method, 2 of them held out: under the interpreter a run's
    evaluation at step 0 costs seconds a row."""
    root = tmp_path_factory.mktemp("liger_data")
    for method in ("sft", "dpo"):
        src = root / f"{method}.jsonl"
        src.write_text("".join((repo / f"data/demo/{method}.jsonl").read_text().splitlines(keepends=True)[:40]))
        data.prepare(method, src, demo_model, root / method, max_len=20, eval_fraction=0.05)
    return root


@needs_liger
@pytest.mark.slow
@pytest.mark.parametrize(
    "method, cand, steps",
    [
        # the demo ties its head to the embeddings: ZeRO-3 gathers it for the head's call; two steps
        ("sft", {"zero": 3}, 2),
        # one step (the evaluation and step 1's forward, policy and adapter-disabled reference):
        # a second one would take this test past a minute on 2 cores under the interpreter
        ("dpo", {"zero": 3, "finetune": "lora", "lora_rank": 8, "ref": "adapter"}, 1),
    ],
    ids=["sft-z3", "dpo-z3-lora"],
)
def test_liger_trains_as_the_full_loss_under_zero3(demo_model, small_data, tmp_path, method, cand, steps):
    """The real trainer on 2 ranks (gloo): the evaluation at step 0 and the training steps with
    kernels liger give the losses of kernels none within 1e-4 (SFT's step 2 after step 1's update:
    the gradients agree too), under ZeRO-3, whose partitioned head weight Liger's loss reads inside
    the head module's call, forward and backward, as the chunked loss does."""
    from deepspeed_runs import base_run, run_side_by_side

    cfgs = [
        dataclasses.replace(
            base_run(demo_model, small_data, tmp_path / kernels, method=method, micro_batch=1, **cand),
            max_steps=steps,
            warmup_steps=0,  # step 1 trains at the full rate: step 2's loss shows its gradients
            eval_every=0,
            save_every=0,
            export=False,
            kernels=kernels,
        )
        for kernels in ("none", "liger")
    ]
    none, lig = run_side_by_side(*cfgs)
    pairs = [(a, b) for a, b in zip(none, lig, strict=True) if "loss" in a]
    assert [(a["step"], a["split"]) for a, _ in pairs] == [(0, "eval")] + [(k, "train") for k in range(1, steps + 1)]
    for a, b in pairs:
        assert (a["step"], a["split"]) == (b["step"], b["split"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
