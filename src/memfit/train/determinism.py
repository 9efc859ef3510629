"""What "exact resume" means on each device, and `train.deterministic`, the switch that makes a
GPU run repeatable where PyTorch can.

A resumed run repeats the uninterrupted one bit for bit when every operation after the
checkpoint computes the same bits from the same inputs: memfit restores the weights, optimizer
state, data position and every RNG (Python, NumPy, torch, CUDA) exactly (memfit.train.checkpoint),
so what is left is the kernels.

- On the CPU they are deterministic: resumes are bitwise (tests/test_resume_check.py, the
  demo's verify_resume).
- On CUDA some kernels accumulate in an order that varies from run to run. With
  `train.deterministic: true` memfit turns on `torch.use_deterministic_algorithms(True)` before
  the process group exists (ProcessGroupNCCL then excludes NVLink SHARP, whose reductions vary
  between calls: NVIDIA/nccl#1497), which makes SDPA's flash and memory-efficient backward run
  their deterministic kernels and cuDNN attention step aside (aten/src/ATen/native/transformers/
  cuda/attention_backward.cu, sdp_utils.cpp `check_cudnn_deterministic`), routes index_add_,
  scatter_add_ and gather's backward through sorted index_put_ (cuda/Indexing.cu,
  ScatterGatherKernel.cu), and sets FLASH_ATTENTION_DETERMINISTIC for the flash-attn package
  (transformers modeling_flash_attention_utils.py reads it), as transformers'
  `enable_full_determinism` does. An operation PyTorch has no deterministic CUDA kernel for stops
  the run with PyTorch's error naming it (set `train.deterministic: false` for such a model).
  `CUBLAS_WORKSPACE_CONFIG` is left alone: since PyTorch 2.10 a workspace per cuBLAS handle and
  stream makes cuBLAS reproducible without it (pytorch/pytorch#161749), and setting it would change
  the workspace's size, which the estimate counts. NCCL on one rank copies; on several ranks
  NVIDIA guarantees nothing, and results repeat where the world size, message sizes and topology
  do (they do for a resume on the same machines). The deterministic kernels cost time (and
  `fill_uninitialized_memory` fills every new tensor), and FlashAttention-2's deterministic
  backward ceil(SMs / (b x h)) fp32 dq accumulators where the default keeps one
  (flash-attention csrc/flash_attn/flash_api.cpp `mha_bwd`: dq_accum of nsplits x b x s x h x d), which the estimator does not model: the probes and the
  calibration run with the same setting as training, so the selection rests on measured peaks.
- Without it (`false`, the default, as in transformers' Trainer and torchtitan) a CUDA run is not
  bitwise repeatable, and neither is the uninterrupted run itself: verify_resume then measures the
  spread a second resume from the same checkpoint shows and accepts the resumed run within four
  times that spread (memfit.workflow.resume_check; the factor is a heuristic).
"""

from __future__ import annotations

import os

import torch

BITWISE = "bitwise"
TOLERANCE = "tolerance"


def enable() -> None:
    """Deterministic kernels from here on (module docstring); call before the process group."""
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def expected(device: str, deterministic: bool) -> str:
    """What a resume of a run on `device` ("cpu", "cuda:0") can promise: bitwise, or a tolerance."""
    return BITWISE if deterministic or not str(device).startswith("cuda") else TOLERANCE
