"""`memfit estimate --explain`: every line of the table has a one-line meaning and the module that
computes it, and docs/estimator.md's glossary says the same."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from memfit.estimate import main
from memfit.estimate.cli_render import GLOSSARY

DOCS = Path(__file__).resolve().parents[1] / "docs" / "estimator.md"


def _explained(capsys) -> dict[str, tuple[str, str]]:
    """`memfit estimate --explain` alone (no --model, no --gpu): exit 0, term -> (meaning, source)."""
    with pytest.raises(SystemExit) as stop:
        main(["--explain"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.splitlines()
    terms = {}
    for line in out[1:-1]:
        m = re.fullmatch(r"  (\S.*?)\s{2,}(\S.*?)  \[(.+)\]", line)
        assert m, line
        terms[m.group(1)] = (m.group(2), m.group(3))
    return terms


def test_explain_names_every_breakdown_term_of_a_real_estimate_and_the_table_lines(capsys):
    main(["--model", "qwen2.5-7b", "--gpu", "a100-80gb", "--method", "dpo", "--json"])
    breakdown = json.loads(capsys.readouterr().out)["breakdown"]
    terms = _explained(capsys)
    # every term the estimate prices, and the table's other lines, each with its meaning
    assert set(breakdown) <= set(terms)
    for line in ("device total", "allocated", "reserved", "host RAM per node", "step time", "MFU"):
        assert line in terms
    for term, (meaning, source) in terms.items():
        assert len(meaning.split()) >= 5, term  # a sentence, not a restated name
        # the module named is one of memfit.estimate's, importable
        for module in re.findall(r"estimate\.(\w+)", source):
            importlib.import_module(f"memfit.estimate.{module}")


def test_explain_also_works_beside_other_flags_and_the_table_keeps_its_legend(capsys):
    """--explain wins as --help does: the glossary, exit 0, no estimate."""
    with pytest.raises(SystemExit) as stop:
        main(["--model", "qwen2.5-7b", "--gpu", "a100-80gb", "--explain"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("what each line of `memfit estimate` means") and "verdict:" not in out


def test_the_docs_glossary_is_what_explain_prints(capsys):
    """docs/estimator.md's Glossary table: the same terms, meanings and sources, in the same order."""
    text = DOCS.read_text()
    section = text.split("## Glossary\n", 1)[1].split("\n## ", 1)[0]
    assert "`memfit estimate --explain`" in section
    rows = [
        tuple(cell.strip() for cell in line.strip("|").split(" | "))
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| term ")
    ]
    assert rows == [tuple(entry) for entry in GLOSSARY]
    assert list(_explained(capsys)) == [term for term, _, _ in GLOSSARY]
