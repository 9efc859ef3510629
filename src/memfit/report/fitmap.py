"""The fit map: for the selected configuration of a run, the longest sequence that fits on each
GPU type of the catalog (config/gpus.yaml), computed at report time with `memfit.estimate.fit`
(binary search over seq_len; analytic activations, so a few milliseconds per GPU type)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memfit import catalog
from memfit.estimate import DEFAULT_SETTINGS
from memfit.estimate.core import fit
from memfit.space import Candidate

from .fmt import _bytes, _e, _plain
from .inputs import RunOutputs

SETTINGS = dataclasses.replace(DEFAULT_SETTINGS, activations="analytic")


def _arch(run: RunOutputs, root: Path):
    """The catalog card by model name, else the run's model directory (run.json's model_path)."""
    try:
        return catalog.model(str(run.selection.model))
    except Exception:  # noqa: BLE001 - not a catalog name: try the model directory below
        import json

        run_json = Path(run.path).parent / "run.json"
        model_path = (
            json.loads(run_json.read_text()).get("model_path") if run_json.is_file() else None
        )
        if not model_path:
            raise
        p = Path(model_path)
        return catalog.model(p if p.is_absolute() else root / p)


def fit_map(run: RunOutputs, root: Path) -> str:
    """HTML: one row per catalog GPU type: memory, longest trainable sequence, fits at the selected one."""
    sel = run.selection
    world = run.table.world_size if run.table is not None else None
    try:
        arch = _arch(run, root)
        cand = Candidate.from_dict(run.selected.candidate)
        gpus = catalog.load_gpus()
        num_gpus = int(world or 1)
        rows = []
        cap = " (the model's maximum)"
        for name, gpu in gpus.items():
            longest, est = fit(
                arch,
                gpu,
                num_gpus,
                1,
                str(sel.method),
                cand,
                "seq_len",
                host_memory_gb=None,
                settings=SETTINGS,
            )
            ok = longest >= cand.seq_len
            why = ""
            if not longest and est is not None:
                # at 1 token: what it would need, so a reader sees whether the GPU or the host is short
                d = est.to_dict()
                why = _e(
                    d.get("reason")
                    or f"at 1 token needs {_bytes(d.get('device_total_bytes'))} per GPU, {_bytes(d.get('host_bytes'))} host RAM per node"
                )
            rows.append(
                f"<tr><td>{_e(name)}</td><td class='n'>{_e(f'{gpu.memory_gib:.0f} GiB')}</td>"
                f"<td class='n'>{_e(_plain(longest)) if longest else '—'}{cap if longest == arch.max_position_embeddings else ''}</td>"
                f"<td class='{'ok' if ok else 'bad'}'>{'yes' if ok else 'no'}</td><td>{why}</td></tr>"
            )
    except Exception as e:  # noqa: BLE001 - the map is an aid: say why it is missing, keep the page
        return (
            f"<p class='muted'>No fit map for {_e(run.title)}: {_e(type(e).__name__)}: {_e(e)}</p>"
        )
    return (
        f"<p class='muted'>The selected configuration (ZeRO, offload, checkpointing, micro batch, precision) on "
        f"{num_gpus} GPU(s) of each catalog type (its full memory and typical node's host RAM from config/gpus.yaml, not this run's budget), "
        f"{_e(sel.method)}, {_e(sel.model)}: the longest sequence whose predicted peak fits "
        f"(memfit.estimate.fit, analytic activations; selected seq len {cand.seq_len}).</p>"
        "<table><tr><th>GPU type</th><th>memory</th><th>longest seq len (tokens)</th>"
        f"<th>fits at {cand.seq_len} tokens</th><th>why not</th></tr>{''.join(rows)}</table>"
    )
