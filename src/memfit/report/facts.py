"""Run facts for the report (data for templates/facts.html.j2 and exports.html.j2): package versions, git commit, config hashes, wall time per rule.

Read at report time from the environment the report rule runs in (the workflow's own
environment) and from the Snakemake working directory `root`: `config/*.yaml` and the
`benchmark:` files under `benchmarks/` (Snakemake's TSV: `s` wall seconds, `max_rss` MB; see
https://snakemake.readthedocs.io/en/stable/snakefiles/rules.html#benchmark-rules).
"""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

PACKAGES = ("memfit", "torch", "deepspeed", "transformers", "trl", "snakemake")


def versions() -> list[tuple[str, str]]:
    out = [("python", platform.python_version())]
    for name in PACKAGES:
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append((name, "not installed"))
    return out


def git_commit(root: Path) -> str:
    """`<sha> (uncommitted changes)` or `<sha>`; '—' outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "— (not a git checkout)"
    return f"{sha} (uncommitted changes)" if dirty else sha


def config_hashes(root: Path) -> list[tuple[str, str]]:
    """sha256 (first 16 hex digits) of each config/*.yaml: which configuration produced this run."""
    return [
        (str(p.relative_to(root)), hashlib.sha256(p.read_bytes()).hexdigest()[:16])
        for p in sorted((root / "config").glob("*.yaml"))
    ]


def benchmarks(bench_dir: Path, models: set[str] | None = None) -> list[tuple[str, str, float, float | None]]:
    """(rule, target, wall seconds, max RSS MB) for each <bench_dir>/**/<rule>.tsv row; with `models`,
    only the rows of those models (every rule writes <bench_dir>/{model}/..., workflow/rules/*.smk), so
    the default run's report leaves out the named runs' benchmarks/<run>/ beside its own."""
    rows = []
    for p in sorted(bench_dir.rglob("*.tsv")):
        if models is not None and p.relative_to(bench_dir).parts[0] not in models:
            continue
        try:
            with p.open(newline="") as f:
                for rec in csv.DictReader(f, delimiter="\t"):
                    rss = rec.get("max_rss")
                    rel = p.relative_to(bench_dir)
                    # probe_candidate writes benchmarks/{model}/{gpu}/{method}/probes/{cand}.tsv (workflow/rules/plan.smk)
                    rule, target = (
                        ("probe_candidate", str(rel.with_suffix("")))
                        if p.parent.name == "probes"
                        else (p.stem, str(rel.parent))
                    )
                    rows.append(
                        (
                            rule,
                            target,
                            float(rec["s"]),
                            float(rss) if rss not in (None, "", "NA", "-") else None,
                        )
                    )
        except (OSError, KeyError, ValueError):
            continue  # a file being written, or not Snakemake's format: not a run fact
    return rows


def run_facts(root: Path, bench_dir: Path | None = None, models: set[str] | None = None) -> dict:
    """The "Run facts" section's data (templates/facts.html.j2): config/ under `root`, the benchmark
    files of `models` under `bench_dir` (default root/benchmarks: the run's `benchmarks_dir`)."""
    bench_dir = root / "benchmarks" if bench_dir is None else Path(bench_dir)
    bench = benchmarks(bench_dir, models)
    total: dict[str, float] = {}
    for rule, _, s, _ in bench:
        total[rule] = total.get(rule, 0.0) + s
    return {
        "versions": versions(),
        "commit": git_commit(root),
        "config_hashes": config_hashes(root),
        "benchmarks": bench,
        "benchmark_dir": bench_dir,
        "per_rule": sorted(total.items(), key=lambda x: -x[1]),  # summed over each rule's jobs
    }


# What select_config writes beside selected.json (workflow/rules/plan.smk), in the order a reader
# launches with it: memfit's own files, then the exports for other trainers (memfit.exports.FILES).
_LAUNCH_FILES = {
    "launch.sh": "memfit launch script (what the train rule runs)",
    "run.json": "memfit run config",
    "ds_config.json": "memfit DeepSpeed config",
}
_EXPORT_WHAT = {
    "openrlhf": "OpenRLHF command (deepspeed --module openrlhf.cli.train_*)",
    "llamafactory": "LLaMA-Factory config (llamafactory-cli train)",
    "llamafactory_ds": "LLaMA-Factory's DeepSpeed config",
    "llamafactory_dataset_info": "LLaMA-Factory dataset registry",
    "hf_args": "HF TrainingArguments (with TRL and peft fields)",
    "hf_ds": "HF Trainer's DeepSpeed config",
}
_MAX_SHOWN = 20_000  # characters of one export shown inline
# Other files beside selected.json shown too (a user's own export), but not the workflow's bookkeeping.
_OTHER_SUFFIXES = {".json", ".yaml", ".yml", ".sh", ".toml", ".txt", ".md"}
_NOT_EXPORTS = {"selected.json", "candidates.json", "verify_resume.json"}


def launch_files(run_dir: Path, method: str) -> list[tuple[Path, str]]:
    """(path, what it is) of every launch file and export select_config wrote for this run that
    exists: memfit's launch.sh/run.json/ds_config.json, the exports (memfit.exports.paths), and
    exports/NONE_FITS.txt where nothing fit; other files under exports/ last."""
    from memfit import exports

    found = [(run_dir / name, what) for name, what in _LAUNCH_FILES.items()]
    none_fits = run_dir / exports.NONE_FITS
    if none_fits.is_file():
        found.insert(0, (none_fits, "why nothing was selected"))
    from memfit.exports.openrlhf import NO_TRAINER

    what = dict(_EXPORT_WHAT)
    if method in NO_TRAINER:  # its script only says so (and exits 2)
        what["openrlhf"] = f"OpenRLHF has no {method} trainer: the script says why and exits 2"
    found += [(p, what.get(k, k)) for k, p in exports.paths(run_dir, method).items()]
    known = {p for p, _ in found}
    extra = (
        sorted(p for p in run_dir.iterdir() if p.suffix in _OTHER_SUFFIXES and p.name not in _NOT_EXPORTS)
        if run_dir.is_dir()
        else []
    )
    if (run_dir / "exports").is_dir():
        extra += sorted((run_dir / "exports").rglob("*"))
    return [(p, w) for p, w in found if p.is_file()] + [
        (p, "other file") for p in extra if p.is_file() and p not in known
    ]


def _href(path: Path, link_base: Path | None) -> str:
    """The link to `path` from a page in `link_base` (relative, so the results folder can move)."""
    if link_base is None:
        return path.resolve().as_uri()
    return Path(os.path.relpath(path.resolve(), link_base.resolve())).as_posix()


def export_files(run_dir: Path, method: str, link_base: Path | None = None) -> list[dict]:
    """The launch files and exports of one run (`launch_files`): name, what it is, the link
    (relative to `link_base`, the report's folder), its size and text (cut at _MAX_SHOWN
    characters), or why it could not be read."""
    out = []
    for p, what in launch_files(run_dir, method):
        name = p.relative_to(run_dir).as_posix()
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            out.append({"name": name, "what": what, "error": str(e)})
            continue
        cut = f"\n… ({len(text) - _MAX_SHOWN:,} more characters in the file)" if len(text) > _MAX_SHOWN else ""
        out.append({"name": name, "what": what, "error": None, "href": _href(p, link_base), "size": len(text),
                    "text": text[:_MAX_SHOWN] + cut})  # fmt: skip
    return out
