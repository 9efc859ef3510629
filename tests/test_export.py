"""Adapter-only exports outside DeepSpeed: verify_resume compares the adapter weights."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from memfit.workflow.resume_check import compare_runs


def _run_dir(path, losses, weight):
    (path / "model").mkdir(parents=True)
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "split": "train", "loss": v}) + "\n" for s, v in enumerate(losses, 1))
    )
    save_file({"base_model.model.lm_head.lora_A.weight": weight}, str(path / "model/adapter_model.safetensors"))


def test_compare_runs_reads_an_adapter_only_export(tmp_path):
    w = torch.randn(4, 8)
    _run_dir(tmp_path / "a", [3.0, 2.0, 1.0], w)
    _run_dir(tmp_path / "b", [3.0, 2.0, 1.0], w.clone())
    _run_dir(tmp_path / "c", [3.0, 2.0, 1.0], w + 1e-3)
    same = compare_runs(tmp_path / "a", tmp_path / "b", from_step=1, rtol=1e-5)
    assert same["passed"] and same["weights_bitwise_equal"] and same["steps_compared"] == 2
    other = compare_runs(tmp_path / "a", tmp_path / "c", from_step=1, rtol=1e-5)
    assert not other["weights_bitwise_equal"] and other["weights_max_abs_diff"] > 9e-4


def test_merged_lora_state_equals_peft_merge_and_unload(demo_model):
    """What a ZeRO-3 merged LoRA export writes (merged in the gathered state dict) is bit for bit
    what peft's own merge_and_unload gives."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memfit.train.modeling import _merged_lora_state

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(demo_model),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # peft starts B at zero: nothing to merge
    ours = _merged_lora_state(model, {k: v.clone() for k, v in model.state_dict().items()})
    want = model.merge_and_unload().state_dict()
    assert ours.keys() == want.keys()
    assert all(torch.equal(ours[k], want[k]) for k in want)
