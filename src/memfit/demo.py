"""The embedded CPU demo: a bundled arithmetic dataset, a tokenizer trained on it and a tiny Llama.

Nothing here downloads anything. Two commands regenerate every demo input:

    python -m memfit.demo data --out data/demo
    python -m memfit.demo model --config config/models/demo-tiny.json --data data/demo \
        --out resources/demo-tiny

Dataset (`data/demo/`, committed; regeneration is byte-for-byte identical, a test checks it):
  - `sft.jsonl`: 3000 rows `{"prompt": "What is 37 + 45?", "response": "82"}`.
  - `dpo.jsonl`: 3000 rows `{"prompt", "chosen", "rejected"}`: chosen is the right answer,
    rejected a plausible mistake (off by one, a dropped or spurious carry/borrow, swapped
    digits). Problems are unique within each file; the two files may share problems (DPO
    starts from the SFT model, as in a real SFT -> DPO pipeline).
  Operands are 0..49, operations + and - (never a negative result), so a ~3M-parameter model
  shows falling loss and a growing DPO margin within a couple of CPU minutes.

Tokenizer: byte-level BPE (any text encodes, no unknown tokens) with every digit a token of
its own (numbers are never merged, so arithmetic is learnable digit by digit), trained on the
bundled data; special tokens `<|pad|> <|bos|> <|eos|> <|system|> <|user|> <|assistant|>`
and a Jinja chat template where an assistant turn ends with EOS.

Model: `config/models/demo-tiny.json` is a HF LlamaConfig. Its `vocab_size`, `bos_token_id`,
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

DATA_SEED = 0  # the committed data/demo files are generated with this seed
N_SFT = 3000
N_DPO = 3000
MAX_OPERAND = 49

PROMPT_TEMPLATES = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?")

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


def _problem(rng: random.Random) -> tuple[int, str, int]:
    op = rng.choice("+-")
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    if op == "-" and b > a:
        a, b = b, a
    return a, op, b


def _unique_problems(rng: random.Random, n: int) -> list[tuple[int, str, int]]:
    seen: set[tuple[int, str, int]] = set()
    out = []
    while len(out) < n:
        p = _problem(rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _wrong_answer(rng: random.Random, a: int, op: str, b: int) -> int:
    """A mistake a learner makes: off by one, a carry/borrow error, or swapped digits."""
    right = _answer(a, op, b)
    kind = rng.choice(("off_by_one", "carry", "swap"))
    wrong = -1
    if kind == "carry":
        carried = (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)
        # forgot the carry (+) / borrow (-), or invented one that is not there
        if op == "+":
            wrong = right - 10 if carried else right + 10
        else:
            wrong = right + 10 if carried else right - 10
    elif kind == "swap" and right >= 10 and right % 10 != 0:  # 30 -> "03" is no mistake
        wrong = int(str(right)[::-1])
    if wrong < 0 or wrong == right:
        step = rng.choice((-1, 1))
        wrong = right + step if right + step >= 0 else right - step
    return wrong


def _prompt(rng: random.Random, a: int, op: str, b: int) -> str:
    return rng.choice(PROMPT_TEMPLATES).format(a=a, op=op, b=b)


def generate_data(seed: int = DATA_SEED) -> tuple[list[dict], list[dict]]:
    """The SFT and DPO rows, deterministic in `seed` (Python's `random`, stable across versions)."""
    rng = random.Random(seed)
    sft = [
        {"prompt": _prompt(rng, a, op, b), "response": str(_answer(a, op, b))}
        for a, op, b in _unique_problems(rng, N_SFT)
    ]
    dpo = []
    for a, op, b in _unique_problems(rng, N_DPO):
        prompt = _prompt(rng, a, op, b)
        dpo.append(
            {
                "prompt": prompt,
                "chosen": str(_answer(a, op, b)),
                "rejected": str(_wrong_answer(rng, a, op, b)),
            }
        )
    return sft, dpo


def _write_jsonl(rows: list[dict], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_data(out_dir: str | os.PathLike, seed: int = DATA_SEED) -> dict[str, Path]:
    """Write `sft.jsonl` and `dpo.jsonl` into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sft, dpo = generate_data(seed)
    paths = {"sft": out / "sft.jsonl", "dpo": out / "dpo.jsonl"}
    _write_jsonl(sft, paths["sft"])
    _write_jsonl(dpo, paths["dpo"])
    return paths


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
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(data_dir)
    cfg = load_model_config(config_json)
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{config_json}: model_type must be 'llama', got {cfg['model_type']!r}")
    cfg.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.model_max_length = cfg.get("max_position_embeddings", tokenizer.model_max_length)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # init happens on the CPU: fork only the CPU generator, leave the caller's RNG untouched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _normalize_modes(tmp)
        _replace_dir(tmp, out)
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


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`, replacing an older `dst` with two renames."""
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memfit.demo", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_data = sub.add_parser("data", help="regenerate the bundled SFT/DPO arithmetic data")
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
