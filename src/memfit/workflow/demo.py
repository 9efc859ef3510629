"""The embedded CPU demo: a bundled arithmetic dataset, a tokenizer trained on it and a tiny Llama.

Nothing here downloads anything. Two commands regenerate every demo input:

    python -m memfit.workflow.demo data --out data/demo
    python -m memfit.workflow.demo model --config config/models/demo-tiny.json --data data/demo \
        --out resources/demo-tiny

Dataset (`data/demo/`, committed; regeneration is byte-for-byte identical, a test checks it):
  - `sft.jsonl`: 5600 rows `{"prompt": "Which is larger, 37 or 52?", "response": "52"}`.
  - `dpo.jsonl`: 1600 rows `{"prompt", "chosen", "rejected"}`: chosen is the right answer,
    rejected a plausible mistake (the other number; the number itself, a step the wrong way
    or two steps; a forgotten carry/borrow, `after 379` -> `370`).
  Four questions: which of two different two-digit numbers is larger / smaller (3/8 of the rows
  each), and what comes after / before a three-digit number (1/8 each). Every answer is the
  question's digits copied with at most a local change, so a ~3M-parameter model learns the
  procedure, not a table: SFT eval loss per response token falls from ~5.8 to well under 1 and
  DPO reward accuracy on held-out pairs passes 0.8 within a couple of CPU minutes.
  - `rm.jsonl`: the same 1600 pairs for a reward model, the rejected response of three rows
    in four a non-answer ("I don't know.") instead of the mistake (`generate_rm` says why).
  Problems are unique within each file and the two files ask disjoint problems, so DPO's
  pairs, held-out ones included, are problems the SFT model never saw.

Tokenizer: byte-level BPE (any text encodes, no unknown tokens) with every digit a token of
its own (numbers are never merged, so arithmetic is learnable digit by digit), trained on the
bundled data; special tokens `<|pad|> <|bos|> <|eos|> <|system|> <|user|> <|assistant|>`
and a Jinja chat template where an assistant turn ends with EOS.

Model: `config/models/demo-tiny.json` is a HF LlamaConfig; any config.json of a model_type in
transformers' causal-LM mapping builds the same way (AutoModelForCausalLM.from_config:
config/models/tiny-*.json are tiny flagship architectures). Its `vocab_size`, `bos_token_id`,
`eos_token_id` and `pad_token_id` are overwritten at build time from the trained tokenizer
(the committed values are what the bundled data produce, so the JSON is also usable as a
plain `config.json` by the estimator). Keys starting with `_` are comments and are dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from memfit.atomic import replace_dir

DATA_SEED = 0  # the committed data/demo files are generated with this seed
N_SFT = 5600
N_DPO = 1600
COUNT_RANGE = (100, 999)  # after/before ask about three-digit numbers: 900 problems each
COMPARE_RANGE = (10, 99)  # larger/smaller compare two different two-digit numbers

# Four questions about numbers 0..999, each answered by copying digits with at most a small
# local change: a tiny model learns them as procedures (not a lookup table), so it answers
# numbers it has never seen.
TASKS = ("after", "before", "larger", "smaller")
PROMPT_TEMPLATES = {
    "after": ("What comes after {a}?", "What number follows {a}?"),
    "before": ("What comes before {a}?", "What number precedes {a}?"),
    "larger": ("Which is larger, {a} or {b}?", "Which is bigger: {a} or {b}?"),
    "smaller": ("Which is smaller, {a} or {b}?", "Which is less: {a} or {b}?"),
}
TASK_SHARE = {"after": 1, "before": 1, "larger": 3, "smaller": 3}  # eighths of each file

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS.values()]  # ids 0..5 in this order
TOKENIZER_VOCAB_TARGET = 384  # BPE stops earlier when the data has nothing left to merge

# One BOS, then `<|role|>content` per turn; an assistant turn ends with EOS so generation
# stops there and `prompt (add_generation_prompt) + response + EOS` equals the rendered
# conversation token for token (memfit.data relies on this prefix property).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'system' %}"
    "<|system|>{{ message['content'] }}"
    "{% else %}"
    "<|user|>{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# --------------------------------------------------------------------------- data


Problem = tuple[str, int, int]  # (task, a, b); b is 0 for after/before


def _problems(rng: random.Random, task: str, n: int) -> list[Problem]:
    """`n` different problems of one task."""
    if task in ("after", "before"):
        return [(task, a, 0) for a in rng.sample(range(COUNT_RANGE[0], COUNT_RANGE[1] + 1), n)]
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        a, b = rng.sample(range(COMPARE_RANGE[0], COMPARE_RANGE[1] + 1), 2)  # two different numbers
        if (min(a, b), max(a, b)) not in seen:  # "a or b" and "b or a" are one problem
            seen.add((min(a, b), max(a, b)))
            out.append((task, a, b))
    return out


def _answer(task: str, a: int, b: int) -> int:
    return {"after": a + 1, "before": a - 1, "larger": max(a, b), "smaller": min(a, b)}[task]


def _wrong_answer(rng: random.Random, task: str, a: int, b: int) -> int:
    """A mistake a learner makes, always checkable against the question.

    after/before: the number itself (forgot to count), a step the wrong way, a step of two,
    or the carry/borrow forgotten when the last digit wraps (`39 -> 30`, `40 -> 49`);
    larger/smaller: the other number.
    """
    if task in ("larger", "smaller"):
        return a + b - _answer(task, a, b)
    step = 1 if task == "after" else -1
    kinds = ["same", "wrong_way", "two_steps"]
    if a % 10 == (9 if step == 1 else 0):
        kinds += ["carry", "carry"]  # the classic mistake where it can happen
    kind = rng.choice(kinds)
    if kind == "carry":
        wrong = a - 9 if step == 1 else a + 9  # 39 -> 30, 40 -> 49: only the last digit moved
    elif kind == "wrong_way":
        wrong = a - step
    elif kind == "two_steps":
        wrong = a + 2 * step
    else:
        wrong = a
    if wrong < 0 or wrong == a + step:
        wrong = a
    return wrong


def _prompt(rng: random.Random, task: str, a: int, b: int) -> str:
    return rng.choice(PROMPT_TEMPLATES[task]).format(a=a, b=b)


def generate_data(seed: int = DATA_SEED) -> tuple[list[dict], list[dict]]:
    """The SFT and DPO rows, deterministic in `seed` (Python's `random`, stable across versions).

    The two files ask about different problems, so DPO (and its held-out split) only sees
    numbers the SFT model has not been trained on.
    """
    rng = random.Random(seed)
    sft_problems: list[Problem] = []
    dpo_problems: list[Problem] = []
    for task in TASKS:
        n_sft, n_dpo = N_SFT * TASK_SHARE[task] // 8, N_DPO * TASK_SHARE[task] // 8
        problems = _problems(rng, task, n_sft + n_dpo)
        sft_problems += problems[:n_sft]
        dpo_problems += problems[n_sft:]
    rng.shuffle(sft_problems)
    rng.shuffle(dpo_problems)
    sft = [{"prompt": _prompt(rng, *p), "response": str(_answer(*p))} for p in sft_problems]
    dpo = []
    for p in dpo_problems:
        dpo.append(
            {
                "prompt": _prompt(rng, *p),
                "chosen": str(_answer(*p)),
                "rejected": str(_wrong_answer(rng, *p)),
            }
        )
    return sft, dpo


def _write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_sets(out_dir: str | os.PathLike, sets: dict[str, tuple[list[dict], str]]) -> dict[str, Path]:
    """Write each method's rows (`{method: (rows, file name)}`) as JSONL into `out_dir`, each file
    atomically; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for method, (rows, name) in sets.items():
        paths[method] = out / name
        _write_jsonl(rows, paths[method])
    return paths


# A non-answer, which a helpfulness preference ranks below any answer (the rejected response of
# half the reward-model pairs, `generate_rm`).
NON_ANSWERS = ("I don't know.", "I can't answer that.", "Sorry, no idea.", "Ask someone else.")


def generate_rm(dpo: list[dict]) -> list[dict]:
    """The reward-model pairs (`rm.jsonl`): the DPO pairs, with the rejected response of three rows
    in four a non-answer (the four of `NON_ANSWERS` in turn) instead of the plausible mistake; every
    fourth row keeps its mistake. A reward head on the demo model learns to rank an answer above a
    non-answer within a demo's steps, and right above wrong numbers far more slowly (trained on the
    mistakes alone: 0.56 held-out accuracy after 141 steps at lr 3e-3; with one row in two a
    non-answer, 0.65-0.74 held-out, the mistakes at or below chance; measured 2026-11-27/28), so
    held-out accuracy lands near 0.8: three pairs in four near certain, the fourth near chance."""
    return [
        row if i % 4 == 3 else row | {"rejected": NON_ANSWERS[(i - i // 4) % len(NON_ANSWERS)]}
        for i, row in enumerate(dpo)
    ]


def write_data(out_dir: str | os.PathLike, seed: int = DATA_SEED) -> dict[str, Path]:
    """Write `sft.jsonl`, `dpo.jsonl` and `rm.jsonl` into `out_dir`; returns their paths."""
    sft, dpo = generate_data(seed)
    sets = {"sft": (sft, "sft.jsonl"), "dpo": (dpo, "dpo.jsonl"), "rm": (generate_rm(dpo), "rm.jsonl")}
    return write_sets(out_dir, sets)


# ----------------------------------------------------------------------- tokenizer


def _texts(data_dir: Path) -> Iterator[str]:
    for name, keys in (("sft.jsonl", ("prompt", "response")), ("dpo.jsonl", ("prompt", "chosen", "rejected"))):
        with open(data_dir / name, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                for k in keys:
                    yield row[k]


def train_tokenizer(data_dir: str | os.PathLike, model_max_length: int = 128):
    """A byte-level BPE tokenizer trained on the bundled data, as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits first: each digit becomes its own pre-token, so BPE can never merge "37" or " 3"
    # (the same choice as LLaMA's and Qwen's tokenizers, which split numbers into digits).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknowns
        show_progress=False,
    )
    tok.train_from_iterator(_texts(Path(data_dir)), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# --------------------------------------------------------------------------- model


def load_model_config(config_json: str | os.PathLike) -> dict:
    """The model JSON without its `_comment`-style keys."""
    with open(config_json, encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def build_demo_model(
    config_json: str | os.PathLike,
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    seed: int = 0,
) -> Path:
    """Train the tokenizer, build the randomly initialised model, save both as a HF directory.

    The directory loads with `AutoModelForCausalLM.from_pretrained(out_dir)` and
    `AutoTokenizer.from_pretrained(out_dir)`. Same inputs and seed give the same bytes. It is
    written to a temporary sibling and renamed at the end, so `out_dir` is never half-written.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(data_dir)
    cfg = load_model_config(config_json)
    model_type = str(cfg.pop("model_type", "llama"))
    cfg.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.model_max_length = cfg.get("max_position_embeddings", tokenizer.model_max_length)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except Exception as exc:  # noqa: BLE001 - the config class's validation names the field
        raise ValueError(f"{config_json}: transformers cannot read it as model_type {model_type!r}: {exc}") from None

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # init happens on the CPU: fork only the CPU generator, leave the caller's RNG untouched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _normalize_modes(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _normalize_modes(directory: Path) -> None:
    """mkdtemp makes 0700 and some writers 0600: give the usual umask-derived modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~umask)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memfit.workflow.demo", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_data = sub.add_parser("data", help="regenerate the bundled SFT, DPO and reward-model arithmetic data")
    p_data.add_argument("--out", default="data/demo", help="output directory (default data/demo)")
    p_data.add_argument("--seed", type=int, default=DATA_SEED)
    p_model = sub.add_parser("model", help="train the tokenizer and build the tiny model")
    p_model.add_argument("--config", default="config/models/demo-tiny.json")
    p_model.add_argument("--data", default="data/demo")
    p_model.add_argument("--out", default="resources/demo-tiny")
    p_model.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "data":
        for path in write_data(args.out, args.seed).values():
            print(path)
    else:
        out = build_demo_model(args.config, args.data, args.out, args.seed)
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
