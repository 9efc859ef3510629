"""What a prepared dataset is: its columns (`SCHEMAS`), the ignore index of masked labels, the
reasons a row is dropped or cut (every one a key in stats.json), and `DataError`."""

from __future__ import annotations

import hashlib
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
DROP_REASONS["kto"] = ("blank_line", "empty_completion", "identical_chosen_rejected", "prompt_too_long")
TRUNCATION_REASONS = {"sft": ("response",), "dpo": ("chosen", "rejected"), "kto": ("completion", "kl_completion")}
PAIR_METHODS = ("dpo", "rm", "orpo", "simpo")  # prepared as DPO pairs (rm with its optional margin)
for _m in PAIR_METHODS[1:]:
    DROP_REASONS[_m], TRUNCATION_REASONS[_m] = DROP_REASONS["dpo"], TRUNCATION_REASONS["dpo"]

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
    # KTO: unpaired rows; kl_completion_ids is another row's completion, fixed at prep time
    # (memfit.data.unpaired.add_kl_pairing); length = prompt + the longer of the two completions
    "kto": pa.schema(
        [
            ("row", pa.int64()),
            ("prompt_ids", _LIST_I32),
            ("completion_ids", _LIST_I32),
            ("label", pa.bool_()),
            ("kl_completion_ids", _LIST_I32),
            ("length", pa.int32()),
        ]
    ),
}
SCHEMAS["orpo"] = SCHEMAS["simpo"] = SCHEMAS["dpo"]
# rm: a pair's optional `margin` (TRL RewardTrainer's margin column), null when the data has none
SCHEMAS["rm"] = SCHEMAS["dpo"].insert(4, pa.field("margin", pa.float64()))


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


def token_ids(tok, texts: list[str]) -> list[list[int]]:
    """`texts` tokenized without special tokens (the chat template already has them)."""
    if not texts:
        return []
    return tok(texts, add_special_tokens=False)["input_ids"]


def prompt_key(seed: int, prompt_text: str) -> int:
    """The split's group key of a rendered prompt (memfit.data: the split is grouped by prompt)."""
    digest = hashlib.blake2b(f"{seed}\n{prompt_text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
