"""The demo's multi-turn chat data (`data/demo/chat_sft.jsonl`, `data/demo/chat_dpo.jsonl`): the
number questions of `memfit.workflow.demo`, asked three in a row in one conversation, in the shapes
users bring from TRL, LLaMA-Factory and Axolotl.

- `chat_sft.jsonl`: N_CHAT_SFT rows `{"messages": [...]}`: an optional system turn, then three
  user/assistant exchanges; with `data.assistant_loss: all` (the default) every answer is scored.
- `chat_dpo.jsonl`: N_CHAT_DPO rows in TRL's conversational format with an explicit prompt:
  `{"prompt": [system?, user, assistant, user, assistant, user], "chosen": [assistant],
  "rejected": [assistant]}`: the earlier answers are right, chosen answers the last question,
  rejected is the learner's mistake of `demo._wrong_answer`.

The two files ask disjoint problems. Deterministic in CHAT_SEED (Python's `random`); regenerate
byte for byte with

    python -m memfit.workflow.demo_chat --out data/demo

(tests/test_demo_chat.py checks the shipped files are what this writes).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

from memfit.workflow.demo import TASK_SHARE, TASKS, Problem, _answer, _problems, _prompt, _wrong_answer, write_sets

CHAT_SEED = 0  # the committed chat files are generated with this seed
N_CHAT_SFT = 320  # conversations
N_CHAT_DPO = 192  # preference pairs
EXCHANGES = 3  # user/assistant exchanges per conversation (the demo model's 128 positions hold 3)
SYSTEM_PROMPTS = ("Answer with the number only.", "You are a careful counting tutor.")
SYSTEM_SHARE = 0.5  # conversations that open with a system turn


def _conversation(rng: random.Random, problems: list[Problem]) -> list[dict]:
    """A system turn (half of the time) and one exchange per problem, every answer right."""
    turns = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < SYSTEM_SHARE else []
    for p in problems:
        turns.append({"role": "user", "content": _prompt(rng, *p)})
        turns.append({"role": "assistant", "content": str(_answer(*p))})
    return turns


def generate_chat_data(seed: int = CHAT_SEED) -> tuple[list[dict], list[dict]]:
    """The chat SFT rows and conversational DPO pairs, deterministic in `seed`."""
    rng = random.Random(seed)
    sft_problems: list[Problem] = []
    dpo_problems: list[Problem] = []
    for task in TASKS:  # each task's share of the problems, as in demo.generate_data
        n_sft = N_CHAT_SFT * EXCHANGES * TASK_SHARE[task] // 8
        n_dpo = N_CHAT_DPO * EXCHANGES * TASK_SHARE[task] // 8
        problems = _problems(rng, task, n_sft + n_dpo)
        sft_problems += problems[:n_sft]
        dpo_problems += problems[n_sft:]
    rng.shuffle(sft_problems)
    rng.shuffle(dpo_problems)
    sft = [
        {"messages": _conversation(rng, sft_problems[i : i + EXCHANGES])}
        for i in range(0, N_CHAT_SFT * EXCHANGES, EXCHANGES)
    ]
    dpo = []
    for i in range(0, N_CHAT_DPO * EXCHANGES, EXCHANGES):
        problems = dpo_problems[i : i + EXCHANGES]
        turns = _conversation(rng, problems)
        last = problems[-1]
        dpo.append(
            {
                "prompt": turns[:-1],
                "chosen": [turns[-1]],
                "rejected": [{"role": "assistant", "content": str(_wrong_answer(rng, *last))}],
            }
        )
    return sft, dpo


def write_chat_data(out_dir: str | os.PathLike, seed: int = CHAT_SEED) -> dict[str, Path]:
    """Write `chat_sft.jsonl` and `chat_dpo.jsonl` into `out_dir`; returns their paths."""
    sft, dpo = generate_chat_data(seed)
    return write_sets(out_dir, {"sft": (sft, "chat_sft.jsonl"), "dpo": (dpo, "chat_dpo.jsonl")})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memfit.workflow.demo_chat", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/demo", help="output directory (default data/demo)")
    p.add_argument("--seed", type=int, default=CHAT_SEED)
    args = p.parse_args(argv)
    for path in write_chat_data(args.out, args.seed).values():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
