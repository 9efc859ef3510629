"""What ran, what was chosen and why, and whether it held: one self-contained HTML page.

`write_report` reads the workflow's JSON outputs (selected.json with candidates.json
beside it, train/summary.json with train/metrics.jsonl beside it, verify_resume.json,
the data stats.json files) and writes a single HTML file: inline CSS, plots as inline
PNG images (matplotlib's Agg canvas, no pyplot state), no script and no external URL,
so the page can be mailed or attached to a ticket as it is.

Every required input (the paths passed in) is read and checked before anything is
written, and the page goes to a temporary sibling that is renamed into place: a
malformed input raises `ReportError` naming the file and leaves the previous page (or
none) untouched. Files found beside the inputs (candidates.json, metrics.jsonl) are
optional: when missing or unreadable the page says so and goes on.

Modules: `inputs` (reading and checking the files into `RunOutputs`; each run's candidates as
rows of the `memfit.results` table), `view` (what the page shows, as plain data), `answer` (the first screen:
each run's answer), `charts`
(figures), `fitmap`, `marks`, `facts` (their data), `fmt` (numbers and configurations in words),
`page` (the Jinja2 environment: templates/*.html.j2, autoescaped, render the page);
`run_summary`, the same outputs and Snakemake's log as one JSON a machine reads (each job's
status and seconds, predicted vs measured, the resume verdicts: benchmarks/gpu_check.sh).

May import `memfit.workflow` (the typed JSON it reads: `rows`), `memfit.estimate` (the fit map),
`memfit.exports` (`FILES`) and the top-level vocabulary; only `memfit.cli`, scripts/report.py and
benchmarks/gpu_check.sh (`python -m memfit.report.run_summary`) use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from memfit.atomic import write_text_atomic

from .fmt import describe
from .inputs import ReportError, RunOutputs, read_inputs
from .page import render

__all__ = ["ReportError", "RunOutputs", "describe", "write_report"]

Paths = Iterable[str | os.PathLike] | str | os.PathLike


def write_report(
    selected: Paths,
    summaries: Paths | None,
    resume: Paths | None,
    data_stats: Paths | None,
    out_html: str | os.PathLike,
    facts_root: str | os.PathLike | None = None,
    bench_dir: str | os.PathLike | None = None,
) -> Path:
    """Write the report page to `out_html` atomically; return its path.

    `summaries` and `resume` are matched to runs by directory
    (`<run>/train/summary.json`, `<run>/verify_resume.json`); any that match no run are
    still shown, under "Inputs not matched to a run", so a failed check is never hidden.
    `facts_root` (default: the parent of `out_html`'s directory) is where config/ and
    benchmarks/ are read for the "Run facts" section; `bench_dir` is the run's benchmark folder
    (a config's `benchmarks_dir`: benchmarks/<run>/ for a named run; default facts_root/benchmarks).
    """
    out = Path(out_html)
    # the report rule writes results/report.html: the Snakemake working directory is its parent's parent
    root = Path(facts_root) if facts_root is not None else out.resolve().parent.parent
    bench = Path(bench_dir) if bench_dir is not None else None
    page = render(read_inputs(selected, summaries, resume, data_stats), root, out.parent, bench)
    write_text_atomic(out, page)
    return out
