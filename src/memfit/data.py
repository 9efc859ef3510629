"""What the model trains on: read a dataset, apply the chat template, tokenize, filter, split.

`prepare()` is the `prepare_data` rule. It reads JSONL, Parquet, or a HF `datasets` dataset
saved with `save_to_disk` (the directory `load_from_disk` reads; read here with pyarrow, so
`datasets` need not be installed; a `DatasetDict` contributes its `train` split), and writes

    out_dir/train.parquet, out_dir/eval.parquet, out_dir/stats.json

Rows
  SFT  `{"prompt": str, "response": str}` or `{"messages": [{"role", "content"}, ...]}`; with
       `messages` the last turn must be the assistant's and is the only one with loss; the
       earlier turns (earlier assistant turns included) are the prompt. `messages` wins when a
       row has both (ultrachat-style rows carry a redundant `prompt`).
  DPO  `{"prompt": str, "chosen": str, "rejected": str}`.
  Other keys are ignored. Blank JSONL lines are skipped and counted (`dropped.blank_line`).

Tokenization (the convention of TRL's DPOTrainer.tokenize_row and SFT prompt-completion
format): the prompt is rendered with the tokenizer's chat template and
`add_generation_prompt=True`, then tokenized without adding special tokens (the template
already has them); each response is tokenized on its own and EOS is appended.

Columns (the trainer and the probes read exactly these)
  SFT  row int64 (1-based source line/row), input_ids list<int32>, labels list<int32>
       (-100 on the prompt: the ignore_index of torch's CrossEntropyLoss that HF causal-LM
       losses use; unshifted, HF models shift inside), length int32.
  DPO  row, prompt_ids, chosen_ids, rejected_ids (list<int32>; responses end with EOS unless
       truncated), length int32 = len(prompt) + max(len(chosen), len(rejected)).

Filtering and truncation (never silent: every reason is a key in stats.json, zero included)
  - A prompt is never cut: cutting the start of a templated conversation removes BOS, the
    system turn and usually the question, and cutting its end removes the generation prompt.
    A row whose prompt leaves fewer than `min_response_tokens` (default 1) tokens of room
    under `max_len` is dropped (`prompt_too_long`).
  - A response longer than the room left is cut at the end (loses its EOS); counted in
    `truncated.response` (SFT) or `truncated.chosen` / `truncated.rejected` (DPO), on kept
    rows only, so the counts describe the output. This is TRL's
    `truncation_mode="keep_start"` (DPOConfig) applied to completions only.
  - SFT: an empty or whitespace-only response is dropped (`empty_response`): it would only
    teach the model to stop at once.
  - DPO: an empty chosen or rejected (`empty_chosen`, `empty_rejected`) or chosen == rejected
    (`identical_chosen_rejected`) is dropped: the pair carries no preference, and the DPO loss
    of an identical pair is the constant log 2 with zero gradient. A pair whose chosen and
    rejected become identical after truncation is dropped too (`identical_after_truncation`).
  - Duplicate rows are kept (they may be deliberate upsampling).
  - If no row is left, `prepare` raises instead of writing an empty dataset.

Packing (SFT, `train.sft.packing`) happens when training starts, not here: `pack()` groups the
prepared rows into sequences of at most the candidate's seq_len tokens (best-fit decreasing,
seeded), and the trainer concatenates each group with position_ids restarting at every row.

Bad input raises `DataError` naming the file, the 1-based line (JSONL) or row (Parquet,
datasets) and the key, before anything is written: non-UTF-8 bytes, a line that is not a JSON
object (a CSV, a JSON array, garbage), a missing key, a wrong type, an empty prompt. Output is
written to a temporary sibling of `out_dir` and renamed into place, so a failed run leaves no
`out_dir` (or the previous one untouched).

Split: deterministic in `seed`, grouped by rendered prompt text, so every row sharing a prompt
(SFT duplicates, several DPO pairs of one prompt) lands in the same split and eval never sees a
training prompt. The prompts with the smallest `blake2b(seed, prompt)` form eval:
round(eval_fraction * number_of_prompts) of them, at least one when eval_fraction > 0 and
there are two prompts or more, never all. Rows keep their source order within a split.

stats.json: method, source, max_len, rows_read (source lines or rows, blank lines included:
rows_read == kept + dropped), rows_kept {train, eval}, dropped {reason: n},
truncated {reason: n}, length {min, mean, p50, p90, p99, max} over kept rows of both splits
(percentiles by nearest rank, so each is a real row length), worst_case_rows (positions in
train.parquet of the longest rows, longest first, ties by position; up to 256), tokens (token
ids stored, both splits; DPO counts the prompt once per pair), plus tokens_by_split,
eval_fraction, seed and tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memfit.atomic import replace_dir

IGNORE_INDEX = -100  # torch.nn.CrossEntropyLoss(ignore_index=-100), used by HF causal-LM losses
WORST_CASE_ROWS = 256  # how many longest train rows stats.json lists
PROGRESS_MIN_ROWS = 5000  # show a progress bar from this many rows on
CHUNK_ROWS = 1024  # rows rendered and tokenized per batch call

DROP_REASONS = {
    "sft": ("blank_line", "empty_response", "prompt_too_long"),
    "dpo": (
        "blank_line",
        "empty_chosen",
        "empty_rejected",
        "identical_chosen_rejected",
        "prompt_too_long",
        "identical_after_truncation",
    ),
}
TRUNCATION_REASONS = {"sft": ("response",), "dpo": ("chosen", "rejected")}

_LIST_I32 = pa.list_(pa.int32())
SCHEMAS = {
    "sft": pa.schema(
        [("row", pa.int64()), ("input_ids", _LIST_I32), ("labels", _LIST_I32), ("length", pa.int32())]
    ),
    "dpo": pa.schema(
        [
            ("row", pa.int64()),
            ("prompt_ids", _LIST_I32),
            ("chosen_ids", _LIST_I32),
            ("rejected_ids", _LIST_I32),
            ("length", pa.int32()),
        ]
    ),
}


class DataError(ValueError):
    """Bad input: names the file, the 1-based line or row, and the key."""

    def __init__(self, path: str | os.PathLike, problem: str, line: int | None = None,
                 key: str | None = None, unit: str = "line") -> None:
        self.path, self.line, self.key, self.problem = str(path), line, key, problem
        where = str(path)
        if line is not None:
            where += f", {unit} {line}"
        if key is not None:
            where += f", key {key!r}"
        super().__init__(f"{where}: {problem}")


# --------------------------------------------------------------------------- reading


@dataclass
class _Source:
    path: Path
    unit: str  # "line" (JSONL) or "row" (Parquet, datasets on disk)
    total: int  # number of lines/rows, for the progress bar
    records: Iterator[tuple[int, dict | None]]  # (1-based line/row, record); None = blank line


def _open_source(path: Path) -> _Source:
    if not path.exists():
        raise DataError(path, "no such file or directory")
    if path.is_dir():
        return _open_saved_dataset(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1" or path.suffix == ".parquet":
        return _open_parquet(path)
    return _open_jsonl(path)


def _open_jsonl(path: Path) -> _Source:
    with open(path, "rb") as f:
        total = sum(1 for _ in f)

    def records() -> Iterator[tuple[int, dict | None]]:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        path, f"not UTF-8 (byte {raw[e.start:e.start + 1]!r} at column {e.start + 1}); "
                        "JSONL must be UTF-8", lineno) from None
                if lineno == 1:
                    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is harmless
                if not text.strip():
                    yield lineno, None
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(
                        path, f"not JSON ({e.msg} at column {e.colno}); expected JSONL, one JSON "
                        "object per line", lineno) from None
                if not isinstance(record, dict):
                    raise DataError(
                        path, f"expected a JSON object per line (JSONL), got a JSON "
                        f"{type(record).__name__}", lineno)
                yield lineno, record

    return _Source(path, "line", total, records())


def _table_records(path: Path, batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[int, dict]]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _open_parquet(path: Path) -> _Source:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(path, f"not a readable Parquet file ({e})") from None
    return _Source(path, "row", pf.metadata.num_rows,
                   _table_records(path, pf.iter_batches(batch_size=CHUNK_ROWS)))


def _open_saved_dataset(path: Path) -> _Source:
    """A `datasets` save_to_disk directory: state.json lists Arrow stream files (indices flattened)."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise DataError(path, f"a DatasetDict without a 'train' split (splits: {splits}); "
                            "pass the split's directory")
        path = path / "train"
    state_file = path / "state.json"
    if not state_file.exists():
        raise DataError(path, "a directory but not a datasets save_to_disk output (no state.json)")
    state = json.loads(state_file.read_text())
    files = [path / f["filename"] for f in state["_data_files"]]
    readers = []
    for f in files:
        try:
            readers.append(pa.ipc.open_stream(pa.memory_map(str(f))))
        except (pa.ArrowException, OSError) as e:
            raise DataError(f, f"not a readable Arrow stream ({e})") from None
    tables = [r.read_all() for r in readers]
    total = sum(t.num_rows for t in tables)
    batches = (b for t in tables for b in t.to_batches(max_chunksize=CHUNK_ROWS))
    return _Source(path, "row", total, _table_records(path, batches))


