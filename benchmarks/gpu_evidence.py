"""GPU evidence: the estimator against real probes on one CUDA GPU, in resumable stages.

Every row runs `memfit.workflow.probe.run_probe` (the real training step of `memfit.train.loop`, one rank, a
few optimizer steps on the worst-case batch padded to seq_len) on a model built from a catalog
config with random init (no network, no weights; layers reduced so the full model fits, the
scaling stated in the JSON), and compares it with `memfit.estimate.estimate` for the same
model/candidate: peak allocated, peak reserved, device total (nvidia-smi), step time, tokens/s,
MFU, and the relative error of each (measured / estimate - 1).

    python benchmarks/gpu_evidence.py --list-stages
    python benchmarks/gpu_evidence.py --stage sft_zero --out benchmarks/results/gpu_evidence_h100-80gb.json
    python benchmarks/gpu_evidence.py --write-calibration benchmarks/results/gpu_evidence_h100-80gb.json

`--dry` runs the same code path on the CPU with the demo model (2 layers, seq_len 24, fp32),
one probe row per stage, two stages side by side (`--jobs`); CUDA-only rows are recorded as
"skipped: <reason>", never faked.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # gpu_trainer_speed beside this file

from memfit.atomic import write_json_atomic  # noqa: E402
from memfit.estimate import Settings, estimate, fit  # noqa: E402
from memfit.estimate.models import calibration, catalog  # noqa: E402
from memfit.estimate.time.costs import step_flops  # noqa: E402
from memfit.space import Candidate  # noqa: E402
from memfit.units import GIB, MIB, fmt_bytes  # noqa: E402

# Wheels needed beyond PyTorch (fetched by benchmarks/fetch_gpu_wheels.sh). Optional ones make
# their rows "skipped: <reason>" when absent.
WHEELS = ["deepspeed", "peft", "transformers", "accelerate", "safetensors", "tokenizers", "pyarrow", "pyyaml", "tqdm"]
OPTIONAL_WHEELS = {
    "bitsandbytes": "QLoRA rows",
    "liger-kernel": "stage trainer_speed: its trl+liger and memfit+liger variants",
    "trl": "stage trainer_speed: TRL's SFTTrainer beside memfit (with datasets)",
    "flash-attn": "attn=flash rows (only if a wheel exists for this torch/CUDA)",
}

STEPS = 3  # optimizer steps per probe: first is warm-up, the median of the rest is step_time_s


@dataclass(frozen=True)
class Row:
    id: str
    method: str  # sft | dpo
    cand: dict[str, Any]  # Candidate fields over the profile's base
    expandable_segments: bool = False
    needs: tuple[str, ...] = ()  # "cuda", "flash_attn", "bitsandbytes"


@dataclass(frozen=True)
class Profile:
    """What a run measures on: the model, its layer reduction, the base candidate."""

    name: str
    model: str  # catalog name or config.json path
    layers: int  # layers built (the catalog model's count scaled down to fit one GPU)
    gpu: str  # catalog GPU name
    base: dict[str, Any] = field(default_factory=dict)
    data_max_len: int = 128


def gpu_profile(gpu: str) -> Profile:
    # Llama-3.1-8B with 4 of its 32 layers: 1.9e9 params (full FT with Adam ~30 GiB), so every
    # full-FT row fits an 80 GB GPU with room for activations; LoRA rows use the same model.
    return Profile(
        "gpu", "llama-3.1-8b", 4, gpu, dict(precision="bf16", seq_len=2048, micro_batch=1, grad_accum=1, attn="sdpa")
    )


def dry_profile() -> Profile:
    return Profile(
        "dry",
        str(REPO / "config/models/demo-tiny.json"),
        2,
        "cpu",
        dict(precision="fp32", seq_len=24, micro_batch=2, grad_accum=1, attn="sdpa"),
        24,
    )


# Stage name -> rows. Each stage is sized for < 8 minutes on one H100 (about 40-70 s a probe:
# process start, model load, DeepSpeed init, 3 steps), the whole matrix < 20 minutes.
STAGES: dict[str, list[Row]] = {
    "context": [],  # CUDA context, cuBLAS workspace, GEMM and SDPA TFLOP/s (no probe; ~20 s)
    # no probe: benchmarks/bench_trainer_speed.py at the Llama-3.1-8B shape, memfit vs TRL (~4 min;
    # benchmarks/gpu_trainer_speed.py), before the probe stages: on a GPU whose evidence is committed
    # it is the stage gpu_check.sh runs
    "trainer_speed": [],
    # no probe: SDPA alone at long sequences, per backend, and what transformers passes it (~1 min)
    "sdpa_long": [],
    "sft_zero": [
        Row("sft-full-z0", "sft", dict(zero=0)),
        Row("sft-full-z2", "sft", dict(zero=2)),
        Row("sft-full-z3", "sft", dict(zero=3)),
    ],
    "sft_gc_lora": [
        Row("sft-full-z2-gc", "sft", dict(zero=2, grad_ckpt=True)),
        Row("sft-lora-z2", "sft", dict(zero=2, finetune="lora")),
        Row("sft-lora-z2-gc", "sft", dict(zero=2, finetune="lora", grad_ckpt=True)),
    ],
    "dpo_ref": [
        Row("dpo-lora-precomputed", "dpo", dict(zero=2, finetune="lora", ref="precomputed")),
        Row("dpo-lora-model", "dpo", dict(zero=2, finetune="lora", ref="model")),
        Row("dpo-lora-adapter", "dpo", dict(zero=2, finetune="lora", ref="adapter")),
        Row("dpo-full-model-z3", "dpo", dict(zero=3, ref="model")),
    ],
    "attention": [
        Row("sft-full-z2-eager", "sft", dict(zero=2, attn="eager")),
        Row("sft-full-z2-flash", "sft", dict(zero=2, attn="flash"), needs=("cuda", "flash_attn")),
    ],
    "qlora": [
        # QLoRA first: the --dry run probes one row per stage, and bitsandbytes' CPU backend runs it
        Row("sft-qlora-z0", "sft", dict(zero=0, finetune="qlora"), needs=("bitsandbytes",)),
        Row("sft-qlora-z0-gc", "sft", dict(zero=0, finetune="qlora", grad_ckpt=True), needs=("bitsandbytes",)),
        Row("sft-lora-z0", "sft", dict(zero=0, finetune="lora")),
    ],
    "allocator": [
        Row("sft-full-z2-expandable-off", "sft", dict(zero=2), expandable_segments=False),
        Row("sft-full-z2-expandable-on", "sft", dict(zero=2), expandable_segments=True, needs=("cuda",)),
    ],
    "long_context": [],  # rows made at run time from memfit.estimate.fit (~3 min)
    # memfit's step-time calibration (memfit.train.calibrate, the workflow's calibrate rule) of the
    # candidates the stages above probed, then each probe's step time predicted from it
    "step_time": [],
}
# rows per stage made at run time (no fixed Row list)
RUNTIME_STAGES = {
    "context": "no probe: CUDA context, cuBLAS workspace, GEMM/SDPA TFLOP/s, GEMM shapes, copies (~30 s)",
    "trainer_speed": "no probe: bench_trainer_speed.py, Llama-3.1-8B SFT LoRA (32 layers) and full (8 layers) "
    "at 4,096 tokens, memfit vs TRL, each +Liger (~4 min)",
    "sdpa_long": "no probe: causal SDPA forward+backward at 8K-75K tokens per backend, GQA and MHA; transformers' call (~1 min)",
    "long_context": "fit's seq_len limit and +10% (2 probes, ~3 min)",
    "step_time": "memfit's step-time calibration of the probed candidates vs their measured step times (~2 min)",
}
PROBE_S = 60  # a probe's seconds before one has been timed in this run (--deadline)
LONG_CONTEXT = dict(zero=2, finetune="lora", grad_ckpt=True)


def _missing(needs: tuple[str, ...], cuda: bool) -> str | None:
    if "cuda" in needs and not cuda:
        return "needs CUDA (this run has no GPU)"
    if "flash_attn" in needs and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (no wheel for this torch/CUDA?)"
    if "bitsandbytes" in needs and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    return None


# ---------------------------------------------------------------------------------------------
# Model and data, built once per profile into the work directory


def model_arch(profile: Profile) -> catalog.ModelArch:
    arch = (
        catalog.model_from_config_file(profile.model)
        if profile.model.endswith(".json")
        else catalog.model(profile.model)
    )
    return dataclasses.replace(arch, num_layers=profile.layers)


def build(profile: Profile, work: Path) -> tuple[Path, dict[str, Path]]:
    """A random-init HF model of the profile's architecture (the demo tokenizer: token ids are
    < 400, inside every catalog vocabulary) and the demo SFT/DPO data prepared for it."""
    from memfit.data import prepare
    from memfit.workflow.demo import train_tokenizer

    model_dir = work / f"model-{profile.name}"
    if not (model_dir / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM

        arch = model_arch(profile)
        tok = train_tokenizer(REPO / "data/demo")
        cfg = arch.to_hf_config()
        cfg.num_hidden_layers = profile.layers
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        dtype = torch.bfloat16 if profile.base["precision"] == "bf16" else torch.float32
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        tmp = work / f".model-{profile.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        os.replace(tmp, model_dir)
    data = {}
    for m in ("sft", "dpo"):
        data[m] = work / f"data-{profile.name}-{m}"
        if not (data[m] / "stats.json").exists():
            prepare(
                m, REPO / f"data/demo/{m}.jsonl", model_dir, data[m], max_len=profile.data_max_len, eval_fraction=0.05
            )
    return model_dir, data


# ---------------------------------------------------------------------------------------------
# Measurements


class DevicePoller:
    """Peak device memory of every compute process as nvidia-smi reports it (what a user sees),
    polled every 0.1 s while a probe runs. `None` with a reason where nvidia-smi is absent."""

    def __init__(self) -> None:
        self.exe = shutil.which("nvidia-smi")
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _used(self) -> int:
        out = subprocess.run(
            [self.exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        rows = [line.split(",") for line in out.splitlines() if "," in line]
        # every compute process but this driver (which never touches CUDA), in MiB
        return sum(int(m) for pid, m in rows if int(pid) != os.getpid() and m.strip().isdigit()) * MIB

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self._used())
            except (subprocess.SubprocessError, OSError, ValueError):
                pass
            self._stop.wait(0.1)

    def __enter__(self) -> DevicePoller:
        if self.exe:
            self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.exe:
            self._t.join()

    def result(self) -> tuple[int | None, str]:
        if not self.exe:
            return None, "skipped: nvidia-smi not found"
        return (self.peak or None), "nvidia-smi --query-compute-apps used_memory (peak of 0.1 s polls)"


def model_flops(arch, cand: Candidate, method: str) -> float:
    """FLOPs of one optimizer step on one rank, the estimator's own count
    (memfit.estimate.time.costs.step_flops, recomputation included: what the GPU executes)."""
    return step_flops(arch, cand, method)


def _err(measured, est) -> float | None:
    if measured is None or not est:
        return None
    return round(measured / est - 1, 4)


def estimate_row(
    profile: Profile,
    method: str,
    cand: Candidate,
    expandable_segments: bool,
    settings_kw: dict | None = None,
    budget: int | None = None,
) -> dict[str, Any]:
    """The estimator's answer for one row. A probe trains without resuming, so its memory is
    compared with the peak of the training phases; the resume phase (DeepSpeed's optimizer-state
    load, memfit.estimate.memory.phases) is reported beside it (`peak_allocated_bytes_with_resume`).
    Reserved and nvidia-smi totals move with the allocated peak: the estimator adds its
    fragmentation and overheads to the peak (memfit.estimate.core)."""
    arch, gpu = model_arch(profile), catalog.gpu(profile.gpu)
    settings = Settings(expandable_segments=expandable_segments, variable_length=False, **(settings_kw or {}))
    est = estimate(arch, gpu, 1, 1, method, cand, budget_bytes=budget, settings=settings)
    training = {k: v for k, v in est.phases.items() if k != "resume"}
    train_phase = max(training, key=training.get)
    shift = training[train_phase] - est.peak_allocated_bytes  # <= 0: the resume phase is left out
    return {
        "peak_allocated_bytes": training[train_phase],
        "peak_reserved_bytes": est.peak_reserved_bytes + shift,
        "device_total_bytes": est.device_total_bytes + shift,
        "peak_phase": train_phase,
        "peak_allocated_bytes_with_resume": est.peak_allocated_bytes,
        "peak_phase_with_resume": est.peak_phase,
        "step_time_s": est.step_time_s,
        "tokens_per_s": est.tokens_per_s,
        "fits": est.fits,
        "margin_bytes": est.margin_bytes,
        "calibration": est.calibration,
        "budget_bytes": budget,
        "mfu": round(model_flops(arch, cand, method) / est.step_time_s / (gpu.tflops(cand.precision) * 1e12), 4),
    }


ERROR_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "step_time_s", "tokens_per_s", "mfu")


def errors(measured: dict[str, Any], est: dict[str, Any]) -> dict[str, float | None]:
    return {k: _err(measured.get(k), est.get(k)) for k in ERROR_KEYS}


def reestimate(doc: dict[str, Any], profile: Profile) -> int:
    """Every measured row of `doc` estimated again with the estimator as it is now (the GPU's
    measurements are kept; the estimates and errors are replaced). Returns the rows redone."""
    n = 0
    for name, st in doc.get("stages", {}).items():
        if name == "step_time":
            continue
        for r in st["rows"]:
            if r.get("status") != "ok" or "measured" not in r or "candidate" not in r:
                continue
            cand = Candidate.from_dict(r["candidate"])
            budget = r["estimate"].get("budget_bytes")
            r["estimate"] = estimate_row(profile, r["method"], cand, r["expandable_segments"], budget=budget)
            r["error_rel"] = errors(r["measured"], r["estimate"])
            n += 1
    doc["summary"] = summary(doc)
    return n


def run_row(
    row: Row,
    profile: Profile,
    model_dir: Path,
    data: dict[str, Path],
    work: Path,
    cuda: bool,
    settings_kw: dict | None = None,
    budget: int | None = None,
    timeout_s: float = 420,
) -> dict[str, Any]:
    from memfit.train.run_config import RunConfig
    from memfit.workflow.probe import run_probe

    out: dict[str, Any] = {"id": row.id, "method": row.method, "expandable_segments": row.expandable_segments}
    cand = Candidate(**{**profile.base, **row.cand})
    out["candidate"] = cand.to_dict()
    reason = _missing(row.needs, cuda)
    if reason:
        return out | {"status": f"skipped: {reason}"}
    out["estimate"] = estimate_row(profile, row.method, cand, row.expandable_segments, settings_kw, budget)
    run = RunConfig(
        method=row.method,
        model_path=str(model_dir),
        data_dir=str(data[row.method]),
        out_dir=str(work / "runs"),
        candidate=cand.to_dict(),
        dpo={"beta": 0.1} if row.method == "dpo" else {},
        expandable_segments=row.expandable_segments,
    )
    env_before = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # "off" means off
    t0 = time.time()
    try:
        with DevicePoller() as poll:
            res = run_probe(
                run,
                nproc=1,
                out_json=work / "probe" / f"{row.id}.json",
                log=work / "probe" / f"{row.id}.log",
                steps=STEPS,
                timeout_s=timeout_s,
            )
    finally:
        if env_before is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env_before
    out["wall_s"] = round(time.time() - t0, 1)
    out["status"] = res["status"]
    if res["status"] != "ok":
        out["error"] = str(res.get("error", ""))[:2000]
        out["log_tail"] = res.get("log_tail", "")[-2000:]
        return out
    arch, gpu = model_arch(profile), catalog.gpu(profile.gpu)
    dev_total, dev_src = poll.result() if cuda else (None, "skipped: needs CUDA (this run has no GPU)")
    step = res.get("step_time_s")
    tokens = cand.micro_batch * cand.seq_len * cand.grad_accum * (2 if row.method == "dpo" else 1)
    meas = {
        "peak_allocated_bytes": res.get("peak_allocated_bytes"),
        "peak_reserved_bytes": res.get("peak_reserved_bytes"),
        "device_total_bytes": dev_total,
        "device_total_source": dev_src,
        "memory_source": res.get("memory_source"),
        "peak_phase": res.get("peak_phase"),  # rank 0's: forward, backward, optimizer step
        "step_time_s": step,
        "first_step_time_s": res.get("first_step_time_s"),
        "tokens_per_s": tokens / step if step else None,  # padded tokens, as the estimate counts
        "mfu": round(model_flops(arch, cand, row.method) / step / (gpu.tflops(cand.precision) * 1e12), 4)
        if step
        else None,
        "achieved_tflops": model_flops(arch, cand, row.method) / step / 1e12 if step else None,
        "device": res.get("device"),
    }
    out["measured"] = meas
    out["error_rel"] = errors(meas, out["estimate"])
    return out


def _stale(stage: str, doc: dict[str, Any]) -> bool:
    """A finished stage that lacks what the stage measures now: the context stage before
    `allocator_workspace_bytes` (2026-11-27) runs again (10 s); so does a long_context stage
    probed before one-row probes ran their row unpadded (2026-11-28: `probe_batch`)."""
    if stage == "long_context":
        return "probe_batch" not in doc["stages"]["long_context"]
    if stage != "context":
        return False
    rows = doc["stages"]["context"].get("rows", [])
    return bool(rows) and rows[0].get("status") == "ok" and "allocator_workspace_bytes" not in rows[0]["measured"]


def stage_context(cuda: bool) -> list[dict[str, Any]]:
    """CUDA context and cuBLAS workspace in a fresh process (mem_get_info used minus the
    allocator's reserved bytes), and achieved bf16 GEMM / SDPA TFLOP/s."""
    if not cuda:
        return [{"id": "context", "status": "skipped: needs CUDA (this run has no GPU)"}]
    code = r"""
import json, time, torch, torch.nn.functional as F
def used(): f, t = torch.cuda.mem_get_info(); return t - f
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
base = used() - torch.cuda.memory_reserved()
# what the caching allocator keeps after a forward and backward GEMM with every tensor freed: the
# cuBLAS workspaces of the forward's and autograd's threads (calibration.allocator_workspaces)
x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
(x @ x).sum().backward(); del x; torch.cuda.synchronize()
workspaces = torch.cuda.memory_allocated()  # nothing else is alive: torch.zeros(1) was not kept
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
(a @ b); torch.cuda.synchronize()
cublas = used() - torch.cuda.memory_reserved() - base
def rate(fn, flops, n=20):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return flops * n / (time.perf_counter() - t) / 1e12
mm = rate(lambda: a @ b, 2 * 8192**3)
q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
att = rate(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), 4 * 32 * 8192**2 * 128 / 2)
# the GEMMs of a Llama-3.1-8B step (hidden 4096, intermediate 14336, vocab 128256) at 1-8 rows
# of 1,024-8,192 tokens: how far below the 8192^3 figure a training step's own shapes run
shapes = []
for m in (1024, 2048, 4096, 8192):
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        shapes.append({"m": m, "n": n, "k": k, "tflops": round(rate(lambda: x @ w.T, 2 * m * n * k), 1)})
        del x, w
# host <-> device copies of 1 GiB, pinned and pageable host memory (offload transfers)
copies = {}
dev = torch.empty(2**30, dtype=torch.uint8, device="cuda")
# device memory bandwidth: a 1 GiB device-to-device copy reads and writes 1 GiB each
# (memfit.estimate.time.roofline prices memory-bound kernels at it)
dst = torch.empty_like(dev)
dst.copy_(dev); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): dst.copy_(dev)
torch.cuda.synchronize(); hbm = 20 * 2 * 2**30 / (time.perf_counter() - t) / 1e9
del dst
for pinned in (True, False):
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=pinned)
    for d, fn in (("h2d", lambda: dev.copy_(host, non_blocking=pinned)), ("d2h", lambda: host.copy_(dev, non_blocking=pinned))):
        fn(); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(5): fn()
        torch.cuda.synchronize()
        copies[f"{d}_{'pinned' if pinned else 'pageable'}_gb_s"] = round(5 * 2**30 / (time.perf_counter() - t) / 1e9, 1)
print(json.dumps({"cuda_context_bytes": base, "cublas_workspace_bytes": cublas, "allocator_workspace_bytes": workspaces,
                  "matmul_tflops": mm,
                  "attention_tflops": att, "gemm_shapes": shapes, "copies": copies, "hbm_gb_s": round(hbm, 1),
                  "device": torch.cuda.get_device_name()}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return [{"id": "context", "status": "error", "error": p.stderr[-2000:]}]
    m = json.loads(p.stdout.strip().splitlines()[-1])
    return [{"id": "context", "status": "ok", "measured": m}]


# Llama-3.1-8B's attention (the evidence model): 32 query heads, 8 key/value heads, head dim 128;
# 75,621 tokens is the H200's long_context row, where allocated exceeded the estimate by ~s^2 bytes
SDPA_LONG_CODE = r"""
import contextlib, json, sys, time, warnings, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
H, KV, D = 32, 8, 128
# argv: device, lengths, hidden and intermediate size of the transformers layer (the CPU test runs it small)
DEV, LENGTHS, HID, INTER = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
CUDA = DEV == "cuda"
def sync(): CUDA and torch.cuda.synchronize()
def allocated(): return torch.cuda.memory_allocated() if CUDA else 0
def peak_allocated(): return torch.cuda.max_memory_allocated() if CUDA else 0
rows = []
# each backend causal (is_causal, no mask: an unpadded row) with GQA and with K/V repeated to every head; then
# what a padded row gets from transformers: a (1, 1, s, s) bool mask, is_causal False, K/V repeated
CASES = [(b, gqa, False) for b in ("default", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
         for gqa in (True, False)] + [("default", False, True), ("EFFICIENT_ATTENTION", False, True)]
for s in LENGTHS:
    for backend, gqa, masked in CASES:
        kind = "masked" if masked else ("gqa" if gqa else "mha")
        row = {"id": f"sdpa-s{s}-{backend.lower()}-{kind}", "seq_len": s, "backend": backend,
               "enable_gqa": gqa, "mask": masked}
        with warnings.catch_warnings(record=True) as why:  # a refusing backend warns its reasons
            warnings.simplefilter("always")
            try:
                q = torch.randn(1, H, s, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                k, v = (torch.randn(1, KV if gqa else H, s, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                        for _ in range(2))
                g = torch.randn(1, H, s, D, device=DEV, dtype=torch.bfloat16)
                mask = torch.ones(s, s, device=DEV, dtype=torch.bool).tril()[None, None] if masked else None
                ctx = contextlib.nullcontext() if backend == "default" else sdpa_kernel([getattr(SDPBackend, backend)])
                times = []
                with ctx:
                    for _ in range(2):  # the second repetition is timed (the first picks and loads kernels)
                        q.grad = k.grad = v.grad = None
                        sync(); CUDA and torch.cuda.reset_peak_memory_stats()
                        base = allocated(); t0 = time.perf_counter()
                        if masked:
                            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        else:
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                        sync(); t1 = time.perf_counter()
                        fwd_peak = peak_allocated() - base
                        o.backward(g); sync(); t2 = time.perf_counter()
                        peak = peak_allocated() - base
                        del o
                        times.append((t1 - t0, t2 - t1))
                row |= {"status": "ok", "measured": {"forward_s": times[-1][0], "backward_s": times[-1][1],
                        "forward_extra_bytes": fwd_peak, "extra_bytes": peak, "extra_per_s2": peak / s**2}}
            except Exception as e:  # a backend that refuses these shapes says why (PyTorch warns the reasons)
                reasons = " | ".join(str(w.message).splitlines()[0][:200] for w in why[:4])
                row |= {"status": "refused: " + (str(e).splitlines()[0][:200] or type(e).__name__), "why": reasons}
        rows.append(row)
        q = k = v = g = mask = None
        CUDA and torch.cuda.empty_cache()
# what transformers' SDPA path passes for a causal LM step as memfit's trainer runs it (a 2-D all-ones
# attention mask, labels): one Llama-3.1-8B-shaped layer at 8,192 tokens
from transformers import LlamaConfig, LlamaForCausalLM
import transformers.integrations.sdpa_attention as sa
seen, orig = [], sa.torch.nn.functional.scaled_dot_product_attention
def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    seen.append({"attn_mask": None if attn_mask is None else [list(attn_mask.shape), str(attn_mask.dtype)],
                 "is_causal": bool(is_causal), "enable_gqa": kw.get("enable_gqa"), "kv_heads": k.shape[1]})
    return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
sa.torch.nn.functional.scaled_dot_product_attention = spy
cfg = LlamaConfig(hidden_size=HID, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=H,
                  num_key_value_heads=KV, vocab_size=1024, max_position_embeddings=131072)
cfg._attn_implementation = "sdpa"
m = LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).train()
ids = torch.randint(0, 1024, (1, LENGTHS[0]), device=DEV)
m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss.backward()
padded = torch.ones_like(ids); padded[:, LENGTHS[0] // 2 :] = 0  # a row padded to twice its length (what the probes ran)
m(input_ids=ids, attention_mask=padded, labels=ids, use_cache=False).loss.backward()
rows.append({"id": "transformers-sdpa-call", "status": "ok", "measured": {"unpadded": seen[0], "padded": seen[1],
             "transformers": __import__("transformers").__version__, "torch": torch.__version__}})
print(json.dumps(rows))
"""


def stage_sdpa_long(cuda: bool) -> list[dict[str, Any]]:
    """Causal SDPA alone (forward and backward, bf16, one row) at 8K, 32K and 75,621 tokens, per
    backend, with grouped-query K/V and with K/V repeated to every head: seconds and the peak
    beyond the inputs, in bytes and per s^2; and what transformers passes SDPA in a training step.
    What the masked kernel costs against the causal one, in memory and seconds: the H200's
    long_context rows, probed on a padded row, measured ~s^2 bytes over the estimate and a step
    3.6x it."""
    if not cuda:
        return [{"id": "sdpa-long", "status": "skipped: needs CUDA (this run has no GPU)"}]
    p = subprocess.run(
        [sys.executable, "-c", SDPA_LONG_CODE, "cuda", "8192,32768,75621", "4096", "14336"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    if p.returncode != 0:
        return [{"id": "sdpa-long", "status": "error", "error": p.stderr[-2000:]}]
    return json.loads(p.stdout.strip().splitlines()[-1])


def stage_long_context(profile: Profile, model_dir, data, work, cuda: bool) -> list[dict[str, Any]]:
    """The largest seq_len `fit` predicts for LONG_CONTEXT must run; +10% must OOM or come
    within the headroom (measured device total >= 90% of the device's memory)."""
    arch, gpu = model_arch(profile), catalog.gpu(profile.gpu)
    base = Candidate(**{**profile.base, **LONG_CONTEXT})
    settings = Settings(variable_length=False)
    budget = None
    if not cuda:  # dry: a budget 25% above seq_len's own estimate, so fit lands near seq_len
        budget = int(estimate(arch, gpu, 1, 1, "sft", base, settings=settings).device_total_bytes * 1.25)
    n, _ = fit(
        arch,
        gpu,
        1,
        1,
        "sft",
        base,
        "seq_len",
        budget_bytes=budget,
        settings=settings,
        upper=arch.max_position_embeddings,
    )
    if n == 0 or n >= arch.max_position_embeddings:
        return [
            {
                "id": "long-context",
                "status": f"skipped: fit gave seq_len {n} (no limit below "
                f"max_position_embeddings {arch.max_position_embeddings} to test)",
            }
        ]
    rows = []
    for tag, s in (("fit", n), ("fit+10%", int(n * 1.1))):
        r = Row(f"long-context-{tag}-seq{s}", "sft", {**LONG_CONTEXT, "seq_len": s})
        rows.append(run_row(r, profile, model_dir, data, work, cuda, budget=budget) | {"fit_seq_len": n})
    lim = gpu.memory_bytes
    over = rows[1]
    total = (over.get("measured") or {}).get("device_total_bytes")
    rows[0]["verdict"] = "ok: fits" if rows[0]["status"] == "ok" else "FAIL: predicted limit did not run"
    if over["status"] == "oom":
        rows[1]["verdict"] = "ok: +10% ran out of memory"
    elif not cuda:
        rows[1]["verdict"] = "n/a on cpu: no device memory limit to hit"
    elif total is not None and total >= 0.9 * lim:
        rows[1]["verdict"] = f"ok: +10% used {fmt_bytes(total)} of {fmt_bytes(lim)} (within headroom)"
    else:
        rows[1]["verdict"] = "FAIL: +10% ran well below the device's memory (estimate too pessimistic)"
    return rows


# ---------------------------------------------------------------------------------------------
# Driver


def run_stage(
    name: str,
    profile: Profile,
    work: Path,
    cuda: bool,
    dry: bool,
    done: dict[str, dict[str, Any]] | None = None,
    on_row=None,
    deadline: float | None = None,
    doc_path: Path | None = None,
) -> dict[str, Any]:
    """One stage's part of the JSON. `done`: rows of an earlier partial run of this stage, kept
    where they finished; `on_row(rows)` after each row (a stage cut off keeps its finished rows);
    no probe starts after `deadline` (time.time()) less the longest probe seen so far."""
    t0 = time.time()
    done = done or {}
    extra: dict[str, Any] = {}
    if name == "context":
        rows = stage_context(cuda)
    elif name == "sdpa_long":
        rows = stage_sdpa_long(cuda)
    elif name == "trainer_speed":
        from gpu_trainer_speed import stage_trainer_speed

        rows = stage_trainer_speed(cuda, work, deadline, done)
    else:
        model_dir, data = build(profile, work)
        if name == "long_context":
            rows = stage_long_context(profile, model_dir, data, work, cuda)
            # micro batch 1: the longest row filled to seq_len with its own tokens, unpadded as
            # training runs it (memfit.train.batches.probe_rows); before, padded (an s x s mask)
            extra["probe_batch"] = "one row filled to seq_len"
        elif name == "step_time":
            rows = stage_step_time(profile, model_dir, work, cuda, doc_path, deadline)
        else:
            rows, ran, longest = [], 0, PROBE_S
            for r in STAGES[name]:
                if done.get(r.id, {}).get("status") == "ok":
                    rows.append(done[r.id])
                    continue
                if dry and (ran >= 1 or _missing(r.needs, cuda)):
                    reason = _missing(r.needs, cuda) or "dry run: one probe per stage"
                    rows.append({"id": r.id, "method": r.method, "status": f"skipped: {reason}"})
                    continue
                if deadline is not None and time.time() + longest > deadline:
                    rows.append({"id": r.id, "method": r.method, "status": "skipped: deadline (--deadline)"})
                    continue
                # a probe may overrun the deadline by a minute, no more (a hung one would take the rest)
                timeout = 420 if deadline is None else min(420, max(60, deadline + 60 - time.time()))
                rows.append(run_row(r, profile, model_dir, data, work, cuda, timeout_s=timeout))
                longest = max(longest, rows[-1].get("wall_s", 0))
                ran += 1
                if on_row is not None:
                    on_row({"rows": rows, "partial": True, "wall_s": round(time.time() - t0, 1)})
    part = {
        "rows": rows,
        "wall_s": round(time.time() - t0, 1),
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(),
    }
    part |= extra
    if any(r.get("status") == "skipped: deadline (--deadline)" for r in rows):
        part["partial"] = True  # run the stage again to finish it
    return part


def stage_step_time(
    profile: Profile, model_dir: Path, work: Path, cuda: bool, doc_path: Path | None, deadline: float | None
) -> list[dict[str, Any]]:
    """memfit's step-time calibration (memfit.train.calibrate on one rank, as the workflow's
    calibrate rule runs it) of every candidate the probe stages measured, then each probe's step
    time predicted from it (memfit.estimate.time.timing) against the probe's measured step time."""
    from memfit.estimate.time import timing
    from memfit.train.launch import launch

    doc = json.loads(doc_path.read_text()) if doc_path and doc_path.exists() else {}
    probed = [
        r
        for st, part in doc.get("stages", {}).items()
        if st != "step_time"
        for r in part["rows"]
        if r.get("status") == "ok" and (r.get("measured") or {}).get("step_time_s") and "candidate" in r
    ]
    if not probed:
        return [
            {"id": "step-time", "status": "skipped: no probe has measured a step time yet (run probe stages first)"}
        ]
    if deadline is not None and time.time() + 3 * PROBE_S > deadline:
        return [{"id": "step-time", "status": "skipped: deadline (--deadline)"}]
    cands: dict[str, list[dict[str, Any]]] = {}
    for r in probed:
        if r["candidate"] not in cands.setdefault(r["method"], []):
            cands[r["method"]].append(r["candidate"])
    cal_path, log = work / "step_time_calibration.json", work / "probe" / "step_time_calibration.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    spec = {
        "model_path": str(model_dir),
        "out": str(cal_path),
        "work_dir": str(work / "calibration-models"),
        "candidates": cands,
        "dpo": {"beta": 0.1},  # run_row's DPO setting
        "reps": 3,
    }
    spec_path = work / "step_time_spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    cal_path.unlink(missing_ok=True)
    t0 = time.time()
    left = None if deadline is None else max(deadline - time.time(), 60)
    try:
        rc = launch(spec_path, 1, log=log, timeout_s=left, rank_command="calibrate")
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = round(time.time() - t0, 1)
    if rc != 0 or not cal_path.exists():
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        return [{"id": "step-time", "status": f"error: calibration exit {rc}", "wall_s": wall, "log_tail": tail}]
    cal = timing.load(cal_path)
    arch = model_arch(profile)
    rows: list[dict[str, Any]] = [
        {"id": "step-time-calibration", "status": "ok", "wall_s": wall, "calibration": json.loads(cal_path.read_text())}
    ]
    pred, meas = [], []
    for r in probed:
        cand = Candidate.from_dict(r["candidate"])
        why = timing.missing(cal, cand, r["method"])
        if why:
            rows.append({"id": f"step-time:{r['id']}", "status": f"skipped: {why}"})
            continue
        terms = timing.predict(cal, cand, r["method"], arch.num_layers)
        p, m = sum(terms.values()), r["measured"]["step_time_s"]
        pred.append(p)
        meas.append(m)
        rows.append(
            {
                "id": f"step-time:{r['id']}",
                "status": "ok",
                "predicted_step_time_s": round(p, 5),
                "measured_step_time_s": m,
                "terms_s": {k: round(v, 5) for k, v in terms.items()},
                "step_time_error_rel": round(m / p - 1, 4),
                "mfu_model_step_time_s": r["estimate"]["step_time_s"],
            }
        )
    if pred:
        errs = [abs(m / p - 1) for p, m in zip(pred, meas, strict=True)]
        ids = [r["id"] for r in rows[1:] if r["status"] == "ok"]
        rows[0]["summary"] = {
            "n": len(pred),
            "median_abs_error": round(statistics.median(errs), 4),
            "worst_abs_error": round(max(errs), 4),
            "spearman": round(timing.spearman(pred, meas), 4) if len(pred) > 2 else None,
            "fastest_measured": ids[meas.index(min(meas))],
            "fastest_predicted": ids[pred.index(min(pred))],
        }
    return rows


def header(profile: Profile, cuda: bool) -> dict[str, Any]:
    import torch

    arch = model_arch(profile)
    full = (
        catalog.model_from_config_file(profile.model)
        if profile.model.endswith(".json")
        else catalog.model(profile.model)
    )
    return {
        "gpu": profile.gpu,
        "device_name": _smi_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "profile": profile.name,
        "model": profile.model,
        "scaling": f"{arch.num_layers} of {full.num_layers} layers ({arch.num_params():,} of "
        f"{full.num_params():,} params), random init; estimates use the same reduced model",
        "packages": {
            m: _version(m)
            for m in ("deepspeed", "peft", "transformers", "bitsandbytes", "flash_attn", "liger_kernel", "trl")
        },
    }


def _version(mod: str) -> str | None:
    if importlib.util.find_spec(mod) is None:
        return None
    try:
        from importlib.metadata import version

        return version({"flash_attn": "flash-attn", "liger_kernel": "liger-kernel"}.get(mod, mod))
    except Exception:  # noqa: BLE001 - a module without metadata still reports as present
        return "present"


def _smi_name() -> str:
    """The GPU's name from nvidia-smi: torch.cuda.get_device_name would create a CUDA context in
    this driver process, which the device-total polls would then count."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise SystemExit("nvidia-smi not found: pass --gpu <catalog name> (config/gpus.yaml)")
    return (
        subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        .stdout.splitlines()[0]
        .strip()
    )


def detect_gpu() -> str:
    name = _smi_name().lower()
    for key, cat in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb"), ("l40s", "l40s")):
        if key in name:
            return cat
    raise SystemExit(f"unknown GPU {name!r}: pass --gpu <catalog name> (config/gpus.yaml)")


def table(doc: dict[str, Any]) -> str:
    lines = [
        f"{'row':34} {'status':8} {'alloc est/meas':>21} {'err':>6} {'reserved err':>12} "
        f"{'total err':>9} {'step s est/meas':>17} {'MFU':>5}"
    ]
    stages = doc.get("stages", {})
    for st in [stages[k] for k in STAGES if k in stages and k != "step_time"]:
        for r in st["rows"]:
            if r.get("status") == "ok" and "extra_per_s2" in r.get("measured", {}):  # stage sdpa_long
                m = r["measured"]
                lines.append(
                    f"{r['id']:34} {'ok':8} forward {m['forward_s']:.3f} s, backward {m['backward_s']:.3f} s, "
                    f"peak beyond inputs {fmt_bytes(m['extra_bytes'])} ({m['extra_per_s2']:.3f} x s^2 bytes)"
                )
                continue
            if r.get("status") == "ok" and "table" in r:  # stage trainer_speed
                lines += [f"{r['id']:34} {line}" for line in r["table"]]
                continue
            if r.get("status") != "ok" or "estimate" not in r:
                measured = f" {json.dumps(r['measured'])[:200]}" if "measured" in r else ""
                lines.append(f"{r['id']:34} {str(r.get('status', ''))[:60]}{measured}")
                continue
            e, m, er = r["estimate"], r["measured"], r["error_rel"]

            def pct(x):
                return "  n/a" if x is None else f"{100 * x:+.0f}%"

            lines.append(
                f"{r['id']:34} {'ok':8} {e['peak_allocated_bytes'] / GIB:9.2f}/{m['peak_allocated_bytes'] / GIB:7.2f} GiB "
                f"{pct(er['peak_allocated_bytes']):>6} {pct(er['peak_reserved_bytes']):>12} {pct(er['device_total_bytes']):>9} "
                f"{e['step_time_s']:8.3f}/{m['step_time_s']:7.3f} {m['mfu'] or 0:5.2f}"
            )
    for r in stages.get("step_time", {}).get("rows", []):
        if "predicted_step_time_s" in r:
            lines.append(
                f"{r['id']:34} step time calibrated {r['predicted_step_time_s']:.4f} s, measured "
                f"{r['measured_step_time_s']:.4f} s ({100 * r['step_time_error_rel']:+.0f}%)"
            )
        elif r.get("summary"):
            lines.append(f"step-time calibration ({r['wall_s']:.0f} s): {r['summary']}")
        else:
            lines.append(f"{r['id']:34} {r.get('status', '')[:60]}")
    s = summary(doc)
    if s["n"]:
        lines.append(
            f"allocated error over {s['n']} rows: median {100 * s['median']:+.1f}%, worst {100 * s['worst']:+.1f}%"
        )
    return "\n".join(lines)


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    errs = [
        r["error_rel"]["peak_allocated_bytes"]
        for name, st in doc.get("stages", {}).items()
        if name != "step_time"
        for r in st["rows"]
        if r.get("status") == "ok" and r.get("error_rel", {}).get("peak_allocated_bytes") is not None
    ]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "median": statistics.median(errs), "worst": max(errs, key=abs)}


def derive_calibration(doc: dict[str, Any]) -> dict[str, Any]:
    """config/calibration/<gpu>.json from a finished evidence JSON; each value names its source."""
    # long_context's rows (75K+ tokens) are left out: the H200's were probed on a padded row (an
    # s x s mask training never builds; docs/gpus.md) and wait to be measured again
    rows = {
        r["id"]: r
        for name, st in doc["stages"].items()
        if name not in ("step_time", "long_context")
        for r in st["rows"]
    }
    ctx = rows.get("context", {})
    if ctx.get("status") != "ok":
        raise SystemExit("the context stage has no measurement: run --stage context on the GPU first")
    ok = [
        r
        for r in rows.values()
        if r.get("status") == "ok" and "measured" in r and r["measured"].get("peak_reserved_bytes")
    ]
    frag_rows = [r for r in ok if not r["expandable_segments"]]
    step_rows = [r for r in ok if r["candidate"]["attn"] == "sdpa" and r["candidate"]["precision"] == "bf16"]
    if not frag_rows or not step_rows:
        raise SystemExit("no finished probe rows with reserved memory and step time: run the probe stages first")
    m = ctx["measured"]
    # nvidia-smi's total beyond reserved, context and cuBLAS in the probes' one-rank processes
    extra_rows = [r for r in ok if r["measured"].get("device_total_bytes")]
    extra = [
        r["measured"]["device_total_bytes"]
        - r["measured"]["peak_reserved_bytes"]
        - m["cuda_context_bytes"]
        - max(m["cublas_workspace_bytes"], 0)
        for r in extra_rows
    ]
    return {
        "_comment": "written by benchmarks/gpu_evidence.py --write-calibration; values from the named measurements",
        "device": doc["gpu"],
        "measured_on": doc["stages"]["context"]["finished"][:10],
        "measured_device": m["device"],
        "source": f"benchmarks/results/gpu_evidence_{doc['gpu']}.json",
        "cuda_context_bytes": int(m["cuda_context_bytes"]),
        "cublas_workspace_bytes": int(max(m["cublas_workspace_bytes"], 0)),
        "single_rank_extra_bytes": int(max(statistics.median(extra), 0)) if extra else None,
        # evidence before 2026-11-27 has none: the estimator's default (two per-handle workspaces)
        **(
            {"allocator_workspace_bytes": int(m["allocator_workspace_bytes"])}
            if "allocator_workspace_bytes" in m
            else {}
        ),
        "fragmentation": round(
            statistics.median(
                r["measured"]["peak_reserved_bytes"] / r["measured"]["peak_allocated_bytes"] - 1 for r in frag_rows
            ),
            4,
        ),
        # no "step" rate: the probes' model (4 of Llama-3.1-8B's 32 layers, micro batch 1) spends
        # half its FLOPs on the embedding and head and reaches about 0.2 MFU; as the rate of every
        # H100 step it put the public throughput table's median error at 36% (24.7% with the
        # assumed 40% MFU, benchmarks/bench_public_time.py, 2026-11-26). Its median stays in
        # `step_tflops_of_probes` for the record.
        **({"hbm_gbs": m["hbm_gb_s"]} if "hbm_gb_s" in m else {}),  # evidence before 2026-11-27 has none
        "tflops": {
            "matmul": round(m["matmul_tflops"], 1),
            "gemm": round(statistics.median(s["tflops"] for s in m["gemm_shapes"]), 2),
            "attention": round(m["attention_tflops"], 1),
        },
        "measurements": {
            "cuda_context_bytes": "stage context: mem_get_info used - memory_reserved after torch.zeros(1)",
            "cublas_workspace_bytes": "stage context: the same after the first bf16 GEMM",
            **(
                {
                    "allocator_workspace_bytes": "stage context: memory_allocated after a GEMM's forward and backward, "
                    "every tensor freed"
                }
                if "allocator_workspace_bytes" in m
                else {}
            ),
            "single_rank_extra_bytes": "median nvidia-smi total - reserved - context - cuBLAS of "
            f"{[r['id'] for r in extra_rows]} (one rank: its NCCL communicator and other non-torch memory)",
            "fragmentation": f"median reserved/allocated - 1 of {[r['id'] for r in frag_rows]}",
            "step_tflops_of_probes": f"{statistics.median(r['measured']['achieved_tflops'] for r in step_rows):.1f} "
            f"TFLOP/s, median model FLOPs / step time of {[r['id'] for r in step_rows]}; not used as "
            "tflops.step (a reduced model at micro batch 1 is no whole model's step)",
            **({"hbm_gbs": "stage context: a 1 GiB device-to-device copy (read + write)"} if "hbm_gb_s" in m else {}),
            "tflops.matmul": "stage context: 8192^3 bf16 GEMM",
            "tflops.gemm": "stage context: median of the Llama-3.1-8B step's GEMM shapes (x @ w.T, "
            "1,024-8,192 rows; memfit.estimate.time.roofline prices every GEMM at it)",
            "tflops.attention": "stage context: causal SDPA 32x8192x128 bf16",
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", action="append", help="stage to run (repeatable; default: all)")
    ap.add_argument("--list-stages", action="store_true")
    ap.add_argument("--list-wheels", action="store_true")
    ap.add_argument("--out", type=Path, help="evidence JSON (default benchmarks/results/gpu_evidence_<gpu>.json)")
    ap.add_argument("--gpu", help="catalog GPU name (default: detected)")
    ap.add_argument("--work", type=Path, default=REPO / "benchmarks/results/.work", help="models, data, probe logs")
    ap.add_argument("--force", action="store_true", help="re-run stages already in the JSON")
    ap.add_argument("--dry", action="store_true", help="CPU, demo model, tiny shapes, one probe per stage")
    ap.add_argument("--jobs", type=int, help="stages run side by side (--dry only; default 2 with --dry, else 1)")
    ap.add_argument("--write-calibration", type=Path, metavar="EVIDENCE_JSON")
    ap.add_argument(
        "--reestimate",
        type=Path,
        metavar="EVIDENCE_JSON",
        help="estimate every measured row of a finished evidence JSON again with the estimator as it is now "
        "(measurements kept; estimates and errors replaced) and print the table",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="start no probe that would end after SECONDS from now (the longest probe so far as its length); "
        "rows left are recorded 'skipped: deadline' and the stage runs again next time",
    )
    a = ap.parse_args(argv)
    if a.list_stages:
        for k, rows in STAGES.items():
            what = RUNTIME_STAGES.get(k)
            print(f"{k:14} {what or ', '.join(r.id for r in rows)}")
        return 0
    if a.list_wheels:
        print(" ".join(WHEELS))
        for k, v in OPTIONAL_WHEELS.items():
            print(f"optional: {k} ({v})")
        return 0
    if a.write_calibration:
        doc = json.loads(a.write_calibration.read_text())
        cal = derive_calibration(doc)
        calibration.validate(cal, str(a.write_calibration))
        dest = calibration.CALIBRATION_DIR / f"{doc['gpu']}.json"
        write_json_atomic(dest, cal)
        print(f"wrote {dest}")
        return 0
    if a.reestimate:
        doc = json.loads(a.reestimate.read_text())
        profile = dry_profile() if doc.get("profile") == "dry" else gpu_profile(doc["gpu"])
        n = reestimate(doc, profile)
        write_json_atomic(a.reestimate, doc)
        print(f"{n} rows estimated again, written to {a.reestimate}")
        print(table(doc))
        return 0
    import torch

    cuda = torch.cuda.is_available() and not a.dry
    if not cuda and not a.dry:
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry for the CPU dry run")
    profile = dry_profile() if a.dry else gpu_profile(a.gpu or detect_gpu())
    out = a.out or REPO / f"benchmarks/results/gpu_evidence_{profile.gpu}.json"
    stages = a.stage or list(STAGES)
    for s in stages:
        if s not in STAGES:
            raise SystemExit(f"unknown stage {s!r}; stages: {', '.join(STAGES)}")
    jobs = a.jobs if a.jobs is not None else (2 if a.dry else 1)
    if jobs < 1 or (jobs > 1 and not a.dry):
        raise SystemExit(
            f"--jobs {jobs}: stages run side by side only in the --dry run (on a GPU "
            "their probes would share the device and disturb each other's measurements)"
        )
    a.work.mkdir(parents=True, exist_ok=True)
    pending = []
    for s in stages:
        doc = json.loads(out.read_text()) if out.exists() else {}
        if s in doc.get("stages", {}) and not doc["stages"][s].get("partial") and not a.force and not _stale(s, doc):
            print(f"stage {s}: already in {out}, skipped (--force to re-run)")
            continue
        pending.append(s)

    def record(s: str, part: dict[str, Any]) -> None:
        # re-read: another process may have written other stages meanwhile
        doc = json.loads(out.read_text()) if out.exists() else {}
        doc.update(header(profile, cuda))
        doc.setdefault("stages", {})[s] = part
        doc["summary"] = summary(doc)
        write_json_atomic(out, doc)
        print(f"stage {s}: {part['wall_s']:.0f} s, written to {out}", flush=True)

    deadline = None if a.deadline is None else time.time() + a.deadline
    if jobs == 1:
        for s in pending:
            print(f"stage {s}: running", flush=True)
            before = {} if a.force else json.loads(out.read_text()).get("stages", {}).get(s, {}) if out.exists() else {}
            done = {r["id"]: r for r in before.get("rows", [])}
            record(
                s,
                run_stage(
                    s,
                    profile,
                    a.work,
                    cuda,
                    a.dry,
                    done=done,
                    on_row=lambda part, s=s: record(s, part),
                    deadline=deadline,
                    doc_path=out,
                ),
            )
    elif pending:
        # dry run, stages side by side: the model and data built once first (each stage reuses
        # them), the two-probe long_context stage started first; each finished stage is written
        # (from this thread only) as it finishes
        if any(s not in ("context", "trainer_speed") for s in pending):  # trainer_speed builds its own
            build(profile, a.work)
        side_by_side = sorted((s for s in pending if s != "step_time"), key=lambda s: s != "long_context")
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            running = {}
            for s in side_by_side:
                print(f"stage {s}: running", flush=True)
                running[pool.submit(run_stage, s, profile, a.work, cuda, a.dry, doc_path=out)] = s
            for f in as_completed(running):
                record(running[f], f.result())
        if "step_time" in pending:  # after the probes it prices
            print("stage step_time: running", flush=True)
            record("step_time", run_stage("step_time", profile, a.work, cuda, a.dry, doc_path=out))
    doc = json.loads(out.read_text()) if out.exists() else {}
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
