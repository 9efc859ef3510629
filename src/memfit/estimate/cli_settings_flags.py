"""The flags of `memfit estimate` and `memfit fit` that set what the estimator takes besides the
candidate (`Settings`): the memory limits (host RAM, budget, headroom, calibration) and what the
trainer around the model holds (`add_budget_args`), and the traced activations
(`add_trace_args`). memfit.estimate.cli_parser adds them to its parser after the job's and the
levers' flags."""

from __future__ import annotations

import argparse

from memfit.estimate.models.calibration import UNCALIBRATED_MARGIN
from memfit.estimate.settings import DEFAULT_SETTINGS, LOGITS_HANDLING, TRAINER_LOADERS

# headroom on the cpu device when none is given: what the shipped cpu configs keep
# (config/config.yaml); the derived margin is a GPU's measured error
CPU_HEADROOM = 0.10


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """Memory limits and what the trainer around the model holds."""
    p.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        help="RAM per node, GiB (2**30 bytes) (default: the catalog's typical node for the GPU, named in the output)",
    )
    p.add_argument(
        "--host-memory-gb",
        type=float,
        default=None,
        help="RAM per node in decimal GB (1e9 bytes); kept for old scripts, prefer --host-memory-gib "
        "(default: as --host-memory-gib)",
    )
    p.add_argument(
        "--budget-gib", type=float, default=None, help="use this many GiB as the device memory (default: the GPU's)"
    )
    p.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="device memory in decimal GB (1e9 bytes); prefer --budget-gib (default: the GPU's)",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=None,
        help="fraction of device memory kept free, as the workflow's `headroom:` (default: the margin memfit's "
        f"measured device-total error calls for, 5%% on a GPU with a calibration file (H100, H200), "
        f"{UNCALIBRATED_MARGIN * 100:.0f}%% on others; {CPU_HEADROOM} on the cpu, where none was measured)",
    )
    p.add_argument(
        "--allow-beyond-context",
        action="store_true",
        help="allow --seq-len beyond the model's max_position_embeddings",
    )
    p.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    p.add_argument(
        "--logits-handling",
        choices=list(LOGITS_HANDLING),
        default="memfit",
        help="how the trainer holds the [tokens, vocab] logits around its loss: memfit (its own "
        "trainer), hf-model-fp32 (transformers <= 4.45), hf-loss-function (transformers >= 4.46), "
        "torchtune-held (torchtune recipes without `del logits`)",
    )
    p.add_argument(
        "--trainer-loader",
        choices=list(TRAINER_LOADERS),
        default="memfit",
        help="how a resume loads the optimizer state: memfit (its trainer copies it into the state "
        "that exists) or deepspeed (DeepSpeed's own load, as other trainers on DeepSpeed run it: at "
        "ZeRO-0 in 16-bit m and v are held twice while it loads)",
    )
    p.add_argument(
        "--nccl-mib",
        type=float,
        default=None,
        help="NCCL communicator memory per GPU process when world > 1, MiB (default: 1.79 GiB, "
        "NCCL >= 2.19 cuMem, vLLM's measurement, or a calibration's measured figure)",
    )
    p.add_argument(
        "--cpu-adam-rate",
        type=float,
        default=None,
        help="DeepSpeedCPUAdam parameters per second per host core, for optimizer offload (default: "
        f"{DEFAULT_SETTINGS.cpu_adam_params_per_s_per_core:.2g}, measured by benchmarks/bench_cpu_adam.py; "
        "measure yours with it)",
    )
    p.add_argument(
        "--cpu-cores-per-rank",
        type=int,
        default=None,
        help=f"host cores each rank's CPU-Adam runs on (default: {DEFAULT_SETTINGS.cpu_cores_per_rank})",
    )


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """Where the activation terms come from, and the output format."""
    p.add_argument(
        "--activations",
        choices=["analytic", "traced"],
        default="analytic",
        help="activation terms from formulas, or from a traced CPU run of the model's code "
        "(fake tensors, cached per shape; memfit.estimate.trace.trace); a model without a hand-written "
        "card is traced either way",
    )
    p.add_argument(
        "--trace-cache",
        default=None,
        help="traced: cache directory (default: $MEMFIT_TRACE_CACHE or ~/.cache/memfit/traces)",
    )
    p.add_argument(
        "--step-time-calibration",
        default=None,
        metavar="CALIBRATION_JSON",
        help="price the step time from a calibration the workflow's calibrate stage measured on the "
        "machine (results/<model>/<gpu>/calibration.json: each micro step's computation and DeepSpeed's "
        "runtime, affine in the layers); one of another model shape, GPU, world size or backend, or "
        "without this candidate's shapes, is not used and `step time source:` says why (default: none: "
        "the modelled step, on a GPU each operation at its roofline unless the GPU's calibration file "
        "holds a measured whole-step rate, on the cpu an assumed 40%% MFU)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines on stderr (tracing a model, fit's search steps); estimate's --json is quiet too",
    )