# ------------------------------------------------------------------------ validation


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


NEEDS = {
    "sft": "SFT rows need 'prompt' and 'response', or 'messages'",
    "dpo": "DPO rows need 'prompt', 'chosen' and 'rejected' (strings)",
}


def _string(src: _Source, row: int, record: dict, key: str, method: str, *,
            non_empty: bool = False) -> str:
    if key not in record:
        raise DataError(src.path, f"missing ({NEEDS[method]}; the row has keys {sorted(record)})",
                        row, key, src.unit)
    value = record[key]
    if not isinstance(value, str):
        raise DataError(src.path, f"expected a string, got {_type_name(value)}", row, key, src.unit)
    if non_empty and not value.strip():
        raise DataError(src.path, "empty", row, key, src.unit)
    return value


def _sft_conversation(src: _Source, row: int, record: dict) -> tuple[list[dict], str]:
    """(prompt messages, final assistant response) of one SFT row."""
    if "messages" not in record:
        prompt = _string(src, row, record, "prompt", "sft", non_empty=True)
        response = _string(src, row, record, "response", "sft")
        return [{"role": "user", "content": prompt}], response
    messages = record["messages"]

    def bad(problem: str, key: str) -> DataError:
        return DataError(src.path, problem, row, key, src.unit)

    if not isinstance(messages, list):
        raise bad(f"expected a list of {{role, content}} turns, got {_type_name(messages)}", "messages")
    if len(messages) < 2:
        raise bad(f"needs a prompt turn and a final assistant turn, got {len(messages)} turn(s)",
                  "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"expected an object {{role, content}}, got {_type_name(m)}", f"messages[{i}]")
        for k in ("role", "content"):
            if k not in m:
                raise bad("missing", f"messages[{i}].{k}")
            if not isinstance(m[k], str):
                raise bad(f"expected a string, got {_type_name(m[k])}", f"messages[{i}].{k}")
    last = len(messages) - 1
    if messages[last]["role"] != "assistant":
        raise bad(f"the last turn must be the assistant's (it gets the loss), got "
                  f"{messages[last]['role']!r}", f"messages[{last}].role")
    if not any(m["content"].strip() for m in messages[:last]):
        raise bad("empty prompt: every turn before the last is empty", "messages")
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:last]]
    return prompt, messages[last]["content"]


