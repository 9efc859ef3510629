"""The `memfit` command. Each subcommand lives in the module that owns its logic.

    memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --json
    memfit fit --maximize seq_len --model gemma-3-12b --gpu a100-80gb
    memfit train --config results/demo-tiny/cpu/sft/run.json      (one rank; see `launch`)
    memfit launch --config results/demo-tiny/cpu/sft/run.json --nproc 2
    memfit compare-results baseline/results results        (exit 1 on a difference)
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help); imported lazily so `memfit estimate`
# does not pay for importing DeepSpeed.
COMMANDS = {
    "estimate": ("memfit.estimate", "main", "predict memory and step time of one configuration"),
    "fit": ("memfit.estimate", "fit_main", "largest seq_len or micro_batch that fits"),
    "train": ("memfit.train", "main", "run one training rank from a run config (JSON)"),
    "launch": ("memfit.launch", "main", "start all ranks of a run on this node"),
    "compare-results": ("memfit.compare_results", "main", "compare two results/ trees (selections, losses, resume)"),
}


def usage() -> str:
    lines = ["usage: memfit <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines.append("\n`memfit <command> --help` shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"memfit: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
