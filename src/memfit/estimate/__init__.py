"""How much memory and time a fine-tuning configuration needs, predicted without a GPU.

    memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --seq-len 128 --json
    memfit fit --maximize seq_len --model glm-4-9b --gpu a100-80gb --num-gpus 8 --method dpo

`estimate()` is pure arithmetic over the architecture card (`models.arch.ModelArch`), the GPU
card (`models.catalog.GPU`) and one `space.Candidate`. Each module answers one question, and
every term says where it comes from. The modules live in four rooms, bottom up, each importing
only the rooms below it (each room's `__init__` says what it owns):

- `models/`: the cards: architectures (`arch`, `catalog`, `hf_config`, `generic`, `inventory`),
  parameter layout and LoRA targets (`params`), what the hardware cannot run or a card lacks
  (`validity`), each GPU's measured calibration (`calibration`);
- `memory/`: every memory term per rank: the ZeRO model states (`states`: the ZeRO paper,
  Rajbhandari et al. 2020, sec. 3, as DeepSpeed implements it, equal to DeepSpeed's own
  `estimate_zero2/3_model_states_mem_needs` under their assumptions, tests/test_estimate.py),
  what autograd saves (`activation_memory`: formulas after Korthikanti et al. 2022, re-derived
  for transformers' decoder layers and attention kernels), what the trainer holds beyond autograd
  (`trainer_terms`, `logits`), which phase of a step holds the peak (`phases`), CUDA context,
  NCCL, fragmentation and host RAM (`overheads`) and the reserved-memory term (`allocator`);
- `trace/`: with `Settings(activations="traced")`, activations from a traced run of the model's
  own code on fake CPU tensors (`traced` over `trace`); the Estimate's `activations_source` says
  which. On the CPU ground truth the traced peaks are within 3.0% (median 0.1%) where the formulas
  are within 4.5% (median 0.4%), on 32 cases (tests/test_trace.py, tests/test_estimate_groundtruth.py);
- `time/`: the modelled step time (`costs`): on a GPU its computation from `roofline` (each
  operation of the step at the measured GEMM/attention rates or HBM bandwidth), on the cpu device
  a fixed MFU; or priced from a calibration measured on the machine (`timing`: memfit.train.calibrate's
  calibration.json), used when `Settings.step_time_calibration` holds the candidate; the
  Estimate's `time_source` says which.

On top, in this package: `settings` (what the estimator takes besides the candidate: `Settings`,
`EstimateError`; every room may import it, and `errors`), `core` (`estimate()`: phases ->
breakdown -> verdict, `estimate_space`), `search` (`fit`: the largest value that fits), `fit`,
`advice`, `coverage`, `selection` over
`rows` (which candidate runs and why every other one lost; the workflow's select stage and `rank`
both use it) and the CLI (`cli`: `memfit estimate` and `memfit fit`). The numbers are per rank
(one GPU), in bytes. Host memory is per node. The checks against public measurements are outside
the library (benchmarks/memfit_validation).

May import the top-level vocabulary (`memfit.space`, `memfit.units`, `memfit.atomic`), the loss
math it traces (`memfit.train.losses`, `memfit.train.vocab_loss`), the trainer's LoRA
configuration and tracker (`memfit.train.lora`, `memfit.train.memory`) and `memfit.data`; never
`memfit.workflow`, `memfit.exports` or `memfit.report`. This `__init__` is the public API
(`from memfit.estimate import estimate, Settings, ...`).
"""

from memfit.estimate.cli import fit_main, main, render
from memfit.estimate.core import Estimate, Job, estimate, estimate_space
from memfit.estimate.memory.activation_memory import Activations, activations
from memfit.estimate.memory.breakdown import peak_breakdown
from memfit.estimate.memory.overheads import (
    NCCL_CUMEM_BYTES,
    HostMemory,
    cached_logits_block,
    device_overheads,
    fragmentation,
    host_memory,
)
from memfit.estimate.memory.phases import StepPhases, step_phases
from memfit.estimate.memory.states import NF4_BYTES_PER_PARAM, ModelStates, model_states
from memfit.estimate.memory.zero3 import zero3_gathered_bytes, zero3_subgroups
from memfit.estimate.models.params import ParamLayout, lora_targets, param_layout, trainable_params
from memfit.estimate.models.validity import check_arch, hardware_problems
from memfit.estimate.search import fit
from memfit.estimate.settings import DEFAULT_SETTINGS, EstimateError, Settings
from memfit.estimate.time.costs import step_time
from memfit.estimate.trace.traced import prefetch_traces, traced_activations

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
