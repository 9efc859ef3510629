"""What the model trains on: read a dataset, apply the chat template, tokenize, filter, split.

`prepare()` is the `prepare_data` rule. It reads JSONL, Parquet, or a HF `datasets` dataset
saved with `save_to_disk` (the directory `load_from_disk` reads; read here with pyarrow, so
`datasets` need not be installed; a `DatasetDict` contributes its `train` split), and writes

    out_dir/train.parquet, out_dir/eval.parquet, out_dir/stats.json

Rows (`memfit.data.chat` reads the chat shapes; docs/data.md shows each)
  SFT  `{"prompt": str, "response": str}`, `{"messages": [{"role", "content"}, ...]}` or ShareGPT
       `{"conversations": [{"from", "value"}, ...]}` (roles system, user/human, assistant/gpt;
       either turn shape under either key). The last turn must be the assistant's. With
       `assistant_loss="all"` (the default, TRL's assistant_only_loss) every assistant turn
       carries loss, each as the template renders it (content and end-of-turn marker); with
       "last" only the final one, the earlier turns are the prompt. `messages` wins over
       `conversations` over `prompt` when a row has several (ultrachat-style rows carry a
       redundant `prompt`).
  DPO  `{"prompt": str, "chosen": str, "rejected": str}`, or TRL's conversational pairs: `prompt`
       a message list and `chosen`/`rejected` one assistant turn each, or no prompt and
       `chosen`/`rejected` full conversations whose shared prefix is the prompt
       (trl.data_utils.extract_prompt). Either way the answer is the assistant turn's content,
       tokenized as a string answer is: a conversational pair prepares exactly as its string pair.
  rm, orpo, simpo  DPO's pairs; rm keeps an optional number `margin` per pair (all pairs or none).
  KTO  `{"prompt", "completion", "label": bool}` (TRL's unpaired format; prompt and completion
       strings, or a message list and one assistant turn), or DPO pairs, each converted to a
       desirable and an undesirable row (`memfit.data.unpaired`).
  Other keys are ignored. Blank JSONL lines are skipped and counted (`dropped.blank_line`).

Tokenization (the convention of TRL's DPOTrainer.tokenize_row and SFT prompt-completion
format): the prompt is rendered with the tokenizer's chat template and
`add_generation_prompt=True`, then tokenized without adding special tokens (the template
already has them); each response is tokenized on its own and EOS is appended. With loss on
every assistant turn, the rendered prompt is cut at each earlier assistant turn and every piece
tokenized on its own, so a scored span never shares a token with an unscored one.

Columns (the trainer and the probes read exactly these)
  SFT  row int64 (1-based source line/row), input_ids list<int32>, labels list<int32>
       (-100 on every unscored token, the prompt and non-assistant turns: the ignore_index of torch's CrossEntropyLoss that HF causal-LM
       losses use; unshifted, HF models shift inside), length int32.
  DPO  row, prompt_ids, chosen_ids, rejected_ids (list<int32>; responses end with EOS unless
       truncated), length int32 = len(prompt) + max(len(chosen), len(rejected)).
       rm adds margin float64 (null without one); orpo and simpo are DPO's columns.
  KTO  row, prompt_ids, completion_ids, label bool, kl_completion_ids (another prompt's
       completion, fixed per split: memfit.data.unpaired.add_kl_pairing), length int32 =
       len(prompt) + max(len(completion), len(kl_completion)).

Filtering and truncation (never silent: every reason is a key in stats.json, zero included)
  - A prompt (everything before the final assistant turn, earlier scored turns included) is
    never cut: cutting the start of a templated conversation removes BOS, the
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
truncated {reason: n}, length {min, mean, p50, p90, p99, max, quantiles} over kept rows of both
splits (percentiles by nearest rank, so each is a real row length; quantiles: p0..p100, 101 of
them), worst_case_rows (positions in
train.parquet of the longest rows, longest first, ties by position; up to 256), tokens (token
ids stored, both splits; DPO counts the prompt once per pair), plus tokens_by_split,
eval_fraction, seed and tokenizer; SFT adds assistant_loss and loss_tokens (label positions with
loss, both splits).

This package owns preparing data (`preparation`, from `sources`, to the columns of `schema`) and
reading it back (`shards`: splits, the worst-case batch, packing). It may import `memfit.atomic`
only: the training loop and the workflow import it, never the other way round.
"""

from memfit.data.preparation import prepare
from memfit.data.schema import (
    DROP_REASONS,
    IGNORE_INDEX,
    SCHEMAS,
    TRUNCATION_REASONS,
    WORST_CASE_ROWS,
    DataError,
)
from memfit.data.shards import load_split, pack, worst_case_batch

__all__ = [
    "DROP_REASONS",
    "IGNORE_INDEX",
    "SCHEMAS",
    "TRUNCATION_REASONS",
    "WORST_CASE_ROWS",
    "DataError",
    "load_split",
    "pack",
    "prepare",
    "worst_case_batch",
]
