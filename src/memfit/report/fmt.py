"""Numbers and configurations as the page prints them: units, escaping, a candidate in words."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from typing import Any

from memfit.methods import REFERENCE_METHODS
from memfit.units import GIB, MIB, fmt_bytes


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _bytes(b: Any) -> str:
    v = _num(b)
    if v is None:
        return "—"
    # below 1 MiB the page has always said "0.5 MiB" (fmt_bytes would say KiB)
    return fmt_bytes(v) if abs(v) >= MIB else f"{v / MIB:.1f} MiB"


def _secs(s: Any) -> str:
    v = _num(s)
    if v is None:
        return "—"
    return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def _tps(x: Any) -> str:
    v = _num(x)
    if v is None:
        return "—"
    return f"{v:,.1f} tok/s" if v < 100 else f"{v:,.0f} tok/s"


def _plain(x: Any, digits: int = 4) -> str:
    v = _num(x)
    if v is None:
        return "—" if x is None else str(x)
    return f"{int(v):,}" if v.is_integer() and abs(v) < 1e15 else f"{v:.{digits}g}"


def _unit_for(values: Iterable[Any]) -> tuple[int, str]:
    nums = [abs(v) for v in map(_num, values) if v is not None]
    return (GIB, "GiB") if nums and max(nums) >= GIB else (MIB, "MiB")


def describe(cand: dict[str, Any], method: str | None = None, world_size: Any = None) -> str:
    """The configuration in words, e.g. 'ZeRO-3, optimizer offload to CPU (not pinned), ...'."""
    c = cand or {}
    parts = [f"ZeRO-{c['zero']}" if "zero" in c else "ZeRO stage unknown"]
    offload = []
    if c.get("offload_optimizer", "none") != "none":
        ratio = _num(c.get("offload_ratio"))
        ratio_txt = f", {ratio:.0%} of the optimizer states" if ratio is not None and ratio != 1.0 else ""
        offload.append(f"optimizer offload to {str(c['offload_optimizer']).upper()}{ratio_txt}")
    if c.get("offload_param", "none") != "none":
        offload.append(f"parameter offload to {str(c['offload_param']).upper()}")
    if offload:
        pin = "pinned host memory" if c.get("pin_memory") else "not pinned"
        parts.append(" and ".join(offload) + f" ({pin})")
    else:
        parts.append("no offload")
    if "grad_ckpt" in c:
        parts.append("gradient checkpointing" if c["grad_ckpt"] else "no gradient checkpointing")
    attn = {"flash": "FlashAttention-2", "sdpa": "SDPA attention", "eager": "eager attention"}
    if "attn" in c:
        parts.append(attn.get(c["attn"], f"{c['attn']} attention"))
    ft = c.get("finetune")
    if ft == "full":
        parts.append("full fine-tuning")
    elif ft:
        parts.append(f"{'LoRA' if ft == 'lora' else 'QLoRA'} rank {c.get('lora_rank', '?')}")
    mb, ga = c.get("micro_batch"), c.get("grad_accum")
    batch = f"micro batch {mb if mb is not None else '?'} × grad accum {ga if ga is not None else '?'}"
    w, m, g = _num(world_size), _num(mb), _num(ga)
    if w and m and g:
        batch += f" × {int(w)} rank{'s' if w != 1 else ''} = {int(w * m * g)} rows per step"
    parts.append(batch)
    if c.get("seq_len") is not None:
        parts.append(f"seq len {_plain(c['seq_len'])} tokens")
    if c.get("precision"):
        parts.append(str(c["precision"]))
    if method in REFERENCE_METHODS and c.get("ref"):
        ref = {
            "model": "frozen reference model",
            "adapter": "reference = model with the adapter disabled",
            "precomputed": "precomputed reference log-probs",
        }
        parts.append(ref.get(c["ref"], f"reference {c['ref']}"))
    # the speed levers (docs/speed.md), named only when on
    parts += ["padding-free rows"] if c.get("padding_free") else []
    parts += ["compiled layers"] if c.get("compile") else []
    parts += ["Liger kernels"] if c.get("kernels", "none") == "liger" else []
    return ", ".join(parts)


def _measured(row: dict[str, Any]) -> tuple[Any, str]:
    """The probe's peak as selection judges it (reserved on a GPU, allocated on the CPU), from a
    candidate's record (memfit.results)."""
    status = row["probe_status"]
    if status is None:
        return None, ""
    if status != "ok":
        return None, str(status).upper()
    if row["probe_peak_reserved_bytes"] is not None:
        return row["probe_peak_reserved_bytes"], "reserved"
    return row["probe_peak_allocated_bytes"], "allocated"


def _verdict(row: dict[str, Any], selected_id: Any) -> tuple[str, str]:
    """(text, css class) for the selection table."""
    if row["id"] == selected_id:
        return "selected", "ok"
    if row["probe_status"] not in (None, "ok"):
        return f"probe {row['probe_status']}", "bad"
    if row["source"] == "rule":
        return "cannot run", "bad"
    if row["fits"]:
        return "fits, not chosen", ""
    return "does not fit", "bad"
