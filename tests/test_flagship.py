"""Today's flagship models, none with a hand-written card: their catalog entries (config/models.yaml,
published config.json fields) counted on transformers' own model match the figures their model
cards publish, and `memfit estimate` answers for each (issue 21's list)."""

from __future__ import annotations

import pytest

from memfit.estimate.models import catalog

# name -> (published total parameters, counted with the vision tower?, where it is published).
# Each entry's comment in config/models.yaml quotes the sentence.
PUBLISHED = {
    "qwen3.5-27b": (27e9, False, "https://huggingface.co/Qwen/Qwen3.5-27B"),  # 27.36B with vision: +1.3%
    "qwen3.5-35b-a3b": (35e9, True, "https://huggingface.co/Qwen/Qwen3.5-35B-A3B"),
    "qwen3.5-122b-a10b": (122e9, True, "https://huggingface.co/Qwen/Qwen3.5-122B-A10B"),
    "qwen3.5-397b-a17b": (397e9, True, "https://huggingface.co/Qwen/Qwen3.5-397B-A17B"),
    "gemma-4-31b": (30.7e9, False, "https://huggingface.co/google/gemma-4-31B-it"),
    "gemma-4-26b-a4b": (25.2e9, False, "https://huggingface.co/google/gemma-4-26B-A4B-it"),
    "gpt-oss-20b": (20.91e9, False, "https://arxiv.org/abs/2508.10925"),
    "gpt-oss-120b": (116.83e9, False, "https://arxiv.org/abs/2508.10925"),
    "llama-4-scout-17b-16e": (109e9, True, "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E"),
    "olmo-3-7b": (7.3e9, False, "https://huggingface.co/allenai/Olmo-3-1025-7B"),
    "smollm3-3b": (3.08e9, False, "https://huggingface.co/HuggingFaceTB/SmolLM3-3B"),
    "deepseek-v3.2": (671e9, False, "https://huggingface.co/deepseek-ai/DeepSeek-V3.2"),
    "qwen3-next-80b-a3b": (80e9, False, "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct"),
}
# Outside 0.5%, each for a stated reason (config/models.yaml says more):
# - glm-4.5-air: "106B" (github.com/zai-org/GLM-4.5) is rounded; transformers builds 106.85B
#   (+0.80%) and drops the checkpoint's multi-token-prediction layer, which no fine-tune trains;
# - ministral-3-8b: no published config.json was found offline; the entry is transformers'
#   Ministral3Config defaults (8.49B text, 8.4B published for the vision-language checkpoint).
APPROXIMATE = {"glm-4.5-air": (106e9, False, 0.01)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_flagship_totals_match_the_published_figures(name):
    published, with_vision, _ = PUBLISHED[name]
    arch = catalog.model(name, allow_moe=True)
    assert arch.generic
    total = arch.num_params() + (arch.vision_params if with_vision else 0)
    assert abs(total / published - 1) <= 0.005, (total, published)


def test_glm_4_5_air_is_within_the_rounding_of_its_card():
    published, _, tolerance = APPROXIMATE["glm-4.5-air"]
    assert abs(catalog.model("glm-4.5-air", allow_moe=True).num_params() / published - 1) <= tolerance


@pytest.mark.parametrize("name", ["smollm3-3b", "gpt-oss-20b"])
def test_flagships_estimate_from_the_cli(name, capsys, tmp_path, monkeypatch):
    """The issue's command (shorter sequences, to stay quick on 2 cores): exit 0, a verdict, the
    activations traced (benchmarks/bench_flagship.py times every flagship at 4,096 tokens)."""
    from memfit.estimate import main

    monkeypatch.setenv("MEMFIT_TRACE_CACHE", str(tmp_path))
    argv = ["--model", name, "--gpu", "h100-80gb", "--num-gpus", "8", "--finetune", "lora",
            "--seq-len", "1024", "--zero", "3", "--attn", "flash"]  # fmt: skip
    assert main(argv) == 0, name
    out = capsys.readouterr().out
    assert "verdict:" in out and "activations traced" in out
