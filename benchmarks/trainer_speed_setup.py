"""The models, rows and peaks of benchmarks/bench_trainer_speed.py: the demo model on the CPU, or a
catalog model's shape (config/models.yaml, e.g. llama-3.1-8b) with random weights and synthetic rows,
on the CPU or a CUDA GPU (issue #45).

A catalog model: `memfit.estimate.models.catalog.model(name).to_hf_config()` (the architecture memfit
ships; no download, HF_HUB_OFFLINE) with `layers` decoder layers, written as a config.json beside the
demo tokenizer (memfit.workflow.demo.train_tokenizer; only its special ids are used: pad, bos, eos), no
weights: `Loader` builds the model from the config on the device with torch.manual_seed(seed), so every
variant starts from the same random weights (as gpu_evidence.py's models: random init, the shape is
what costs time). `scale` > 1 divides the hidden and intermediate sizes, the attention and key/value
heads (at least 1) and the vocabulary by it, head_dim kept: a CPU-sized model of the same code path to
check the wiring, not the catalog model's speed (the output file says so in its name and settings).

Synthetic SFT rows (a catalog model): `n` rows of a length drawn uniformly from [min_len, seq_len]
(min_len = seq_len: every row exactly seq_len tokens, so a batch has no padding), token ids uniform over
[first id past the tokenizer's, vocab) (never a special id), the first 10% of each row the prompt (labels
-100, not scored), the rest the response (scored): memfit.data.prepare's row format.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPT_SHARE = 0.1  # of a synthetic row's tokens, not scored


def catalog_model_dir(name: str, layers: int | None, scale: int, seq_len: int, dest: Path) -> Path:
    """config.json of catalog model `name` (`layers` decoder layers, None: all; `scale` as the module
    docstring says) and the demo tokenizer in `dest`; no weights (`Loader` builds them)."""
    from memfit.estimate.models import catalog
    from memfit.workflow.demo import train_tokenizer

    arch = catalog.model(name)
    cfg = arch.to_hf_config()
    if layers is not None:
        if not 1 <= layers <= arch.num_layers:
            raise SystemExit(f"--layers {layers}: {name} has {arch.num_layers} decoder layers")
        cfg.num_hidden_layers = layers
    if scale > 1:
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
            setattr(cfg, key, max(1, getattr(cfg, key) // scale))
    tok = train_tokenizer(REPO / "data/demo", model_max_length=seq_len)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    dest.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def synthetic_sft_rows(n: int, seq_len: int, min_len: int, vocab: int, first_id: int, seed: int) -> list[dict]:
    """`n` SFT rows as the module docstring says."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(min_len, seq_len)
        ids = [rng.randrange(first_id, vocab) for _ in range(length)]
        prompt = max(1, int(PROMPT_SHARE * length))
        rows.append({"row": i + 1, "input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


@dataclasses.dataclass(frozen=True)
class Loader:
    """Builds the model of a model directory: its weights where it has them (the demo), else random
    weights from its config.json under torch.manual_seed(seed), on `device`, in `dtype`, with `attn`."""

    device: str
    dtype: torch.dtype
    attn: str
    seed: int
    grad_ckpt: bool = False  # memfit's side: as memfit.train.modeling loads a grad_ckpt candidate

    def __call__(self, model_dir: Path):
        model = self._build(model_dir)
        if self.grad_ckpt:  # non-reentrant, as memfit.train.modeling enables it
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _build(self, model_dir: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        if any(model_dir.glob("*.safetensors")):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype, attn_implementation=self.attn)
            return model.to(self.device)
        torch.manual_seed(self.seed)
        with torch.device(self.device):
            return AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model_dir), dtype=self.dtype, attn_implementation=self.attn
            )


def matmul_params(model_dir: Path) -> tuple[int, int, int]:
    """(N, layers, hidden) of the model in `model_dir`: N the weights every token multiplies with, each
    2-D parameter once (a tied head once), less the input embedding when it is not the head (a lookup,
    no FLOPs); counted on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # parameters(): a tied weight once
    if not cfg.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    return n, cfg.num_hidden_layers, cfg.hidden_size


def attention_impl(requested: str, device: str) -> str:
    """The attn_implementation both sides load with: flash_attention_2 where the flash-attn package
    imports and the device is a GPU (auto), else sdpa; or the one requested."""
    if requested != "auto":
        return requested
    import importlib.util

    return "flash_attention_2" if device == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"


def gpu_matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of a bf16 n x n x n GEMM on this GPU, `reps` back to back after one warm-up (2 n^3 FLOPs
    each): the practical dense bf16 peak, measured as benchmarks/gpu_evidence.py's context stage does
    (its `matmul_tflops`: the same 8192^3 shape and 20 repetitions)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def vendor_peak() -> dict:
    """The GPU's datasheet dense bf16 FLOP/s from memfit's catalog (config/gpus.yaml `tflops_bf16`,
    each entry citing its datasheet: H100 SXM and H200 989.5 TFLOP/s dense, 1,979 with sparsity), with
    the catalog name and source; or why there is none."""
    from memfit.estimate.models import catalog
    from memfit.estimate.models.detect import detect_gpu

    try:
        name = detect_gpu()
        g = catalog.gpu(name)
    # detect_gpu's DetectError, catalog.gpu's unknown name: an unlisted GPU, MFU against the measured peak only
    except ValueError as e:
        return {"gpu": torch.cuda.get_device_name(), "flops": None, "why": f"not in memfit's GPU catalog: {e}"}
    return {"gpu": name, "flops": g.tflops_bf16 * 1e12, "source": g.source}


def free_device() -> None:
    """Release what the variant before left (its model, optimizer and trainer), so each starts alike."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
