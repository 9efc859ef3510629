"""How much memory and time a fine-tuning configuration needs, predicted without a GPU.

    memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --seq-len 128 --json
    memfit fit --maximize seq_len --model glm-4-9b --gpu a100-80gb --num-gpus 8 --method dpo

`estimate()` is pure arithmetic over the architecture card (`catalog.ModelArch`), the GPU
card (`catalog.GPU`) and one `space.Candidate`. Each module answers one question, and every
term says where it comes from:

- `settings`: what the estimator takes besides the candidate (`Settings`), `EstimateError`;
- `validity`: what the hardware cannot run, what an architecture card lacks;
- `params`: parameter layout, LoRA targets and trainable parameters of an architecture;
- `states`: the ZeRO model states (params, grads, optimizer) per rank, on the device and
  offloaded: the ZeRO paper (Rajbhandari et al. 2020, sec. 3) as DeepSpeed implements it, equal
  to DeepSpeed's own `estimate_zero2/3_model_states_mem_needs` under their assumptions
  (tests/test_estimate.py);
- `activation_memory`: what autograd saves in one micro step, from formulas (Korthikanti et al.
  2022, re-derived for transformers' decoder layers and attention kernels) or, with
  `Settings(activations="traced")`, from a traced run of the model's own code on fake CPU
  tensors (`traced`, memfit.estimate.trace); the Estimate's `activations_source` says which. On the CPU
  ground truth the traced peaks are within 3.0% (median 0.1%) where the formulas are within 4.5%
  (median 0.4%), on 32 cases (tests/test_trace.py, tests/test_estimate_groundtruth.py);
  `trainer_terms` adds what the trainer holds beyond autograd (QLoRA dequantization, ZeRO-3's
  linear inputs, the logits), `logits` the chunked loss's share;
- `phases`: which phase of a step (forward, backward, optimizer step, resume, DPO reference
  forward) holds the peak, and its breakdown into components;
- `costs`: fragmentation, CUDA context and workspaces (stated heuristics), host RAM per node,
  the modelled step time: on a GPU its computation from `roofline` (each operation of the step
  at the measured GEMM/attention rates or HBM bandwidth), on the cpu device a fixed MFU;
- `timing`: the step time priced from a calibration measured on the machine (memfit.train.calibrate's
  calibration.json: the model's own micro steps under each DeepSpeed engine), used when
  `Settings.step_time_calibration` holds the candidate; the Estimate's `time_source` says which;
- `core`: `estimate()` (phases -> breakdown -> verdict), `estimate_space`, `fit`;
- `selection` over `rows`: which candidate runs (the fastest that fits, measured beats predicted,
  ties within the noise settled by a stated rule) and why every other one lost; the workflow's
  select stage and `rank` (`memfit estimate` with lists) both use it;
- `cli`: `memfit estimate` and `memfit fit`.

The numbers are per rank (one GPU), in bytes. Host memory is per node.

Owns the estimator and what it reads: the GPU and model catalogs (`catalog`, `arch`: `ModelArch`,
`hf_config`: config.json parsing), measured calibration (`calibration`), the fake-tensor tracer
(`trace`, `trace_step`) and the checks against public measurements (`validation`,
`validation_cases` for memory, `validation_time` for step time). May import the top-level vocabulary (`memfit.space`, `memfit.units`,
`memfit.atomic`) and the loss math it traces (`memfit.train.losses`, `memfit.train.vocab_loss`);
never `memfit.workflow`, `memfit.exports` or `memfit.report`.
"""

from memfit.estimate.activation_memory import Activations, activations
from memfit.estimate.cli import fit_main, main, render
from memfit.estimate.core import Estimate, Job, estimate, estimate_space, fit
from memfit.estimate.costs import (
    NCCL_CUMEM_BYTES,
    HostMemory,
    cached_logits_block,
    device_overheads,
    fragmentation,
    host_memory,
    step_time,
)
from memfit.estimate.params import ParamLayout, lora_targets, param_layout, trainable_params
from memfit.estimate.phases import StepPhases, peak_breakdown, step_phases
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.estimate.states import (
    NF4_BYTES_PER_PARAM,
    ModelStates,
    model_states,
    zero3_gathered_bytes,
    zero3_subgroups,
)
from memfit.estimate.traced import prefetch_traces, traced_activations
from memfit.estimate.validity import check_arch, hardware_problems

__all__ = [
    "DEFAULT_SETTINGS",
    "NCCL_CUMEM_BYTES",
    "NF4_BYTES_PER_PARAM",
    "Activations",
    "Estimate",
    "EstimateError",
    "HostMemory",
    "Job",
    "ModelStates",
    "ParamLayout",
    "Settings",
    "StepPhases",
    "activations",
    "cached_logits_block",
    "check_arch",
    "device_overheads",
    "estimate",
    "estimate_space",
    "fit",
    "fit_main",
    "fragmentation",
    "hardware_problems",
    "host_memory",
    "lora_targets",
    "main",
    "model_states",
    "param_layout",
    "peak_breakdown",
    "prefetch_traces",
    "render",
    "step_phases",
    "step_time",
    "trainable_params",
    "traced_activations",
    "zero3_gathered_bytes",
    "zero3_subgroups",
]
