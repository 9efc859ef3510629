"""`memfit check-config FILE`: read and validate a workflow config as the Snakefile does, before
Snakemake runs. Snakemake reads a `--configfile` itself before the Snakefile and reports a YAML
syntax error as "Config file is not valid JSON or YAML", without the line; this names the file,
line and column, then every other problem (`memfit.workflow.config.validate_config`).

    memfit check-config config/cluster.yaml && snakemake --configfile config/cluster.yaml ...

Exit 0: valid; 2: the problems on stderr. A learning rate outside the usual range for its method
and finetune (memfit.train.run_config.lr_range) is a warning on stderr, not a problem: exit 0
(`train.<method>.lr_check: false` silences it). Relative paths in the config are read from the current
directory, as Snakemake reads them from the directory it runs in.
"""

from __future__ import annotations

import argparse
import sys

from memfit.workflow.config import ConfigError, WorkflowConfig


def lr_warnings(config: WorkflowConfig, methods: list[str] | None = None) -> list[str]:
    """One line per method and searched finetune whose given train.<method>.lr lies outside the
    usual range (memfit.train.run_config.lr_warning); none where train.<method>.lr_check is false
    or the lr is left to memfit's default. Printed by check-config and the workflow's prepare_data."""
    from memfit.train.run_config import lr_warning

    out = []
    for method in methods or config.methods:
        section = config.raw["train"].get(method) or {}
        if "lr" not in section or not section.get("lr_check", True):
            continue
        for finetune in (config.raw.get("search") or {}).get("finetune", ["full"]):
            warning = lr_warning(method, finetune, float(section["lr"]))
            if warning:
                out.append(warning)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memfit check-config", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the workflow config YAML (what --configfile names)")
    args = p.parse_args(argv)
    try:
        config = WorkflowConfig.from_file(args.config)
    except ConfigError as e:
        print(f"memfit check-config: {e}", file=sys.stderr)
        return 2
    for warning in lr_warnings(config):
        print(f"memfit check-config: {args.config}: {warning}", file=sys.stderr)
    print(f"{args.config}: valid")
    return 0
