"""`memfit estimate` with several values for a lever: every combination estimated, then judged
and ranked by the workflow's own selection (memfit.estimate.selection.judge and choose: the fastest
that fits, speeds within the noise tied and decided by less memory, fewer levers, the id), with
no YAML and no Snakemake.

    memfit estimate --model llama-3.1-8b --gpu a100-80gb --num-gpus 8 --zero 2,3 --micro-batch 1,2,4
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.estimate.core import Estimate
from memfit.estimate.rows import Budget, CandidateRow
from memfit.estimate.selection import TIE_RULE, NoneFits, choose, judge
from memfit.space import Candidate
from memfit.units import GIB


@dataclass
class Ranking:
    """The judged rows, best first; `selected` None when nothing fits (`none_fits` says why)."""

    rows: list[CandidateRow]
    budget: Budget
    selected: CandidateRow | None = None
    none_fits: str = ""
    skipped: list[str] = field(default_factory=list)  # combinations refused before estimating, why

    def to_dict(self) -> dict:
        return {
            "selected": self.selected.id if self.selected else None,
            **({"none_fits": self.none_fits} if self.none_fits else {}),
            "rule": f"fastest predicted tokens/s that fits; within the noise, {TIE_RULE}",
            "budget": {
                "device_bytes": self.budget.device_bytes,
                "host_bytes": self.budget.host_bytes,
                "headroom": self.budget.headroom,
                "headroom_source": self.budget.headroom_source,
            },
            "skipped": self.skipped,
            "candidates": [r.to_json() for r in self.rows],
        }


def rank(priced: list[tuple[Candidate, Estimate]], world: int, method: str) -> Ranking:
    """Judge and rank `priced` (every candidate with its estimate on the same job) as the
    workflow's select stage does with predictions alone (`plan_only`)."""
    rows = []
    for cand, est in priced:
        rows.append({**est.to_dict(), "candidate": cand.to_dict(), "id": cand.id})
    first = next((e for _, e in priced if not e.invalid), priced[0][1])
    budget = Budget(
        device_bytes=first.device_memory_bytes,
        host_bytes=first.host_memory_bytes,
        headroom=first.headroom,
        headroom_source=first.headroom_source,
    )
    judged = judge(rows, {}, budget, world, method)
    try:
        best, ranked = choose(judged, budget)
    except NoneFits as exc:
        return Ranking(exc.rows, budget, None, exc.reason)
    return Ranking(ranked, budget, best)


def render_ranking(ranking: Ranking, title: str, flags: dict[str, str] | None = None) -> str:
    """The ranked table: fits, device total, step time, tokens/s, the id and why it ranks there;
    the selected one with the flags that price it alone (`flags`: id -> flags)."""
    b = ranking.budget
    lines = [
        title,
        f"ranked by the workflow's selection: the fastest predicted tokens/s that fits in "
        f"{b.device_limit_bytes / GIB:,.2f} GiB ({b.device_bytes / GIB:,.2f} GiB less {b.headroom:.0%} "
        f"headroom) and {b.host_bytes / GIB:,.2f} GiB host RAM; within the noise, {TIE_RULE}",
        "",
        f"  {'#':>3}  {'fits':<4}  {'device total':>12}  {'step s':>8}  {'tokens/s':>10}  configuration: why",
    ]
    for i, r in enumerate(ranking.rows, 1):
        if r.figures is None:
            lines.append(f"  {i:>3}  {'-':<4}  {'-':>12}  {'-':>8}  {'-':>10}  {r.id}: {r.reason}")
            continue
        f = r.figures
        step = f"{f.step_time_s:.3f}" if f.step_time_s else "-"
        tps = f"{f.tokens_per_s:,.0f}" if f.tokens_per_s else "-"
        fits = "yes" if r.fits else "no"
        dev = f"{f.device_bytes / GIB:,.2f} GiB"
        lines.append(f"  {i:>3}  {fits:<4}  {dev:>12}  {step:>8}  {tps:>10}  {r.id}: {r.reason}")
    for why in ranking.skipped:
        lines.append(f"  skipped: {why}")
    lines.append("")
    if ranking.selected is not None:
        chosen = ranking.selected.id
        alone = f" ({flags[chosen]})" if flags and flags.get(chosen) else ""
        lines.append(f"selected: {chosen}{alone}")
    else:
        lines.append(f"nothing fits: {ranking.none_fits}")
    return "\n".join(lines)
