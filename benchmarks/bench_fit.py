"""`memfit fit --maximize seq_len` for every flagship model (config/models.yaml entries without a
hand-written card, as benchmarks/bench_flagship.py): the flagship command without --seq-len,
`memfit fit --maximize seq_len --gpu h100-80gb --num-gpus 8 --finetune lora --zero 3 --attn flash`
(sdpa or eager where the class has no FlashAttention-2 path), timed cold (a fresh process, an
empty trace cache: MEMFIT_TRACE_CACHE=a new directory), with the answer, what stopped it and the
progress lines the search printed on stderr (a line per search step and per traced shape,
with its seconds: memfit.estimate.trace.trace.progress_to).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_fit.py [--only gpt-oss-20b ...]
        [--json benchmarks/results/fit_flagship.json]

Target (issue 42): an answer for each, under 60 s cold. Exits 1 when one is missed or fails.
Run it with nothing else on the machine: the times are wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src")]

COLD_S = 60.0
ARGS = ["--gpu", "h100-80gb", "--num-gpus", "8", "--finetune", "lora", "--zero", "3", "--json"]


def _run(name: str, attn: str) -> tuple[float, dict | None, int, str]:
    cache = tempfile.mkdtemp(prefix="memfit-fit-")
    env = {**os.environ, "MEMFIT_TRACE_CACHE": cache, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-c", "import sys; from memfit.cli import main; sys.exit(main())", "fit"]
    t0 = time.perf_counter()
    p = subprocess.run([*cmd, "--maximize", "seq_len", "--model", name, *ARGS, "--attn", attn],
                       capture_output=True, text=True, env=env, cwd=REPO)  # fmt: skip
    seconds = time.perf_counter() - t0
    steps = sum(1 for ln in p.stderr.splitlines() if ln.startswith(("memfit fit: seq_len ", "memfit fit: traced ")))
    if p.returncode not in (0, 1):
        errors = [ln for ln in p.stderr.splitlines() if "error" in ln or "invalid" in ln]
        return seconds, None, steps, (errors or p.stderr.strip().splitlines() or ["?"])[-1]
    return seconds, json.loads(p.stdout), steps, ""


def main(argv: list[str] | None = None) -> int:
    from memfit.estimate.models import catalog

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    names = a.only or [n for n, arch in catalog.load_models().items() if arch.generic]
    rows, ok = [], True
    for name in names:
        arch = catalog.model(name, allow_moe=True)
        attn = next(x for x in ("flash", "sdpa", "eager") if x in arch.inventory().attn)
        cold, out, steps, err = _run(name, attn)
        out = out or {}
        row = {"model": name, "attn": attn, "seq_len": out.get("seq_len"), "limited_by": out.get("limited_by"),
               "traced_lengths": out.get("traced_lengths"), "progress_lines": steps, "cold_s": round(cold, 1),
               "error": err}  # fmt: skip
        rows.append(row)
        good = not err and cold < COLD_S and steps > 0
        ok &= good
        print(f"{name:24} {attn:5} seq_len {out.get('seq_len', 0) or 0:>9,}  stopped by {out.get('limited_by', '-')!s:44.44} "
              f"cold {cold:5.1f} s  {steps:3d} steps {'' if good else 'MISSED ' + err}", flush=True)  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
