import pytest

from memfit.space import Candidate, enumerate_space


def test_candidate_refuses_combinations_deepspeed_cannot_run():
    with pytest.raises(ValueError, match="parameter offload.*needs ZeRO-3"):
        Candidate(zero=2, offload_param="cpu")
    with pytest.raises(ValueError, match="offload_ratio needs ZeRO-3 with offload_optimizer=cpu"):
        Candidate(zero=3, offload_ratio=0.5)
    with pytest.raises(ValueError, match="optimizer offload needs ZeRO stage"):
        Candidate(zero=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="ref=adapter needs finetune=lora"):
        Candidate(ref="adapter")
    Candidate(zero=3, offload_optimizer="cpu", offload_ratio=0.3)  # partial offload is fine


def test_enumerate_skips_invalid_and_collapses_irrelevant_knobs():
    cands = list(
        enumerate_space(
            {"zero": [0, 2, 3], "offload_optimizer": ["none", "cpu"], "pin_memory": [False, True]},
            fixed={"seq_len": 64},
        )
    )
    # zero=0 cannot offload; pin_memory only matters with offload: 1 + 2*(1 + 2) = 7
    assert len(cands) == 7
    assert len({c.id for c in cands}) == 7
    assert all(c.seq_len == 64 for c in cands)
    assert not any(c.zero == 0 and c.offload_optimizer == "cpu" for c in cands)


def test_unknown_axis_is_named():
    with pytest.raises(ValueError, match="unknown search-space key 'zero_stage'"):
        list(enumerate_space({"zero_stage": [1]}))


def test_roundtrip_and_id_are_stable():
    c = Candidate(zero=3, offload_optimizer="cpu", pin_memory=True, grad_ckpt=True, micro_batch=4, seq_len=2048)
    assert Candidate.from_dict(c.to_dict()) == c
    assert c.id == "z3-oo-pin-gc-sdpa-full-mb4-s2048-bf16-ref-model"
    with pytest.raises(ValueError, match="unknown candidate keys"):
        Candidate.from_dict({**c.to_dict(), "stage": 3})


def test_sft_ids_name_no_dpo_reference_and_dpo_ids_stay_as_they_were(repo, monkeypatch):
    """The {cand} wildcard, probe files and the report show these ids: an SFT run has no reference
    model, so `ref-model` (a DPO-only lever) is not in its ids; DPO ids are unchanged."""
    import yaml

    from memfit.train.run_config import RunConfig
    from memfit.workflow.config import WorkflowConfig

    monkeypatch.chdir(repo)
    cfg = WorkflowConfig.load(yaml.safe_load((repo / "config/config.yaml").read_text()))
    sft, dpo = cfg.candidates("sft"), cfg.candidates("dpo")
    assert sft and not any("ref-" in c.id for c in sft)
    assert "z3-gc-sdpa-full-mb4-s24-fp32" in {c.id for c in sft}
    assert {c.id for c in dpo} >= {
        "z0-nogc-sdpa-full-mb8-s24-fp32-ref-model",
        "z3-gc-sdpa-full-mb4-s24-fp32-ref-precomputed",
    }
    # a DPO run without a reference mode is refused, naming the key
    with pytest.raises(ValueError, match=r"(?i)dpo needs a reference mode \(search\.ref"):
        RunConfig(method="dpo", model_path="m", data_dir="d", out_dir="o", candidate=sft[0].to_dict())
