"""The estimator against the published longest sequences of DeepSpeed's ALST
(`tests/public_long_context.yaml`: Llama-3.1-8B on 1 to 32 H100s, and the paper's ablation).

Each row is answered as a user would ask memfit: `fit(..., maximize="seq_len")` on the row's
GPUs with its levers, the node's host RAM and expandable segments; the error is
`predicted / published - 1` (positive: memfit says a longer sequence fits than the authors ran).
A published length is the longest the authors ran, not a measured limit, so the comparison is of
the same kind as the max-fit rows of memfit_validation.memory. `order_agreement` checks each
sweep: whether memfit ranks its rows as the published lengths do.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from memfit.space import Candidate

MODEL, GPU, HOST_GB = "llama-3.1-8b", "h100-80gb", 1900.0  # paper sec. 5: 8x H100 80GB, 1.9 TB per node
UPPER = 64_000_000  # fit's bound on the sequence length (4x the longest published)


@dataclass(frozen=True)
class Row:
    id: str
    sweep: str
    gpus: int
    nodes: int
    published: int
    quote: str
    cand: Candidate
    notes: str = ""
    settings: tuple[tuple[str, Any], ...] = ()  # Settings fields of this row (the loss's logits handling)


@dataclass(frozen=True)
class Result:
    row: Row
    predicted: int

    @property
    def error(self) -> float:
        return self.predicted / self.row.published - 1


def load_table(path: Path) -> list[Row]:
    """The rows, each with its candidate (the common levers, then the row's); a bad key is named."""
    raw = yaml.safe_load(Path(path).read_text())
    rows = []
    for r in raw["rows"]:
        try:
            cand = Candidate(**{**raw["common"], **(r.get("levers") or {})})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: row {r.get('id')!r}: {exc}") from None
        fields = {k: r[k] for k in ("id", "sweep", "gpus", "nodes", "published", "quote")}
        settings = tuple(sorted((r.get("settings") or {}).items()))
        rows.append(Row(**fields, cand=cand, notes=r.get("notes", ""), settings=settings))
    return rows


def predict(row: Row) -> int:
    """The longest sequence memfit says fits the row's GPUs with its levers."""
    from memfit.estimate.models import catalog
    from memfit.estimate.search import fit
    from memfit.estimate.settings import DEFAULT_SETTINGS

    settings = dataclasses.replace(DEFAULT_SETTINGS, expandable_segments=True, **dict(row.settings))
    arch, gpu = catalog.model(MODEL), catalog.gpu(GPU)
    seq, _ = fit(
        arch,
        gpu,
        row.gpus,
        row.nodes,
        "sft",
        row.cand,
        "seq_len",
        host_memory_gb=HOST_GB,
        settings=settings,
        upper=UPPER,
    )
    return seq


def compare(rows: list[Row]) -> list[Result]:
    return [Result(r, predict(r)) for r in rows]


def order_agreement(results: list[Result]) -> dict[str, tuple[int, int]]:
    """Per sweep: (pairs memfit orders as published, pairs with different published lengths)."""
    out: dict[str, tuple[int, int]] = {}
    for sweep, group in itertools.groupby(sorted(results, key=lambda r: r.row.sweep), key=lambda r: r.row.sweep):
        agree = pairs = 0
        for a, b in itertools.combinations(list(group), 2):
            if a.row.published == b.row.published:
                continue
            pairs += 1
            agree += (a.row.published < b.row.published) == (a.predicted < b.predicted)
        out[sweep] = (agree, pairs)
    return out


def summary(results: list[Result]) -> dict[str, Any]:
    errors = [abs(r.error) for r in results]
    return {"rows": len(results), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}
