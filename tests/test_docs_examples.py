"""Every `memfit ...` command shown in README.md and docs/*.md is run, so no example goes stale.

The convention the pages follow (docs/development.md, "CLI examples in the docs"):

- In a fenced block of any language, a line `$ memfit ...` is a command whose output follows it,
  up to the next `$ ` line or the end of the block. In a ```bash, ```sh or ```console block a
  line `memfit ...` (no prompt) is a command whose output is not shown. A line ending in `\\`
  continues on the next; `# ...` ends the command (a comment).
- The command must exit as the page implies: N where the command carries the comment `# exit N`,
  else 1 where the shown output has `verdict: DOES NOT FIT` (memfit's exit status for a
  configuration that does not fit), else 0.
- Each shown output line must appear in what the command prints (stdout, then stderr), in order,
  numbers included: a line `...` (or `...the rest`, a description) skips output, `...` inside a
  line stands for any text.
- A block preceded by `<!-- not run: why -->` is not run (it needs a GPU, a cluster, the network,
  a finished workflow run or minutes); the reason must be given.

Each command runs in this process through `memfit.cli.main` with HF_HUB_OFFLINE=1, from the
repository root (the pages' paths are relative to it), against the test session's trace cache
(conftest.py)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from memfit import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", flags=re.S | re.M)
SKIP = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$", flags=re.S)
EXIT = re.compile(r"#\s*exit\s+(\d+)\b")
SHELL = {"bash", "sh", "shell", "console"}


@dataclass
class Example:
    page: str  # relative to the repository
    line: int  # of the command, 1-based
    command: str  # as a user types it, comments and continuations removed
    exit_code: int
    shown: list[str]
    skipped: str | None  # the marker's reason, or None when the example runs

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _command(lines: list[str], i: int) -> tuple[str, int | None, int]:
    """(command, its `# exit N` or None, index after it) of the command starting at lines[i]."""
    parts, code = [], None
    while True:
        text = lines[i]
        m = EXIT.search(text)
        if m:
            code = int(m.group(1))
        text = text.split(" #", 1)[0].rstrip()
        i += 1
        if text.endswith("\\") and i < len(lines):
            parts.append(text[:-1].strip())
            continue
        parts.append(text.strip())
        return " ".join(parts), code, i


def examples(page: Path) -> list[Example]:
    """The `memfit` commands of one page, in the order they appear."""
    text = page.read_text(encoding="utf-8")
    out = []
    for fence in FENCE.finditer(text):
        lang, body = fence.group(1).lower(), fence.group(2)
        before = text[: fence.start()].rstrip()
        marker = SKIP.search(before[before.rfind("\n") + 1 :] if "\n" in before else before)
        first = text[: fence.start()].count("\n") + 2  # the block's first line, 1-based
        lines = body.rstrip("\n").splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            prompt = line.startswith("$ memfit ")
            bare = lang in SHELL and line.startswith("memfit ")
            if not (prompt or bare):
                i += 1
                continue
            start = i
            command, code, i = _command(lines, i)
            if prompt:
                command = command[2:]
            shown = []
            if prompt:
                while i < len(lines) and not lines[i].startswith("$ "):
                    shown.append(lines[i])
                    i += 1
            if code is None:  # 1: the documented exit status of a configuration that does not fit
                code = 1 if any(s.startswith("verdict: DOES NOT FIT") for s in shown) else 0
            out.append(
                Example(
                    page=str(page.relative_to(ROOT)),
                    line=first + start,
                    command=command,
                    exit_code=code,
                    shown=shown,
                    skipped=marker.group(1) if marker else None,
                )
            )
    return out


ALL = [ex for page in PAGES for ex in examples(page)]
RUN = [ex for ex in ALL if ex.skipped is None]


def test_the_pages_have_their_examples():
    """The extraction finds what the pages show (a changed convention would silently run nothing)."""
    pages = {ex.page for ex in RUN}
    assert {"README.md", "docs/estimator.md", "docs/walkthrough.md"} <= pages
    assert any(" --zero 2,3 " in ex.command for ex in RUN)
    assert any(ex.exit_code == 1 for ex in RUN), "no example shows a configuration that does not fit"
    assert len(RUN) >= 15


def test_every_example_not_run_says_why():
    for ex in ALL:
        if ex.skipped is not None:
            assert len(ex.skipped) >= 10, f"{ex.id}: `<!-- not run: ... -->` must say why ({ex.skipped!r})"


def _matcher(line: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in line.split("...")) + "$")


def check_output(command: str, shown: list[str], printed: list[str]) -> None:
    """Each shown line appears in `printed`, in order (`...` skips; `...` in a line is any text)."""
    at = 0
    for line in shown:
        if line.strip() == "..." or line.startswith("...the "):
            continue
        pattern = _matcher(line)
        while at < len(printed) and not pattern.match(printed[at]):
            at += 1
        assert at < len(printed), f"{command}\nthe page shows:\n{line}\nnot printed (in order); printed:\n" + "\n".join(
            printed
        )
        at += 1


def run_example(ex: Example, capsys, monkeypatch) -> tuple[int, list[str]]:
    monkeypatch.chdir(ROOT)  # the examples' paths are relative to the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = shlex.split(ex.command)[1:]
    try:
        rc = cli.main(argv)
    except SystemExit as stop:  # argparse's own refusals
        rc = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return rc, captured.out.splitlines() + captured.err.splitlines()


@pytest.mark.parametrize("ex", RUN, ids=[ex.id for ex in RUN])
def test_each_example_runs_as_the_page_shows(ex: Example, capsys, monkeypatch):
    rc, printed = run_example(ex, capsys, monkeypatch)
    assert rc == ex.exit_code, (
        f"{ex.id}: `{ex.command}` exited {rc}, the page implies {ex.exit_code}"
        " (add `# exit N` to the command where N is intended); printed:\n" + "\n".join(printed)
    )
    check_output(f"{ex.id}: {ex.command}", ex.shown, printed)


def test_a_changed_number_fails(capsys, monkeypatch):
    """The check is not vacuous: one digit changed in a shown line is caught."""
    ex = next(ex for ex in RUN if ex.page == "README.md" and ex.shown)
    rc, printed = run_example(ex, capsys, monkeypatch)
    target = next(i for i, line in enumerate(ex.shown) if re.search(r"\d", line) and "..." not in line)
    stale = list(ex.shown)
    stale[target] = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), stale[target], count=1)
    check_output(ex.command, ex.shown, printed)
    with pytest.raises(AssertionError, match="not printed"):
        check_output(ex.command, stale, printed)
