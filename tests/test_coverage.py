"""A sample of transformers' causal-LM types, each as a tiny random model of its own defaults:
estimated (parameters exact) and one real CPU training step measured against the estimate
(benchmarks/bench_coverage.py runs every type; docs/architectures.md has its table)."""

from __future__ import annotations

import pytest

from memfit.estimate.coverage import coverage_row, tiny_config

# One of each kind the issue names: dense (llama, hand-written card), GPT-2 style (Conv1D,
# learned positions), sliding + full attention (olmo3), MoE with attention sinks and no SDPA
# path (gpt_oss), linear attention + MoE (qwen3_next), latent attention with dense and MoE
# layers (deepseek_v3), Mamba hybrid (falcon_h1), pure state-space (mamba), a multimodal wrapper
# (gemma3: its text model), a dense first layer before MoE (glm4_moe), NoPE layers (smollm3),
# per-layer inputs (gemma4_text).
FULL = ["llama", "gpt2", "olmo3", "gpt_oss", "qwen3_next", "deepseek_v3", "falcon_h1", "mamba", "gemma3", "glm4_moe",
        "smollm3", "gemma4_text"]  # fmt: skip
# LoRA: Conv1D linears (gpt2), linear attention (qwen3_next), frozen experts traced in fp32
# (granitemoe: torch._grouped_mm's autograd, memfit.estimate.models.fake_mode), and the default targets
# where plain all-linear fails (falcon_h1: peft refuses Mamba's out_proj; llama4_text: its router
# returns a tuple; memfit.train.lora).
LORA = ["gpt2", "qwen3_next", "granitemoe", "falcon_h1", "llama4_text"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traces"))


@pytest.fixture(autouse=True)
def _trace_here(monkeypatch):
    # a tiny model's trace takes less than a child process's start-up (trace._trace_in_children)
    monkeypatch.setenv("MEMFIT_TRACE_IN_PROCESS", "1")


@pytest.mark.parametrize(
    "model_type, finetune", [(t, "full") for t in FULL] + [(t, "lora") for t in LORA], ids=lambda x: x
)
def test_tiny_model_step_matches_its_estimate(model_type, finetune, cache):
    row = coverage_row(model_type, finetune, trace_cache=cache)
    assert row.reason == "", row.reason
    assert row.params_exact
    assert abs(row.error) <= 0.05, (row.predicted, row.measured)


def test_tiny_configs_keep_the_type_and_shrink_it():
    cfg = tiny_config("qwen3_next")
    assert cfg["model_type"] == "qwen3_next" and cfg["hidden_size"] == 128 and cfg["num_hidden_layers"] == 4
    assert len(cfg["layer_types"]) == 4 and cfg["num_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert tiny_config("gemma3")["model_type"] == "gemma3_text"  # a wrapper's text model
