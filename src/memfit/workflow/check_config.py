"""`memfit check-config FILE`: read and validate a workflow config as the Snakefile does, before
Snakemake runs. Snakemake reads a `--configfile` itself before the Snakefile and reports a YAML
syntax error as "Config file is not valid JSON or YAML", without the line; this names the file,
line and column, then every other problem (`memfit.workflow.config.validate_config`).

    memfit check-config config/cluster.yaml && snakemake --configfile config/cluster.yaml ...

Exit 0: valid; 2: the problems on stderr. Relative paths in the config are read from the current
directory, as Snakemake reads them from the directory it runs in.
"""

from __future__ import annotations

import argparse
import sys

from memfit.workflow.config import ConfigError, WorkflowConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memfit check-config", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the workflow config YAML (what --configfile names)")
    args = p.parse_args(argv)
    try:
        WorkflowConfig.from_file(args.config)
    except ConfigError as e:
        print(f"memfit check-config: {e}", file=sys.stderr)
        return 2
    print(f"{args.config}: valid")
    return 0
