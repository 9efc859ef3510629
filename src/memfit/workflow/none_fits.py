"""select_config's outputs when no candidate fits: selected.json says so (`"selected": null`,
`"none_fits"`, every candidate with why it lost), and every other output says it too rather than
describe a run (`write_none_fits`); where the exports go (`export_files`)."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

from memfit.atomic import write_json_atomic
from memfit.estimate.selection import NoneFits
from memfit.workflow.config import WorkflowConfig


def export_files(out: dict[str, Path], method: str) -> dict[str, Path]:
    """Where the exports go: exports/ beside selected.json, or the paths `out` declares."""
    from memfit import exports

    return exports.paths(Path(out["selected"]).parent, method) | {k: Path(out[k]) for k in exports.FILES if k in out}


def write_none_fits(
    model: str, gpu: str, method: str, table: dict[str, Any], cfg: WorkflowConfig, e: NoneFits, out: dict[str, Path]
) -> dict[str, Any]:
    """A plan where nothing fits: selected.json says so (`"selected": null`, `"none_fits"`, every
    candidate with why it lost); the other outputs say it too rather than describe a run: run.json
    and ds_config.json hold only `{"none_fits": ...}`, launch.sh prints the reason and exits 1,
    and the exports are replaced by exports/NONE_FITS.txt (each export path Snakemake declares
    holds the reason in that file's own syntax, so nobody can launch it by mistake)."""
    from memfit import exports
    from memfit.atomic import write_text_atomic

    reason = e.reason
    note = {"none_fits": reason}
    write_json_atomic(out["run"], note)
    write_json_atomic(out["ds_config"], note)
    script = f"#!/usr/bin/env bash\n# memfit selected nothing: no candidate fits.\necho {shlex.quote('memfit: ' + reason)} >&2\nexit 1\n"
    write_text_atomic(out["launch"], script)
    Path(out["launch"]).chmod(0o755)
    run_dir = Path(out["selected"]).parent
    files = export_files(out, method)
    shutil.rmtree(run_dir / "exports", ignore_errors=True)  # exports of an earlier plan that did fit
    write_text_atomic(
        run_dir / exports.NONE_FITS, f"memfit selected nothing for {model} on {gpu} ({method}):\n{reason}\n"
    )
    for key, path in files.items():
        if key not in out:
            continue  # not declared (a caller outside the workflow): NONE_FITS.txt alone
        if path.suffix == ".json":
            write_json_atomic(path, note)
        elif path.suffix == ".sh":
            write_text_atomic(path, script)
            path.chmod(0o755)
        else:  # YAML: the reason as its only key, so a trainer reading it fails on an unknown config
            import yaml

            write_text_atomic(path, yaml.safe_dump(note, sort_keys=False, width=1000))
    selected = {
        "model": model,
        "gpu": gpu,
        "method": method,
        "selected": None,
        "none_fits": reason,
        "budget": table["budget"],
        "plan_only": cfg.plan_only,
        "launch": None,
        "candidates": [r.to_json() for r in e.rows],
    }
    write_json_atomic(out["selected"], selected)
    return selected
