"""What a prepared dataset is: its columns (`SCHEMAS`), the ignore index of masked labels, the
reasons a row is dropped or cut (every one a key in stats.json), and `DataError`."""

from __future__ import annotations

import os

import pyarrow as pa

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
    "sft": pa.schema([("row", pa.int64()), ("input_ids", _LIST_I32), ("labels", _LIST_I32), ("length", pa.int32())]),
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

    def __init__(
        self, path: str | os.PathLike, problem: str, line: int | None = None, key: str | None = None, unit: str = "line"
    ) -> None:
        self.path, self.line, self.key, self.problem = str(path), line, key, problem
        where = str(path)
        if line is not None:
            where += f", {unit} {line}"
        if key is not None:
            where += f", key {key!r}"
        super().__init__(f"{where}: {problem}")


# --------------------------------------------------------------------------- reading
