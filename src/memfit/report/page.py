"""The page itself: one self-contained HTML file (inline CSS and images, no script, no external URL),
rendered from the Jinja2 templates in templates/ (base.html.j2, page.html.j2 and one template per
part) with autoescaping on: `view` computes the data, the templates present it."""

from __future__ import annotations

import html
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from .charts import MAX_BARS
from .fitmap import MAX_NOTE
from .fmt import _bytes, _plain, _secs, _tps
from .inputs import Inputs
from .view import page_context


def _escape(value: Any) -> Any:
    """Every value a template prints, escaped with the entities the page has always used
    (html.escape: `&quot;`, `&#x27;`); None prints as nothing. Markup (a macro's output) passes."""
    if isinstance(value, Markup):
        return value
    return Markup(html.escape("" if value is None else str(value), quote=True))


@cache
def environment() -> jinja2.Environment:
    """The templates shipped in memfit/report/templates (package data), autoescaped."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("memfit.report", "templates"),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html", "j2"), default_for_string=True, default=True),
        undefined=jinja2.StrictUndefined,  # a misspelt field fails the render instead of printing nothing
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_escape,
    )
    env.filters.update(bytes=_bytes, secs=_secs, tps=_tps, plain=_plain)
    env.globals.update(max_bars=MAX_BARS, max_note=MAX_NOTE)
    return env


def render(
    inputs: Inputs, facts_root: Path | None = None, link_base: Path | None = None, bench_dir: Path | None = None
) -> str:
    """The whole page as one string; with `facts_root` (the Snakemake working directory) a "Run facts" section.
    `link_base` is the folder the page is written to: links to each run's launch files and exports
    are relative to it (absolute file:// links without it). `bench_dir`: the run's benchmark folder
    (default facts_root/benchmarks)."""
    context = page_context(inputs, facts_root, link_base, bench_dir)
    return environment().get_template("page.html.j2").render(context) + "\n"
