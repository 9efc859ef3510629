"""The `memfit` command. Each subcommand lives in the module that owns its logic.

memfit estimate --model qwen2-7b --gpu rtx4090 --num-gpus 4 --zero 3 --json
memfit estimate --model llama-3.1-8b --gpu a100-80gb --num-gpus 8 --zero 2,3 --micro-batch 1,2,4   (ranked)
memfit fit --maximize seq_len --model gemma-3-12b --gpu a100-80gb
memfit train --config results/demo-tiny/cpu/sft/run.json      (one rank; see `launch`)
memfit launch --config results/demo-tiny/cpu/sft/run.json --nproc 2
memfit compare-results baseline/results results        (exit 1 on a difference)
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, function, one-line help); imported lazily so `memfit estimate`
# does not pay for importing DeepSpeed.
COMMANDS = {
    "estimate": (
        "memfit.estimate",
        "main",
        "predict memory and step time of a configuration, what would make it fit; lists rank several",
    ),
    "fit": ("memfit.estimate", "fit_main", "largest seq_len or micro_batch that fits, and how far each lever goes"),
    "train": ("memfit.train.rank", "main", "run one training rank from a run config (JSON)"),
    "launch": ("memfit.train.launch", "main", "start all ranks of a run on this node"),
    "calibrate": ("memfit.train.calibrate", "main", "one rank of a step-time calibration (see `launch`)"),
    "check-config": ("memfit.workflow.check_config", "main", "validate a workflow config (YAML line and column)"),
    "compare-results": (
        "memfit.workflow.compare_results",
        "main",
        "compare two results/ trees (selections, losses, resume)",
    ),
}


def usage() -> str:
    lines = ["usage: memfit <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines.append("\n`memfit <command> --help` shows a command's options.")
    return "\n".join(lines)


def run_config_problem(path: str) -> str | None:
    """Why the run config JSON at `path` cannot run (one sentence naming the file), or None."""
    import json
    from pathlib import Path

    p = Path(path)
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return f"{p}: no such run config"
    except IsADirectoryError:
        return f"{p}: is a directory, not a run config JSON file"
    except UnicodeDecodeError:
        return f"{p}: not UTF-8 text (expected a run config JSON)"
    except json.JSONDecodeError as exc:
        return f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
    except OSError as exc:
        return f"{p}: cannot read it ({exc.strerror})"
    if not isinstance(data, dict):
        return f"{p}: expected a JSON object of run config keys, got {type(data).__name__}"
    import dataclasses

    from memfit.train.run_config import RunConfig

    fields = dataclasses.fields(RunConfig)
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        return f"{p}: missing run config key(s) {', '.join(missing)}"
    try:
        RunConfig.load(p)
    except (ValueError, TypeError, KeyError) as exc:
        msg = str(exc).strip("'\"")
        return msg if str(p) in msg else f"{p}: {msg}"
    return None


def _config_arg(rest: list[str]) -> str | None:
    for i, arg in enumerate(rest):
        if arg == "--config" and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


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
    path = _config_arg(rest) if name in ("train", "launch") else None
    if path is not None:
        problem = run_config_problem(path)
        if problem:
            print(f"memfit {name}: error: {problem}", file=sys.stderr)
            return 2
    try:
        rc = int(getattr(importlib.import_module(module), func)(rest) or 0)
        sys.stdout.flush()  # a closed pipe fails here, inside the handler, not at exit
        return rc
    except BrokenPipeError:
        # the reader went away (`memfit estimate ... | head -1`): stop quietly; point stdout at
        # /dev/null so the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
