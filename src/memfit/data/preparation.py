"""`prepare`, the `prepare_data` rule: read, render the chat template, tokenize, filter and
truncate (counted), split by prompt, write train/eval parquet and stats.json atomically
(memfit.data's docstring says each rule)."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memfit.atomic import replace_dir
from memfit.data.chat import ASSISTANT_LOSS, Renderer, dpo_pair, sft_messages, sft_prefix
from memfit.data.schema import (
    CHUNK_ROWS,
    DROP_REASONS,
    IGNORE_INDEX,
    PROGRESS_MIN_ROWS,
    SCHEMAS,
    TRUNCATION_REASONS,
    WORST_CASE_ROWS,
    DataError,
)
from memfit.data.schema import prompt_key as _prompt_key
from memfit.data.schema import token_ids as _ids
from memfit.data.sources import Source, open_source, type_name
from memfit.data.unpaired import add_kl_pairing, tokenize_kto


def _load_tokenizer(tokenizer_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not tok.chat_template:
        where = Path(tokenizer_dir)
        raise ValueError(
            f"tokenizer at {tokenizer_dir} has no chat_template (a base model's tokenizer?): memfit renders "
            "every row, {prompt, response} rows too, with the model's chat template; set one as "
            f"'chat_template' in {where / 'tokenizer_config.json'} or in {where / 'chat_template.jinja'} "
            "(the instruct model's template, for instance)"
        )
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {tokenizer_dir} has no eos_token")
    return tok


class _Builder:
    """Accumulates kept rows chunk by chunk as Arrow record batches (4 bytes per token id)."""

    def __init__(self, method: str) -> None:
        self.schema = SCHEMAS[method]
        self.batches: list[pa.RecordBatch] = []
        self.keys: list[int] = []  # split group key per kept row

    def add(self, columns: dict[str, list], keys: list[int]) -> None:
        if keys:
            self.batches.append(pa.RecordBatch.from_pydict(columns, schema=self.schema))
            self.keys.extend(keys)

    def table(self) -> pa.Table:
        return pa.Table.from_batches(self.batches, schema=self.schema)


@dataclass
class _Job:
    """What tokenizing a chunk needs besides the chunk."""

    tok: Any
    render: Renderer
    src: Source
    max_len: int
    min_response: int
    assistant_loss: str
    seed: int
    dropped: dict[str, int]
    truncated: dict[str, int]
    out: _Builder
    method: str = "dpo"
    margins: dict[str, int | None] | None = None  # rm: the first source row with and without a margin


def _tokenize_sft(job: _Job, chunk: list[tuple[int, dict]]) -> None:
    prefixes, responses, rows, texts = [], [], [], []
    for row, record in chunk:
        messages, key = sft_messages(job.src, row, record)
        if not messages[-1]["content"].strip():
            job.dropped["empty_response"] += 1
            continue
        segments = sft_prefix(job.render, job.src, row, key, messages, job.assistant_loss)
        prefixes.append(segments)
        responses.append(messages[-1]["content"])
        rows.append(row)
        texts.append("".join(text for text, _ in segments))
    # every segment tokenized on its own, as the prompt and the response are
    flat = _ids(job.tok, [text for segments in prefixes for text, _ in segments])
    cols: dict[str, list] = {"row": [], "input_ids": [], "labels": [], "length": []}
    keys, at, eos = [], 0, job.tok.eos_token_id
    for row, text, segments, r in zip(rows, texts, prefixes, _ids(job.tok, responses), strict=True):
        p: list[int] = []
        y: list[int] = []
        for (_, scored), ids in zip(segments, flat[at : at + len(segments)], strict=True):
            p += ids
            y += ids if scored else [IGNORE_INDEX] * len(ids)
        at += len(segments)
        r = r + [eos]
        room = job.max_len - len(p)
        if room < job.min_response:
            job.dropped["prompt_too_long"] += 1
            continue
        if len(r) > room:
            r = r[:room]
            job.truncated["response"] += 1
        cols["row"].append(row)
        cols["input_ids"].append(p + r)
        cols["labels"].append(y + r)
        cols["length"].append(len(p) + len(r))
        keys.append(_prompt_key(job.seed, text))
    job.out.add(cols, keys)


def _tokenize_dpo(job: _Job, chunk: list[tuple[int, dict]]) -> None:
    prompt_texts, chosens, rejecteds, rows, margins = [], [], [], [], {}
    for row, record in chunk:
        prompt, chosen, rejected, key = dpo_pair(job.src, row, record)
        if job.method == "rm":
            margins[row] = _margin(job, row, record)
        if not chosen.strip():
            job.dropped["empty_chosen"] += 1
        elif not rejected.strip():
            job.dropped["empty_rejected"] += 1
        elif chosen == rejected:
            job.dropped["identical_chosen_rejected"] += 1
        else:
            prompt_texts.append(job.render(job.src, row, key, prompt, True))
            chosens.append(chosen)
            rejecteds.append(rejected)
            rows.append(row)
    cols: dict[str, list] = {"row": [], "prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "length": []}
    keys = []
    eos = job.tok.eos_token_id
    for row, text, p, c, r in zip(
        rows,
        prompt_texts,
        _ids(job.tok, prompt_texts),
        _ids(job.tok, chosens),
        _ids(job.tok, rejecteds),
        strict=True,
    ):
        c, r = c + [eos], r + [eos]
        room = job.max_len - len(p)
        if room < job.min_response:
            job.dropped["prompt_too_long"] += 1
            continue
        cut_c, cut_r = len(c) > room, len(r) > room
        c, r = c[:room], r[:room]
        if c == r:
            job.dropped["identical_after_truncation"] += 1
            continue
        job.truncated["chosen"] += cut_c  # counted on kept rows only: stats describe the output
        job.truncated["rejected"] += cut_r
        cols["row"].append(row)
        cols["prompt_ids"].append(p)
        cols["chosen_ids"].append(c)
        cols["rejected_ids"].append(r)
        cols["length"].append(len(p) + max(len(c), len(r)))
        if job.method == "rm":
            cols.setdefault("margin", []).append(margins[row])
        keys.append(_prompt_key(job.seed, text))
    job.out.add(cols, keys)


def _margin(job: _Job, row: int, record: dict) -> float | None:
    """rm: the pair's optional `margin` (TRL RewardTrainer: subtracted inside the sigmoid); every
    pair has one or none does (checked once all rows are read, `_check_margins`)."""
    m = record.get("margin")
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or m != m):
        raise DataError(job.src.path, f"expected a number, got {type_name(m)} {m!r}", row, "margin", job.src.unit)
    assert job.margins is not None
    job.margins.setdefault("with" if m is not None else "without", row)
    return None if m is None else float(m)


def _check_margins(job: _Job) -> None:
    seen = job.margins or {}
    if seen.get("with") and seen.get("without"):
        raise DataError(
            job.src.path,
            f"missing: {job.src.unit} {seen['with']} has a margin and this one has none; give every pair a "
            "margin or none",
            seen["without"],
            "margin",
            job.src.unit,
        )


# ------------------------------------------------------------------------ split, stats


def _eval_mask(keys: list[int], eval_fraction: float) -> np.ndarray:
    keys_arr = np.array(keys, dtype=np.uint64)
    groups = np.unique(keys_arr)  # sorted
    n_eval = round(eval_fraction * len(groups))
    if eval_fraction > 0 and len(groups) >= 2:
        n_eval = min(max(n_eval, 1), len(groups) - 1)
    else:
        n_eval = min(n_eval, max(len(groups) - 1, 0))
    return np.isin(keys_arr, groups[:n_eval])


def _length_stats(lengths: np.ndarray) -> dict[str, float | int]:
    s = np.sort(lengths)

    def rank(p: float) -> int:  # nearest-rank percentile: a real row length
        return int(s[max(math.ceil(p / 100 * len(s)), 1) - 1])

    return {
        "min": int(s[0]),
        "mean": round(float(s.mean()), 2),
        "p50": rank(50),
        "p90": rank(90),
        "p99": rank(99),
        "max": int(s[-1]),
        # p0..p100 by the same nearest rank: the distribution the estimator draws a padded micro
        # batch's longest row from (memfit.estimate.time.data_scale.expected_longest)
        "quantiles": [rank(p) for p in range(101)],
    }


def _token_count(table: pa.Table, method: str) -> int:
    cols = {"sft": ("input_ids",), "kto": ("prompt_ids", "completion_ids")}.get(
        method, ("prompt_ids", "chosen_ids", "rejected_ids")
    )
    return int(sum(pc.sum(pc.list_value_length(table[c])).as_py() or 0 for c in cols))


def _loss_tokens(table: pa.Table) -> int:
    """SFT label positions that carry loss (not IGNORE_INDEX), both splits."""
    labels = pc.list_flatten(table["labels"])
    return int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)


def longest_first(lengths: np.ndarray) -> np.ndarray:
    return np.argsort(-lengths.astype(np.int64), kind="stable")


# ------------------------------------------------------------------------------ prepare


def _read_all(job: _Job, tokenize, progress: bool | None) -> int:
    """Every source row through `tokenize`, CHUNK_ROWS at a time; the rows read (blank lines too)."""
    from tqdm import tqdm

    show = job.src.total >= PROGRESS_MIN_ROWS if progress is None else progress
    rows_read = 0
    with tqdm(total=job.src.total, desc=f"tokenizing {job.src.path.name}", unit="row", disable=not show) as bar:
        chunk: list[tuple[int, dict]] = []
        for row, record in job.src.records:
            rows_read += 1
            if record is None:
                job.dropped["blank_line"] += 1
            else:
                chunk.append((row, record))
            if len(chunk) == CHUNK_ROWS:
                tokenize(job, chunk)
                bar.update(len(chunk))
                chunk = []
        tokenize(job, chunk)
        bar.update(bar.total - bar.n)

    return rows_read


def _check_arguments(method: str, max_len: int, eval_fraction: float, min_response: int, assistant_loss: str) -> None:
    if method not in SCHEMAS:
        raise ValueError(f"method must be one of {', '.join(SCHEMAS)}, got {method!r}")
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if min_response < 1:
        raise ValueError(f"min_response_tokens must be at least 1, got {min_response}")
    if assistant_loss not in ASSISTANT_LOSS:
        raise ValueError(f"assistant_loss must be 'all' or 'last', got {assistant_loss!r}")


def prepare(
    method: str,
    source: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_len: int,
    eval_fraction: float = 0.1,
    seed: int = 0,
    min_response_tokens: int = 1,
    progress: bool | None = None,
    assistant_loss: str = "all",
) -> dict:
    """Tokenize `source` for `method` into `out_dir`; returns the stats dict. sft; dpo, rm, orpo
    and simpo (pairs; rm keeps a `margin` column); kto (unpaired rows, pairs converted).

    `progress`: tqdm bar on stderr; by default when the source has PROGRESS_MIN_ROWS rows or more.
    `assistant_loss` (SFT chat rows): "all" assistant turns carry loss, or the "last" only.
    """
    _check_arguments(method, max_len, eval_fraction, min_response_tokens, assistant_loss)
    src = open_source(Path(source))
    tok = _load_tokenizer(tokenizer_dir)
    dropped = dict.fromkeys(DROP_REASONS[method], 0)
    truncated = dict.fromkeys(TRUNCATION_REASONS[method], 0)
    tokenize = {"sft": _tokenize_sft, "kto": tokenize_kto}.get(method, _tokenize_dpo)
    builder = _Builder(method)
    render = Renderer(tok, tokenizer_dir)
    job = _Job(tok, render, src, max_len, min_response_tokens, assistant_loss, seed, dropped, truncated, builder)
    job.method, job.margins = method, {}

    rows_read = _read_all(job, tokenize, progress)
    if rows_read == 0:
        raise DataError(src.path, "no rows")
    if not builder.keys:
        reasons = ", ".join(f"{k}: {v}" for k, v in dropped.items() if v)
        raise DataError(src.path, f"all {rows_read} rows were dropped ({reasons}); max_len={max_len}")

    _check_margins(job)
    table = builder.table()
    is_eval = _eval_mask(builder.keys, eval_fraction)
    train = table.filter(pa.array(~is_eval))
    evals = table.filter(pa.array(is_eval))
    if method == "kto":  # the KL pairing, within each split (memfit.data.unpaired)
        train, evals = (add_kl_pairing(t, max_len, truncated) for t in (train, evals))
        table = pa.concat_tables([train, evals])
    train_len = train["length"].to_numpy()
    all_len = table["length"].to_numpy()
    stats = {
        "method": method,
        "source": str(source),
        "max_len": max_len,
        "rows_read": rows_read,
        "rows_kept": {"train": train.num_rows, "eval": evals.num_rows},
        "dropped": dropped,
        "truncated": truncated,
        "length": _length_stats(all_len),
        "worst_case_rows": [int(i) for i in longest_first(train_len)[:WORST_CASE_ROWS]],
        "tokens": _token_count(table, method),
        "tokens_by_split": {"train": _token_count(train, method), "eval": _token_count(evals, method)},
        "eval_fraction": eval_fraction,
        **({"assistant_loss": assistant_loss, "loss_tokens": _loss_tokens(table)} if method == "sft" else {}),
        "seed": seed,
        "tokenizer": str(tokenizer_dir),
    }
    _write_atomic(Path(out_dir), train, evals, stats)
    return stats


def _write_atomic(out: Path, train: pa.Table, evals: pa.Table, stats: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        pq.write_table(train, tmp / "train.parquet")
        pq.write_table(evals, tmp / "eval.parquet")
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
