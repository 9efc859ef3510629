"""Which configuration to run: the fastest one that fits, and why every other one lost.

A candidate fits when its peak device memory, grown by `headroom`, stays within the
device budget and its host memory within the node's RAM. Measured figures (probes)
win over predicted ones: a probed candidate is judged on what it used, an unprobed one
can only be chosen when no probe ran (`plan_only`), and then on its prediction.
Speed is training throughput at the fixed global batch: tokens per second per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .units import fmt_bytes


@dataclass(frozen=True)
class Budget:
    device_bytes: int  # usable memory of one device (rank)
    host_bytes: int  # usable RAM of one node
    headroom: float  # fraction of device memory kept free (fragmentation, spikes)

    @property
    def device_limit_bytes(self) -> int:
        return int(self.device_bytes * (1.0 - self.headroom))


def _measured_device_bytes(probe: dict[str, Any]) -> int:
    # On a GPU the allocator's reserved peak is what OOMs; on the CPU only allocated exists.
    return int(probe.get("peak_reserved_bytes") or probe["peak_allocated_bytes"])


def _tokens_per_step(cand: dict[str, Any], world: int, method: str) -> int:
    seqs = cand["micro_batch"] * cand["grad_accum"] * world * (2 if method == "dpo" else 1)
    return seqs * cand["seq_len"]


def judge(
    estimates: list[dict[str, Any]],
    probes: dict[str, dict[str, Any]],
    budget: Budget,
    world: int,
    method: str,
) -> list[dict[str, Any]]:
    """One verdict row per candidate: source of the figures, fits, throughput, reason."""
    rows = []
    for est in estimates:
        cid, cand = est["id"], est["candidate"]
        probe = probes.get(cid)
        row: dict[str, Any] = {"id": cid, "candidate": cand, "predicted": _pred(est)}
        if est.get("invalid"):
            row |= {"source": "rule", "fits": False, "reason": f"cannot run here: {est.get('reason') or 'invalid'}"}
        elif probe is not None:
            row["probe"] = probe
            if probe["status"] != "ok":
                row |= {"source": "probe", "fits": False, "reason": f"probe {probe['status']}: {probe.get('error', '')}"[:300]}
            else:
                dev = _measured_device_bytes(probe)
                host = int(probe.get("host_rss_bytes_node") or 0)
                row |= _verdict(dev, host, probe["step_time_s"], budget, cand, world, method, "measured")
        else:
            dev = int(est.get("device_total_bytes") or est["peak_reserved_bytes"])
            row |= _verdict(dev, int(est.get("host_bytes", 0)), est.get("step_time_s"), budget, cand, world, method, "predicted")
        rows.append(row)
    return rows


def _pred(est: dict[str, Any]) -> dict[str, Any]:
    keys = ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "host_bytes", "step_time_s", "fits")
    return {k: est.get(k) for k in keys}


def _verdict(dev: int, host: int, step_time: float | None, budget: Budget, cand, world, method, source) -> dict[str, Any]:
    out: dict[str, Any] = {"source": source, "device_bytes": dev, "host_bytes": host, "step_time_s": step_time}
    out["tokens_per_s"] = _tokens_per_step(cand, world, method) / step_time if step_time else None
    if dev > budget.device_limit_bytes:
        out |= {
            "fits": False,
            "reason": f"does not fit: {fmt_bytes(dev)} {source} > {fmt_bytes(budget.device_limit_bytes)} "
            f"({fmt_bytes(budget.device_bytes)} less {budget.headroom:.0%} headroom)",
        }
    elif host > budget.host_bytes:
        out |= {"fits": False, "reason": f"host RAM: {fmt_bytes(host)} {source} > {fmt_bytes(budget.host_bytes)}"}
    else:
        out |= {"fits": True, "reason": ""}
    return out


def choose(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The fastest fitting measured candidate (predicted only if nothing was measured)."""
    probed = any(r["source"] in ("probe", "measured") for r in rows)
    pool = [r for r in rows if r["source"] == "measured"] if probed else rows
    fitting = [r for r in pool if r["fits"] and r.get("tokens_per_s")]
    if not fitting:
        lines = "\n".join(f"  {r['id']}: {r['reason'] or 'no throughput figure'}" for r in rows)
        raise RuntimeError(
            "no candidate fits the budget; every one lost:\n" + lines + "\nWiden the search space "
            "(offload, ZeRO-3, LoRA, gradient checkpointing), lower seq_len, or add GPUs."
        )
    best = max(fitting, key=lambda r: r["tokens_per_s"])
    for r in rows:
        if r is best:
            r["reason"] = "selected: fastest that fits"
        elif r["fits"] and r in pool:
            r["reason"] = f"slower: {r['tokens_per_s']:.0f} tok/s vs {best['tokens_per_s']:.0f} tok/s selected"
        elif r["fits"]:
            r["reason"] = "not probed: predicted to fit, ranked below the probed candidates"
    # selected first, then what was measured, then predictions, then what cannot run
    order = {"measured": 0, "probe": 1, "predicted": 2, "rule": 3}
    ranked = sorted(rows, key=lambda r: (r is not best, order[r["source"]], not r["fits"], -(r.get("tokens_per_s") or 0)))
    return best, ranked
