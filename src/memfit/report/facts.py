"""Run facts for the report: package versions, git commit, config hashes, wall time per rule.

Read at report time from the environment the report rule runs in (the workflow's own
environment) and from the Snakemake working directory `root`: `config/*.yaml` and the
`benchmark:` files under `benchmarks/` (Snakemake's TSV: `s` wall seconds, `max_rss` MB; see
https://snakemake.readthedocs.io/en/stable/snakefiles/rules.html#benchmark-rules).
"""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path

from .fmt import _e, _secs

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


def benchmarks(root: Path) -> list[tuple[str, str, float, float | None]]:
    """(rule, target, wall seconds, max RSS MB) for each benchmarks/**/<rule>.tsv row."""
    rows = []
    for p in sorted((root / "benchmarks").rglob("*.tsv")):
        try:
            with p.open(newline="") as f:
                for rec in csv.DictReader(f, delimiter="\t"):
                    rss = rec.get("max_rss")
                    rel = p.relative_to(root / "benchmarks")
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


def facts_section(root: Path) -> str:
    """The "Run facts" section as HTML."""
    kv = "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(v)}</code></td></tr>" for k, v in versions())
    kv += f"<tr><th>git commit</th><td><code>{_e(git_commit(root))}</code></td></tr>"
    for name, h in config_hashes(root):
        kv += f"<tr><th>{_e(name)} sha256</th><td><code>{_e(h)}</code></td></tr>"
    out = ["<h2 id='facts'>Run facts</h2>", f"<table>{kv}</table>"]
    bench = benchmarks(root)
    if bench:
        total: dict[str, float] = {}
        for rule, _, s, _ in bench:
            total[rule] = total.get(rule, 0.0) + s
        rows = "".join(
            f"<tr><td>{_e(r)}</td><td class='n'>{_e(_secs(s))}</td></tr>"
            for r, s in sorted(total.items(), key=lambda x: -x[1])
        )
        out.append(
            f"<h3>Wall time per rule</h3><p class='muted'>From Snakemake's benchmark files under <code>{_e(root / 'benchmarks')}</code>, summed over each rule's jobs.</p>"
            f"<table><tr><th>rule</th><th>wall time</th></tr>{rows}</table>"
        )
        jobs = "".join(
            f"<tr><td>{_e(r)}</td><td><code>{_e(t)}</code></td><td class='n'>{_e(_secs(s))}</td><td class='n'>{'—' if m is None else f'{m:,.0f} MB'}</td></tr>"
            for r, t, s, m in bench
        )
        out.append(
            f"<details><summary>{len(bench)} jobs</summary><table><tr><th>rule</th><th>wildcards</th><th>wall time</th><th>max RSS</th></tr>{jobs}</table></details>"
        )
    else:
        out.append(
            "<p class='muted'>No Snakemake benchmark files (benchmarks/**/*.tsv) beside this run.</p>"
        )
    return "\n".join(out)


# Files beside selected.json that are the workflow's own bookkeeping, not something to launch with.
_NOT_EXPORTS = {"selected.json", "candidates.json", "verify_resume.json"}
_EXPORT_SUFFIXES = {".json", ".yaml", ".yml", ".sh", ".toml", ".txt", ".md"}
_MAX_SHOWN = 20_000  # characters of one export shown inline


def exports_block(run_dir: Path) -> str:
    """Each launch/export file beside selected.json (launch.sh, run.json, ds_config.json, trainer
    exports such as an OpenRLHF command, a LLaMA-Factory YAML, HF TrainingArguments JSON), folded."""
    files = (
        sorted(
            p
            for p in run_dir.iterdir()
            if p.is_file() and p.suffix in _EXPORT_SUFFIXES and p.name not in _NOT_EXPORTS
        )
        if run_dir.is_dir()
        else []
    )
    if not files:
        return ""
    out = [f"<p>Launch files and exports beside <code>{_e(run_dir / 'selected.json')}</code>:</p>"]
    for p in files:
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            out.append(f"<p class='bad'>{_e(p.name)}: unreadable ({_e(e)})</p>")
            continue
        cut = (
            f"\n… ({len(text) - _MAX_SHOWN:,} more characters in the file)"
            if len(text) > _MAX_SHOWN
            else ""
        )
        out.append(
            f"<details><summary><code>{_e(p.name)}</code> ({len(text):,} characters)</summary><pre><code>{_e(text[:_MAX_SHOWN] + cut)}</code></pre></details>"
        )
    return "\n".join(out)
