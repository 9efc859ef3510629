"""The selected configuration for the trainers users already run: OpenRLHF, LLaMA-Factory, HF.

`select_config` writes, beside selected.json (`FILES`, under exports/):

- `openrlhf/train_<method>.sh`: a `deepspeed --module openrlhf.cli.train_sft|train_dpo|train_rm`
  command line (OpenRLHF 0.11.2 flag names, `openrlhf/cli/train_sft.py`, `train_dpo.py`,
  `train_rm.py`). OpenRLHF builds its DeepSpeed config from the flags (`openrlhf/utils/deepspeed/
  deepspeed_utils.py get_train_ds_config`), so there is no JSON beside it. OpenRLHF has no ORPO,
  SimPO or KTO trainer: for those the script says so and exits 2 (`openrlhf.NO_TRAINER`).
- `llamafactory/train_<method>.yaml` + `llamafactory/ds_config.json` + `llamafactory/
  dataset_info.json`: a `llamafactory-cli train` config (LLaMA-Factory 0.9.5,
  `src/llamafactory/hparams/*.py`; rm is `stage: rm`, ORPO and SimPO `stage: dpo` with
  `pref_loss: orpo|simpo`, KTO `stage: kto`), the DeepSpeed JSON it points to, and the dataset
  registry LLaMA-Factory reads from `dataset_dir` (the file must carry that name).
- `hf/training_args.json` + `hf/ds_config.json`: `transformers.TrainingArguments` keyword
  arguments (`HfArgumentParser(TrainingArguments).parse_dict`) and their DeepSpeed JSON. The
  `_memfit` key is not an argument: it holds the fields of the method's TRL config
  (`hf.TRL_CLASSES`: SFTConfig, DPOConfig, RewardConfig, ORPOConfig, CPOConfig with
  loss_type "simpo", KTOConfig), peft's `LoraConfig`, which TrainingArguments has no field for,
  and the levers no field expresses.

Every file lists, in it, the selected levers the tool cannot express (`not_expressible`). The
DeepSpeed JSONs are memfit's ds_config.json (exactly what memfit's trainer runs); the HF and
LLaMA-Factory arguments are set so that the HF Trainer's consistency check between its
arguments and the JSON (`HfTrainerDeepSpeedConfig.trainer_config_process/finalize`) passes:
batch sizes, lr, AdamW betas/eps, weight decay, clipping, precision and, with `max_steps` set to
memfit's step count, the scheduler's steps. Paths are written as the workflow passes them
(relative to the workflow directory, like run.json).

This package owns the export files, one module per trainer (`openrlhf`, `llamafactory`, `hf`)
on a shared skeleton (`common`: `ExportPlan`, `FILES`, headers, the HF schedule fields), and
`write_all`. It may import the shared vocabulary (`memfit.atomic`, `memfit.methods`) and, for
annotations, `memfit.train.run_config`; nothing else of memfit (the workflow's select_config calls
it, the report reads `FILES`): memfit's defaults of the preference methods' hyperparameters are
repeated in `common.PREF_DEFAULTS`, which tests/test_exports_pref.py holds equal to
memfit.train.preference's.
"""

from __future__ import annotations

from pathlib import Path

from memfit.atomic import write_json_atomic, write_text_atomic
from memfit.exports.common import (
    FILES,
    LLAMAFACTORY_VERSION,
    NONE_FITS,
    OPENRLHF_VERSION,
    ExportPlan,
    header,
    not_expressible,
    paths,
)
from memfit.exports.hf import hf_training_args
from memfit.exports.llamafactory import llamafactory_config
from memfit.exports.openrlhf import openrlhf_argv, openrlhf_script, script_argv

__all__ = [
    "FILES",
    "LLAMAFACTORY_VERSION",
    "NONE_FITS",
    "OPENRLHF_VERSION",
    "ExportPlan",
    "hf_training_args",
    "llamafactory_config",
    "openrlhf_argv",
    "openrlhf_script",
    "paths",
    "script_argv",
    "write_all",
]


def write_all(plan: ExportPlan) -> dict[str, Path]:
    """Write every export (each file atomically); returns their paths."""
    import yaml

    files = {k: Path(v) for k, v in (plan.files or paths(".", plan.run.method)).items()}
    script, _ = openrlhf_script(plan)
    write_text_atomic(files["openrlhf"], script)
    files["openrlhf"].chmod(0o755)
    lf, info, lf_missing = llamafactory_config(plan)
    head = header(
        plan,
        f"LLaMA-Factory {LLAMAFACTORY_VERSION} (llamafactory-cli train {files['llamafactory']})",
    )
    head += ["# not expressible in LLaMA-Factory's arguments (this run differs from memfit's here):"]
    head += not_expressible(lf_missing)
    write_text_atomic(files["llamafactory"], "\n".join(head) + "\n" + yaml.safe_dump(lf, sort_keys=False))
    write_json_atomic(files["llamafactory_ds"], plan.ds_config)
    write_json_atomic(files["llamafactory_dataset_info"], info)
    args, _ = hf_training_args(plan)
    write_json_atomic(files["hf_args"], args)
    write_json_atomic(files["hf_ds"], plan.ds_config)
    return files
