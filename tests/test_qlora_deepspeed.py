"""QLoRA in the real trainer on the CPU: bitsandbytes' 4-bit base, peft LoRA, DeepSpeed (gloo).

SFT on 2 ranks under ZeRO-2 and ZeRO-3 (ZeRO-3 once interrupted and resumed), DPO on 1 rank under
ZeRO-0 with the adapter-disabled base as the reference. The estimator against QLoRA probes:
tests/test_estimate_deepspeed.py (two shapes) and benchmarks/bench_qlora_memory.py (all)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from deepspeed_runs import base_run, run, run_side_by_side

from memfit.train.run_config import RunConfig

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.slow

QLORA = {"finetune": "qlora", "lora_rank": 8}


def _losses(rows, split="train"):
    return [r["loss"] for r in rows if r["split"] == split]


@pytest.fixture(scope="module")
def runs(demo_model, demo_data, tmp_path_factory):
    """`sft`: 4 steps, 2 ranks, ZeRO-2, adapter export, checkpoints at 2 and 4; `dpo`: 10 steps of
    16 pairs on 1 rank, ZeRO-0, ref=adapter, merged export. The ZeRO-2 resume: the QLoRA stage of
    .ci/run (verify_resume of SFT and DPO, ZeRO-0/2, weights bit for bit) and the sweep
    (benchmarks/sweeps.sh); the suite resumes ZeRO-3 (`z3_runs`)."""
    root = tmp_path_factory.mktemp("qlora")
    sft = dataclasses.replace(
        base_run(demo_model, demo_data, root / "sft", zero=2, **QLORA),
        max_steps=4,
        save_every=2,
        eval_every=2,
        export_format="adapter",
    )
    dpo = dataclasses.replace(
        base_run(demo_model, demo_data, root / "dpo", method="dpo", zero=0, ref="adapter", grad_accum=2, **QLORA),
        max_steps=10,
        save_every=0,
        eval_every=10,
    )
    with ThreadPoolExecutor(max_workers=2) as pool:  # the 2-rank SFT run beside the 1-rank DPO run
        sft_rows, dpo_rows = pool.submit(run, sft), pool.submit(run, dpo, 1)
        sft_rows, dpo_rows = sft_rows.result(), dpo_rows.result()
    return {"sft": (Path(sft.out_dir), sft_rows), "dpo": (Path(dpo.out_dir), dpo_rows)}


def _resumed(sft: RunConfig) -> dict:
    """`sft` and its copy "killed" after step 3 (checkpoint at 2) and relaunched: {"sft", "first", "resumed"}."""
    root = Path(sft.out_dir).parent
    resumed = dataclasses.replace(sft, out_dir=str(root / f"resumed-{Path(sft.out_dir).name}"))
    sft_rows, first = run_side_by_side(sft, dataclasses.replace(resumed, stop_after_step=3))

    class Runs(dict):
        """The relaunch made at the first read of "resumed" (one test may take at most 60 s)."""

        def __missing__(self, key):
            if key != "resumed":
                raise KeyError(key)
            self[key] = (Path(resumed.out_dir), run(resumed))
            return self[key]

    return Runs(sft=(Path(sft.out_dir), sft_rows), first=first)


def _sft_config(runs, zero: int, name: str) -> RunConfig:
    sft = json.loads((runs["sft"][0] / "run.json").read_text())
    return RunConfig(
        **sft | {"candidate": sft["candidate"] | {"zero": zero}, "out_dir": str(runs["sft"][0].parent / name)}
    )


@pytest.fixture(scope="module")
def z3_runs(runs):
    """`runs`' SFT under ZeRO-3 (the packed 4-bit weights partitioned), and resumed."""
    return _resumed(_sft_config(runs, 3, "sft-z3"))


@pytest.fixture(scope="module")
def z2_runs(runs):
    """`runs`' SFT under ZeRO-2 again, and resumed (the sweep)."""
    return _resumed(_sft_config(runs, 2, "sft-z2"))


def test_sft_on_two_ranks_learns(runs):
    _, rows = runs["sft"]
    ev = _losses(rows, "eval")
    assert ev[-1] < ev[0] * 0.9, f"held-out loss did not fall: {ev}"


def test_zero3_shards_the_4bit_base_and_trains_as_zero2_does(runs, z3_runs):
    """ZeRO-3 partitions the packed 4-bit weights (bnb_4bit_quant_storage) and computes the
    same steps: the losses of ZeRO-2 to float32 rounding."""
    z2 = [(r["step"], r["split"], r["loss"]) for r in runs["sft"][1]]
    z3 = [(r["step"], r["split"], r["loss"]) for r in z3_runs["sft"][1]]
    assert [k[:2] for k in z3] == [k[:2] for k in z2]
    assert [k[2] for k in z3] == pytest.approx([k[2] for k in z2], rel=1e-5)


@pytest.mark.parametrize("zero", [pytest.param(2, marks=pytest.mark.sweep), 3])
def test_resume_is_bit_exact_and_checkpoints_hold_the_adapter_only(request, zero):
    runs = request.getfixturevalue(f"z{zero}_runs")
    out, rows = runs["resumed"]
    _, ref = runs["sft"]
    assert max(r["step"] for r in runs["first"]) == 3
    # the learning rate too: the first resumed step logged 0.0 (WarmupCosineLR's get_last_lr)
    assert [(r["step"], r["split"], r["loss"], r.get("lr")) for r in rows] == [
        (r["step"], r["split"], r["loss"], r.get("lr")) for r in ref
    ]
    assert torch.equal(_adapter(out), _adapter(runs["sft"][0]))  # the exports, bit for bit
    states = "mp_rank_00_model_states.pt" if zero < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    module = torch.load(out / "checkpoints/step00000004" / states, weights_only=False)["module"]
    assert module and all(".lora_A." in k or ".lora_B." in k for k in module), sorted(module)[:5]


def _adapter(run_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    state = load_file(run_dir / "model/adapter_model.safetensors")
    return torch.cat([state[k].flatten().float() for k in sorted(state)])


def test_the_exported_adapter_loads_in_peft_on_the_base_model(runs, demo_model):
    from peft import PeftModel

    from memfit.space import Candidate
    from memfit.train.modeling import load_model

    out, _ = runs["sft"]
    cfg = json.loads((out / "model/adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(demo_model) and cfg["r"] == 8
    cand = Candidate(zero=2, precision="fp32", finetune="qlora", lora_rank=8)
    model = PeftModel.from_pretrained(load_model(str(demo_model), cand, trainable=False), out / "model")
    trained = torch.load(out / "checkpoints/step00000004/mp_rank_00_model_states.pt", weights_only=False)["module"]
    loaded = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[n], trained[n].to(loaded[n].dtype)) for n in trained)


def test_dpo_with_the_adapter_disabled_base_as_reference_learns(runs):
    out, rows = runs["dpo"]
    train = [r for r in rows if r["split"] == "train"]
    assert train[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # -log sigmoid(0): policy == reference
    ev = _losses(rows, "eval")
    assert ev[0] == pytest.approx(0.6931, abs=1e-3) and ev[-1] < ev[0] - 0.01, ev
    assert sum(r["rewards/margins"] for r in train[5:]) > 0  # chosen pulled above rejected
    # the merged export: the adapter merged into the unquantized base, a plain HF model
    merged = json.loads((out / "model/config.json").read_text())
    assert "quantization_config" not in merged
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert all(p.dtype == torch.float32 for p in model.parameters())
