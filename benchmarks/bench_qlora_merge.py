"""What merging a QLoRA SFT adapter costs: held-out SFT loss before and after the merge.

    .venv/bin/python benchmarks/bench_qlora_merge.py [RUN_DIR] [--out FILE]

RUN_DIR is a finished QLoRA SFT run of the workflow (default `results/qlora/demo-tiny/cpu/sft`, which
`snakemake --cores all --configfile config/qlora.yaml` makes; it must have exported `adapter`).
DPO that starts from such an adapter loads the 4-bit base and merges the SFT adapter into it
(`memfit.train.modeling.load_model`: peft's merge dequantizes each weight, adds the LoRA delta and
quantizes the sum again), so the 4-bit rounding of the merged weights is what DPO starts from.
Printed: the held-out loss (the run's eval rows, response tokens, fp32) of the 4-bit base alone,
of the base with the adapter as trained, merged into the 4-bit base, and merged into the
unquantized base (the `merged` export), and the share of the SFT gain the 4-bit merge keeps.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def heldout_loss(model, rows: list[dict], micro_batch: int = 16) -> float:
    """Mean NLL over the scored tokens of `rows`, as the trainer's evaluation computes it."""
    import torch

    from memfit.train.batches import collate
    from memfit.train.losses import sft_loss

    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), micro_batch):
            batch = collate("sft", rows[i : i + micro_batch], 0)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss, n = sft_loss(logits, batch["labels"])
            total, tokens = total + float(loss) * n, tokens + n
    return total / max(tokens, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?", default="results/qlora/demo-tiny/cpu/sft")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import pandas as pd
    from peft import PeftModel

    from memfit.space import Candidate
    from memfit.train.modeling import load_model
    from memfit.train.run_config import RunConfig

    run = RunConfig.load(Path(args.run) / "run.json")
    cand = Candidate(**run.candidate)
    if cand.finetune != "qlora" or run.export_format != "adapter":
        raise SystemExit(f"{args.run}: needs a QLoRA run that exported its adapter (finetune qlora, export adapter)")
    adapter = str(Path(run.out_dir) / "model")
    rows = [
        {k: (list(v) if hasattr(v, "__len__") else v) for k, v in r.items()}
        for r in pd.read_parquet(Path(run.data_dir) / "eval.parquet").to_dict("records")
    ]
    base = load_model(run.model_path, cand, trainable=False, quant_type=run.qlora_quant_type)
    out = {"base_4bit": heldout_loss(base, rows)}
    out["adapter_on_4bit"] = heldout_loss(PeftModel.from_pretrained(base, adapter), rows)
    # what DPO loads: the adapter-only export merged into the 4-bit base
    out["merged_into_4bit"] = heldout_loss(
        load_model(adapter, cand, trainable=False, quant_type=run.qlora_quant_type), rows
    )
    full = Candidate(**(run.candidate | {"finetune": "full"}))
    merged = PeftModel.from_pretrained(load_model(run.model_path, full, trainable=False), adapter).merge_and_unload()
    out["merged_into_unquantized"] = heldout_loss(merged, rows)
    gain = out["base_4bit"] - out["adapter_on_4bit"]
    out["sft_gain_kept_by_4bit_merge"] = (out["base_4bit"] - out["merged_into_4bit"]) / gain if gain else None
    out["eval_rows"] = len(rows)
    for k, v in out.items():
        print(f"{k:30s} {v:.4f}" if isinstance(v, float) else f"{k:30s} {v}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
