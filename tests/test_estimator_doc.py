"""docs/estimator.md's examples are what the CLI prints: every `$ memfit estimate|fit ...` block
is run and each line it shows must appear in the output, in order (a line `...` skips output,
`...` inside a line stands for any text). The traced example is left out: a cold trace of
Qwen2.5-72B takes minutes (its figures are checked by hand when the page is rerun)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from memfit import cli

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "estimator.md"


def _examples() -> list[tuple[str, list[str]]]:
    """(command, shown lines) of every fenced block that starts with `$ memfit `."""
    out = []
    for block in re.findall(r"```\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S):
        lines = block.rstrip("\n").splitlines()
        if lines and lines[0].startswith("$ memfit "):
            out.append((lines[0][2:], lines[1:]))
    return out


EXAMPLES = [(cmd, shown) for cmd, shown in _examples() if "--activations traced" not in cmd]


def test_the_page_has_its_examples():
    assert len(EXAMPLES) >= 6 and any(" --zero 2,3 " in cmd for cmd, _ in EXAMPLES)


@pytest.mark.parametrize(("command", "shown"), EXAMPLES, ids=[c[:60] for c, _ in EXAMPLES])
def test_each_example_prints_what_the_page_shows(command, shown, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples' paths are relative to the repository
    argv = shlex.split(command)[1:]
    cli.main(argv)
    printed = capsys.readouterr().out.splitlines()
    at = 0
    for line in shown:
        if line.strip() == "..." or line.startswith("...the "):
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")) + "$")
        while at < len(printed) and not pattern.match(printed[at]):
            at += 1
        assert at < len(printed), f"{command}\nthe page shows:\n{line}\nnot printed (in order); printed:\n" + "\n".join(
            printed
        )
        at += 1
