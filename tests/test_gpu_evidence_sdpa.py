"""benchmarks/gpu_evidence.py, stage sdpa_long: the script a GPU runs, run here on the CPU at a short
length, so a lent GPU's minutes are not spent finding a mistake in it; and the mechanism it measures
(transformers hands SDPA a padded row as an s x s bool mask, an unpadded one as is_causal)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_evidence as ge  # noqa: E402


def _run(s: int) -> list[dict]:
    p = subprocess.run(
        [sys.executable, "-c", ge.SDPA_LONG_CODE, "cpu", str(s), "128", "256"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_backend_case_answers_and_a_padded_row_reaches_sdpa_as_an_s_by_s_mask():
    rows = _run(64)
    cases = [r for r in rows if r["id"].startswith("sdpa-")]
    assert len(cases) == 10 and {r["seq_len"] for r in cases} == {64}
    for r in cases:  # measured, or refused with PyTorch's reason (the CPU has no efficient or cuDNN kernel)
        assert r["status"] == "ok" or r["status"].startswith("refused: "), r
    assert {r["id"] for r in cases if r["status"] == "ok"} >= {"sdpa-s64-default-gqa", "sdpa-s64-default-masked"}
    call = rows[-1]["measured"]
    # memfit's trainer passes a 2-D attention mask: all ones is dropped (SDPA's causal kernel and GQA) ...
    assert call["unpadded"] == {"attn_mask": None, "is_causal": True, "enable_gqa": True, "kv_heads": 8}
    # ... a padded row becomes a (1, 1, s, s) bool mask with K/V repeated to all 32 heads
    assert call["padded"]["attn_mask"] == [[1, 1, 64, 64], "torch.bool"]
    assert call["padded"]["is_causal"] is False and call["padded"]["kv_heads"] == 32
    table = ge.table({"stages": {"sdpa_long": {"rows": rows}}})
    assert "sdpa-s64-default-gqa" in table and "x s^2 bytes" in table


def test_the_stage_is_skipped_without_cuda():
    assert ge.stage_sdpa_long(cuda=False)[0]["status"] == "skipped: needs CUDA (this run has no GPU)"
