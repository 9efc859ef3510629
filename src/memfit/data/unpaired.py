"""KTO's unpaired rows: reading them (`{prompt, completion, label}`, TRL's unpaired preference
format, or pairs converted as TRL's `unpair_preference_dataset` does), tokenizing them, and the
KL pairing fixed at prep time (`add_kl_pairing`).

The KL pairing: KTO's reference point z0 is estimated on mismatched (prompt, completion) pairs.
TRL 1.16 (`KTOTrainer`, `_get_kl_dataset`) rotates the completions by one within each batch of
the per-device batch size, so the pairing changes with the batch size and the data order. memfit
fixes it once, here, per split: row i's `kl_completion_ids` is the completion of the closest
earlier row (cyclically, in the split's order) whose prompt differs (the previous row's when every
row shares one prompt). A fixed pairing is what a precomputed reference (`ref: precomputed`) needs,
and it makes a row's loss independent of the micro batch it lands in.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from memfit.data.chat import _bad, dpo_pair, turns
from memfit.data.schema import prompt_key as _prompt_key
from memfit.data.schema import token_ids as _ids
from memfit.data.sources import NEEDS, Source, string_field, type_name


def _completion(src: Source, row: int, value: Any) -> str:
    """A completion: a string, or TRL's conversational completion (one assistant turn)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, dict)):
        raise _bad(src, row, f"expected a string or one assistant turn, got {type_name(value)}", "completion")
    answer = turns(src, row, value, "completion")
    if len(answer) != 1 or answer[0]["role"] != "assistant":
        raise _bad(src, row, f"expected one assistant turn, got turns {[m['role'] for m in answer]}", "completion")
    return answer[0]["content"]


def kto_rows(src: Source, row: int, record: dict) -> list[tuple[list[dict], str, bool, str]]:
    """(prompt turns, completion, desirable, key of the prompt) for each KTO row of a source row:
    one for an unpaired row, two for a pair (chosen desirable, rejected undesirable)."""
    if record.get("completion") is None and record.get("label") is None and record.get("chosen") is not None:
        prompt, chosen, rejected, key = dpo_pair(src, row, record)
        return [(prompt, chosen, True, key), (prompt, rejected, False, key)]
    for k in ("completion", "label"):
        if record.get(k) is None:
            raise _bad(src, row, f"missing ({NEEDS['kto']}; the row has keys {sorted(record)})", k)
    label = record["label"]
    if not isinstance(label, bool):
        raise _bad(src, row, f"expected true (desirable) or false (undesirable), got {label!r}", "label")
    p = record.get("prompt")
    if isinstance(p, (list, dict)):
        prompt = turns(src, row, p, "prompt")
        if prompt[-1]["role"] == "assistant":
            raise _bad(src, row, "the prompt ends with an assistant turn; the completion must answer it", "prompt")
        if not any(m["content"].strip() for m in prompt):
            raise _bad(src, row, "empty prompt: every prompt turn is empty", "prompt")
    else:
        prompt = [{"role": "user", "content": string_field(src, row, record, "prompt", "kto", non_empty=True)}]
    return [(prompt, _completion(src, row, record["completion"]), label, "prompt")]


def tokenize_kto(job, chunk: list[tuple[int, dict]]) -> None:
    """The `prepare_data` step for kto (memfit.data.preparation._Job): rows without their KL
    completion (added per split by `add_kl_pairing`)."""
    items = []
    for row, record in chunk:
        found = kto_rows(job.src, row, record)
        if len(found) == 2 and found[0][1] == found[1][1]:
            job.dropped["identical_chosen_rejected"] += 1
            continue
        for prompt, completion, label, key in found:
            if not completion.strip():
                job.dropped["empty_completion"] += 1
                continue
            items.append((row, job.render(job.src, row, key, prompt, True), completion, label))
    cols: dict[str, list] = {k: [] for k in ("row", "prompt_ids", "completion_ids", "label", "kl_completion_ids")}
    cols["length"], keys, eos = [], [], job.tok.eos_token_id
    prompts = _ids(job.tok, [t for _, t, _, _ in items])
    for (row, text, _, label), p, c in zip(items, prompts, _ids(job.tok, [c for _, _, c, _ in items]), strict=True):
        c = c + [eos]
        room = job.max_len - len(p)
        if room < job.min_response:
            job.dropped["prompt_too_long"] += 1
            continue
        job.truncated["completion"] += len(c) > room  # counted on kept rows only
        for k, v in (("row", row), ("prompt_ids", p), ("completion_ids", c[:room]), ("label", label)):
            cols[k].append(v)
        cols["kl_completion_ids"].append([])
        cols["length"].append(len(p) + len(c[:room]))
        keys.append(_prompt_key(job.seed, text))
    job.out.add(cols, keys)


def add_kl_pairing(table: pa.Table, max_len: int, truncated: dict[str, int]) -> pa.Table:
    """`table` (one split) with each row's KL completion (see the module docstring), cut to the
    room its prompt leaves under `max_len` (counted in `truncated["kl_completion"]`), and `length`
    the prompt plus the longer of its two completions."""
    prompts = table["prompt_ids"].to_pylist()
    completions = table["completion_ids"].to_pylist()
    kl, lengths = [], []
    n = len(prompts)
    for i, p in enumerate(prompts):
        j = next((k % n for k in range(i - 1, i - n, -1) if prompts[k % n] != p), (i - 1) % n)
        c = completions[j][: max_len - len(p)]
        truncated["kl_completion"] += len(c) < len(completions[j])
        kl.append(c)
        lengths.append(len(p) + max(len(completions[i]), len(c)))
    at = table.schema.get_field_index("kl_completion_ids")
    table = table.set_column(at, table.schema.field(at), pa.array(kl, type=table.schema.field(at).type))
    at = table.schema.get_field_index("length")
    return table.set_column(at, table.schema.field(at), pa.array(lengths, type=pa.int32()))
