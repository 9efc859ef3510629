"""The bundled reward-model pairs (data/demo/rm.jsonl, what config/preference.yaml's rm trains on)."""

import json
from collections import Counter
from pathlib import Path

from memfit.workflow import demo

DATA = Path(__file__).resolve().parent.parent / "data" / "demo"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def test_rm_pairs_rank_the_answer_above_a_non_answer_in_three_rows_of_four():
    """Every rm pair asks the DPO pair's question with its right answer chosen; three rows in four
    reject a non-answer (the four in equal shares), every fourth keeps the DPO pair's plausible
    mistake, so a quarter of the held-out pairs still test right numbers above wrong ones."""
    rm, dpo = _rows("rm.jsonl"), _rows("dpo.jsonl")
    assert len(rm) == len(dpo) == 1600
    assert [(r["prompt"], r["chosen"]) for r in rm] == [(d["prompt"], d["chosen"]) for d in dpo]
    mistakes = [i for i, (r, d) in enumerate(zip(rm, dpo, strict=True)) if r["rejected"] == d["rejected"]]
    assert mistakes == list(range(3, 1600, 4))
    non_answers = Counter(r["rejected"] for i, r in enumerate(rm) if i % 4 != 3)
    assert non_answers == {text: 300 for text in demo.NON_ANSWERS}
    assert all(r["rejected"] not in demo.NON_ANSWERS and r["rejected"] != r["chosen"] for r in rm[3::4])