# ------------------------------------------------------------------------- tokenizing


def _load_tokenizer(tokenizer_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not tok.chat_template:
        raise ValueError(f"tokenizer at {tokenizer_dir} has no chat_template (a base model's "
                         "tokenizer?): set one in its tokenizer_config.json or chat_template.jinja")
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {tokenizer_dir} has no eos_token")
    return tok


def _render_prompts(tok, conversations: list[list[dict]]) -> list[str]:
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations]


def _ids(tok, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tok(texts, add_special_tokens=False)["input_ids"]


def _prompt_key(seed: int, prompt_text: str) -> int:
    digest = hashlib.blake2b(f"{seed}\n{prompt_text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


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


def _tokenize_sft(tok, chunk, src, max_len, min_response, dropped, truncated, seed, out: _Builder):
    convs, responses, rows = [], [], []
    for row, record in chunk:
        prompt, response = _sft_conversation(src, row, record)
        if not response.strip():
            dropped["empty_response"] += 1
            continue
        convs.append(prompt)
        responses.append(response)
        rows.append(row)
    prompt_texts = _render_prompts(tok, convs)
    cols: dict[str, list] = {"row": [], "input_ids": [], "labels": [], "length": []}
    keys = []
    eos = tok.eos_token_id
    for row, text, p, r in zip(rows, prompt_texts, _ids(tok, prompt_texts), _ids(tok, responses),
                               strict=True):
        r = r + [eos]
        room = max_len - len(p)
        if room < min_response:
            dropped["prompt_too_long"] += 1
            continue
        if len(r) > room:
            r = r[:room]
            truncated["response"] += 1
        cols["row"].append(row)
        cols["input_ids"].append(p + r)
        cols["labels"].append([IGNORE_INDEX] * len(p) + r)
        cols["length"].append(len(p) + len(r))
        keys.append(_prompt_key(seed, text))
    out.add(cols, keys)


def _tokenize_dpo(tok, chunk, src, max_len, min_response, dropped, truncated, seed, out: _Builder):
    convs, chosens, rejecteds, rows = [], [], [], []
    for row, record in chunk:
        prompt = _string(src, row, record, "prompt", "dpo", non_empty=True)
        chosen = _string(src, row, record, "chosen", "dpo")
        rejected = _string(src, row, record, "rejected", "dpo")
        if not chosen.strip():
            dropped["empty_chosen"] += 1
        elif not rejected.strip():
            dropped["empty_rejected"] += 1
        elif chosen == rejected:
            dropped["identical_chosen_rejected"] += 1
        else:
            convs.append([{"role": "user", "content": prompt}])
            chosens.append(chosen)
            rejecteds.append(rejected)
            rows.append(row)
    prompt_texts = _render_prompts(tok, convs)
    cols: dict[str, list] = {"row": [], "prompt_ids": [], "chosen_ids": [], "rejected_ids": [],
                             "length": []}
    keys = []
    eos = tok.eos_token_id
    for row, text, p, c, r in zip(rows, prompt_texts, _ids(tok, prompt_texts), _ids(tok, chosens),
                                  _ids(tok, rejecteds), strict=True):
        c, r = c + [eos], r + [eos]
        room = max_len - len(p)
        if room < min_response:
            dropped["prompt_too_long"] += 1
            continue
        cut_c, cut_r = len(c) > room, len(r) > room
        c, r = c[:room], r[:room]
        if c == r:
            dropped["identical_after_truncation"] += 1
            continue
        truncated["chosen"] += cut_c  # counted on kept rows only: stats describe the output
        truncated["rejected"] += cut_r
        cols["row"].append(row)
        cols["prompt_ids"].append(p)
        cols["chosen_ids"].append(c)
        cols["rejected_ids"].append(r)
        cols["length"].append(len(p) + max(len(c), len(r)))
        keys.append(_prompt_key(seed, text))
    out.add(cols, keys)


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

    return {"min": int(s[0]), "mean": round(float(s.mean()), 2), "p50": rank(50), "p90": rank(90),
            "p99": rank(99), "max": int(s[-1])}


def _token_count(table: pa.Table, method: str) -> int:
    cols = ("input_ids",) if method == "sft" else ("prompt_ids", "chosen_ids", "rejected_ids")
    return int(sum(pc.sum(pc.list_value_length(table[c])).as_py() or 0
                   for c in cols))


def _longest_first(lengths: np.ndarray) -> np.ndarray:
    return np.argsort(-lengths.astype(np.int64), kind="stable")


# ------------------------------------------------------------------------------ prepare


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
) -> dict:
    """Tokenize `source` for `method` ("sft" or "dpo") into `out_dir`; returns the stats dict.

    `progress`: tqdm bar on stderr; by default when the source has PROGRESS_MIN_ROWS rows or more.
    """
    if method not in SCHEMAS:
        raise ValueError(f"method must be 'sft' or 'dpo', got {method!r}")
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if min_response_tokens < 1:
        raise ValueError(f"min_response_tokens must be at least 1, got {min_response_tokens}")
    src = _open_source(Path(source))
    tok = _load_tokenizer(tokenizer_dir)
    dropped = dict.fromkeys(DROP_REASONS[method], 0)
    truncated = dict.fromkeys(TRUNCATION_REASONS[method], 0)
    tokenize = _tokenize_sft if method == "sft" else _tokenize_dpo
    builder = _Builder(method)

    from tqdm import tqdm

    show = src.total >= PROGRESS_MIN_ROWS if progress is None else progress
    rows_read = 0
    with tqdm(total=src.total, desc=f"tokenizing {src.path.name}", unit="row", disable=not show) as bar:
        chunk: list[tuple[int, dict]] = []
        for row, record in src.records:
            rows_read += 1
            if record is None:
                dropped["blank_line"] += 1
            else:
                chunk.append((row, record))
            if len(chunk) == CHUNK_ROWS:
                tokenize(tok, chunk, src, max_len, min_response_tokens, dropped, truncated, seed, builder)
                bar.update(len(chunk))
                chunk = []
        tokenize(tok, chunk, src, max_len, min_response_tokens, dropped, truncated, seed, builder)
        bar.update(bar.total - bar.n)

    if rows_read == 0:
        raise DataError(src.path, "no rows")
    if not builder.keys:
        reasons = ", ".join(f"{k}: {v}" for k, v in dropped.items() if v)
        raise DataError(src.path, f"all {rows_read} rows were dropped ({reasons}); max_len={max_len}")

    table = builder.table()
    is_eval = _eval_mask(builder.keys, eval_fraction)
    train = table.filter(pa.array(~is_eval))
    evals = table.filter(pa.array(is_eval))
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
        "worst_case_rows": [int(i) for i in _longest_first(train_len)[:WORST_CASE_ROWS]],
        "tokens": _token_count(table, method),
        "tokens_by_split": {"train": _token_count(train, method), "eval": _token_count(evals, method)},
        "eval_fraction": eval_fraction,
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


# -------------------------------------------------------------------------- consumers


def load_split(out_dir: str | os.PathLike, split: str) -> list[dict]:
    """Rows of `train` or `eval` as dicts of python ints/lists, in file order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return pq.read_table(Path(out_dir) / f"{split}.parquet").to_pylist()


def pack(lengths: list[int] | np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """SFT packing: row indices grouped into packs of at most `capacity` tokens in all.

    Best-fit decreasing (TRL's default `packing_strategy="bfd"`, SFTConfig docs:
    https://huggingface.co/docs/trl/sft_trainer#packing): rows, longest first, each go into the
    open pack with the least room that still holds them, else into a new pack. Rows are never
    cut or split across packs. Ties in length are ordered by a permutation drawn from `seed`, so
    the same (lengths, capacity, seed) always gives the same packs. Within a pack rows keep their
    placement order; packs are numbered by creation (the trainer shuffles them per epoch).
    """
    import bisect

    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        bad = int(np.argmax((lengths > capacity) | (lengths < 1)))
        raise ValueError(f"row {bad} has {int(lengths[bad])} tokens; packing needs 1..{capacity}")
    perm = np.random.default_rng(seed).permutation(len(lengths))
    order = perm[np.argsort(-lengths[perm], kind="stable")]
    packs: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, pack index), sorted: open packs only
    for i in order.tolist():
        n = int(lengths[i])
        j = bisect.bisect_left(rooms, (n, -1))  # the smallest room >= n
        if j < len(rooms):
            room, k = rooms.pop(j)
        else:
            room, k = capacity, len(packs)
            packs.append([])
        packs[k].append(i)
        if room - n > 0:
            bisect.insort(rooms, (room - n, k))
    return packs


def worst_case_batch(out_dir: str | os.PathLike, micro_batch: int) -> list[dict]:
    """The `micro_batch` longest train rows, longest first (what a probe must survive).

    With fewer train rows than `micro_batch`, rows repeat (longest first) to fill the batch:
    memory depends on the shapes, and a probe needs the full batch shape.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    table = pq.read_table(Path(out_dir) / "train.parquet")
    order = _longest_first(table["length"].to_numpy())
    picks = np.resize(order, micro_batch)  # np.resize repeats the array cyclically
    return table.take(pa.array(picks)).to_pylist()
