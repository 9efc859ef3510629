"""docs/config.md is the config schema rendered by memfit.config_docs, and stays so."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

from memfit import config_docs

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"


def _inputs():
    schema = yaml.safe_load(config_docs.SCHEMA.read_text(encoding="utf-8"))
    embedded = yaml.safe_load(config_docs.EMBEDDED.read_text(encoding="utf-8"))
    return schema, embedded


def _keys(node, root, path=()):
    """(dotted key, schema node) of every key in the schema, nested sections included."""
    node = config_docs.resolve(node, root)
    if config_docs.is_named_mapping(node):
        yield from _keys(node["additionalProperties"], root, (*path, "<name>"))
    for key, child in node.get("properties", {}).items():
        yield ".".join((*path, key)), config_docs.resolve(child, root)
        yield from _keys(child, root, (*path, key))


def test_committed_page_is_current():
    schema, embedded = _inputs()
    assert PAGE.read_text(encoding="utf-8") == config_docs.render(schema, embedded), (
        "docs/config.md is stale: run `python -m memfit.config_docs > docs/config.md`"
    )


def test_a_schema_change_makes_the_page_stale():
    schema, embedded = _inputs()
    changed = copy.deepcopy(schema)
    changed["properties"]["probe"]["properties"]["steps"]["description"] = "optimizer steps per probe, now reworded"
    page = config_docs.render(changed, embedded)
    assert "now reworded" in page
    assert page != PAGE.read_text(encoding="utf-8")


def test_known_keys_appear_with_type_default_and_description():
    page = PAGE.read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if line.startswith("| `boundary_margin` "))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1] == "number >= 0"
    assert cells[2] == "`0.2`"  # config/config.yaml's value
    assert "also probe the fastest candidate predicted over the budget" in cells[3]
    # nested sections get their own tables: a $ref'd method section, a mapping of names
    for heading in ("## `train.sft`", "## `train.dpo`", "## `models.<name>`", "## `slurm.gpu_types.<name>`"):
        assert heading in page
    assert re.search(r"^\| `global_batch` \(required\) \| integer >= 1 \| `32` \|", page, re.M)
    assert re.search(r"^\| `zero` \| list of one of `0`, `1`, `2`, `3` \(at least 1\) \| `\[0, 2, 3\]` \|", page, re.M)


def test_every_schema_key_is_on_the_page_with_a_description():
    schema, _ = _inputs()
    page = PAGE.read_text(encoding="utf-8")
    keys = list(_keys(schema, schema))
    assert len(keys) > 60
    undescribed = [k for k, node in keys if not str(node.get("description", "")).strip()]
    assert not undescribed, f"add `description:` to these keys of config.schema.yaml: {undescribed}"
    for key, _node in keys:
        assert f"| `{key.rsplit('.', 1)[-1]}`" in page, key


def test_cli_rejects_arguments(capsys):
    assert config_docs.main(["docs/config.md"]) == 2
    assert "python -m memfit.config_docs > docs/config.md" in capsys.readouterr().err
