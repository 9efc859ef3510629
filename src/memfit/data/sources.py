"""Reading raw rows: JSONL, Parquet or a saved HF dataset as numbered records, each row's
prompt/response (SFT) or prompt/chosen/rejected (DPO) checked; `DataError` names the file, the
1-based line or row and the key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from memfit.data.schema import CHUNK_ROWS, DataError


@dataclass
class Source:
    path: Path
    unit: str  # "line" (JSONL) or "row" (Parquet, datasets on disk)
    total: int  # number of lines/rows, for the progress bar
    records: Iterator[tuple[int, dict | None]]  # (1-based line/row, record); None = blank line


def open_source(path: Path) -> Source:
    if not path.exists():
        raise DataError(path, "no such file or directory")
    if path.is_dir():
        return _open_saved_dataset(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1" or path.suffix == ".parquet":
        return _open_parquet(path)
    return _open_jsonl(path)


def _open_jsonl(path: Path) -> Source:
    with open(path, "rb") as f:
        total = sum(1 for _ in f)

    def records() -> Iterator[tuple[int, dict | None]]:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        path,
                        f"not UTF-8 (byte {raw[e.start : e.start + 1]!r} at column {e.start + 1}); JSONL must be UTF-8",
                        lineno,
                    ) from None
                if lineno == 1:
                    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is harmless
                if not text.strip():
                    yield lineno, None
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(
                        path,
                        f"not JSON ({e.msg} at column {e.colno}); expected JSONL, one JSON object per line",
                        lineno,
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(
                        path, f"expected a JSON object per line (JSONL), got a JSON {type(record).__name__}", lineno
                    )
                yield lineno, record

    return Source(path, "line", total, records())


def _table_records(path: Path, batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[int, dict]]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _open_parquet(path: Path) -> Source:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(path, f"not a readable Parquet file ({e})") from None
    return Source(path, "row", pf.metadata.num_rows, _table_records(path, pf.iter_batches(batch_size=CHUNK_ROWS)))


def _open_saved_dataset(path: Path) -> Source:
    """A `datasets` save_to_disk directory: state.json lists Arrow stream files (indices flattened)."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise DataError(
                path, f"a DatasetDict without a 'train' split (splits: {splits}); pass the split's directory"
            )
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
    return Source(path, "row", total, _table_records(path, batches))


# ------------------------------------------------------------------------ validation


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


NEEDS = {
    "sft": "SFT rows need 'prompt' and 'response', 'messages' or 'conversations'",
    "dpo": "DPO rows need 'prompt', 'chosen' and 'rejected' (strings, or message lists)",
    "kto": "KTO rows need 'prompt', 'completion' and 'label' (true: desirable), or a pair 'prompt', 'chosen', 'rejected'",
}


def string_field(src: Source, row: int, record: dict, key: str, method: str, *, non_empty: bool = False) -> str:
    if key not in record:
        raise DataError(src.path, f"missing ({NEEDS[method]}; the row has keys {sorted(record)})", row, key, src.unit)
    value = record[key]
    if not isinstance(value, str):
        raise DataError(src.path, f"expected a string, got {type_name(value)}", row, key, src.unit)
    if non_empty and not value.strip():
        raise DataError(src.path, "empty", row, key, src.unit)
    return value
