"""Chat rows as users have them: `messages` ({role, content}), ShareGPT `conversations`
({from, value}; human/gpt/system), TRL's conversational preference pairs (explicit `prompt` or
implicit, shared-prefix `chosen`/`rejected`), all reduced to {role, content} turns and rendered
with the tokenizer's chat template; `DataError` names the file, the row and the key.

Formats and their sources
  - `messages` / role-content turns: TRL's conversational format (trl.data_utils.is_conversational)
    and OpenAI's chat format.
  - ShareGPT `conversations` with `from`/`value` and roles human, gpt, system: LLaMA-Factory's
    sharegpt format (data/README.md; its defaults role_tag "from", content_tag "value",
    user_tag "human", assistant_tag "gpt", system_tag "system") and TRL's
    maybe_convert_to_chatml. Either turn shape is read under either key.
  - Preference pairs: TRL's conversational preference format, `prompt` a message list and
    `chosen`/`rejected` the assistant turn, or implicit (no prompt; chosen and rejected full
    conversations whose shared prefix is the prompt: trl.data_utils.extract_prompt). A string
    `prompt` beside full conversations (HuggingFaceH4/ultrafeedback_binarized) is ignored;
    beside assistant-only lists it is the user turn. LLaMA-Factory's ranking rows
    (`conversations` + `chosen`/`rejected` single turns) are read too.
"""

from __future__ import annotations

import os
from typing import Any

from memfit.data.schema import DataError
from memfit.data.sources import NEEDS, Source, string_field, type_name

# ShareGPT role names (LLaMA-Factory's user_tag/assistant_tag/system_tag defaults) and OpenAI's.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
ASSISTANT_LOSS = ("all", "last")
CHAT_KEYS = ("messages", "conversations")


def _bad(src: Source, row: int, problem: str, key: str) -> DataError:
    return DataError(src.path, problem, row, key, src.unit)


def turns(src: Source, row: int, value: Any, key: str) -> list[dict]:
    """`value` as {role, content} turns; each turn {role, content} or ShareGPT's {from, value}."""
    if isinstance(value, dict):  # LLaMA-Factory ranking rows: chosen/rejected one turn each
        value = [value]
    if not isinstance(value, list):
        raise _bad(src, row, f"expected a list of {{role, content}} turns, got {type_name(value)}", key)
    if not value:
        raise _bad(src, row, "an empty conversation (no turns)", key)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(src, row, f"expected an object {{role, content}}, got {type_name(m)}", f"{key}[{i}]")
        # Arrow struct columns give every turn every field, the absent ones null
        sharegpt = m.get("from") is not None and m.get("role") is None
        role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
        for k in (role_key, content_key):
            if k not in m:
                raise _bad(
                    src,
                    row,
                    f"missing (a turn needs 'role' and 'content', or ShareGPT's 'from' and 'value'; it has keys {sorted(m)})",
                    f"{key}[{i}].{k}",
                )
            if not isinstance(m[k], str):
                raise _bad(src, row, f"expected a string, got {type_name(m[k])}", f"{key}[{i}].{k}")
        role = ROLES.get(m[role_key])
        if role is None:
            raise _bad(
                src, row, f"unknown role {m[role_key]!r}; roles are {', '.join(ROLES)}", f"{key}[{i}].{role_key}"
            )
        out.append({"role": role, "content": m[content_key]})
    return out


# -------------------------------------------------------------------------------- SFT


def sft_messages(src: Source, row: int, record: dict) -> tuple[list[dict], str]:
    """(turns, key) of one SFT row: `messages` wins over `conversations` over prompt/response
    (ultrachat-style rows carry a redundant `prompt`); the last turn is the assistant's."""
    # a null is an absent key: a Parquet column of rows that mix shapes holds nulls for the others
    key = next((k for k in CHAT_KEYS if record.get(k) is not None), None)
    if key is None:
        prompt = string_field(src, row, record, "prompt", "sft", non_empty=True)
        response = string_field(src, row, record, "response", "sft")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], "response"
    messages = turns(src, row, record[key], key)
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise _bad(src, row, f"no assistant turn (roles {roles}): nothing to train on", key)
    last = len(messages) - 1
    if roles[last] != "assistant":
        raise _bad(
            src,
            row,
            f"the last turn must be the assistant's (it gets the loss), got {roles[last]!r}",
            f"{key}[{last}].role",
        )
    if not any(m["content"].strip() for m in messages[:last]):
        raise _bad(src, row, "empty prompt: every turn before the last is empty", key)
    return messages, key


class Renderer:
    """The tokenizer's chat template, with a template's own refusal (raise_exception: roles not
    alternating, a misplaced system turn) reported as the row's `DataError`."""

    def __init__(self, tok, tokenizer_dir: str | os.PathLike) -> None:
        self.tok, self.where = tok, str(tokenizer_dir)

    def __call__(self, src: Source, row: int, key: str, messages: list[dict], generation: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception as e:  # jinja2 TemplateError, transformers' ValueError: the template's words
            raise _bad(
                src, row, f"the chat template of the tokenizer at {self.where} refused this conversation ({e})", key
            ) from None


def sft_prefix(
    render: Renderer, src: Source, row: int, key: str, messages: list[dict], loss: str
) -> list[tuple[str, bool]]:
    """The text before the final assistant turn (the rendered prompt, generation prompt
    included) as (text, has_loss) segments: one unscored segment, or with loss "all" each
    earlier assistant turn as the template renders it (content and its end-of-turn marker)
    between the unscored rest. Placing turn j needs the template to render messages[:j] (with
    the generation prompt) as a prefix of messages[:j+1], itself a prefix of the whole."""
    last = len(messages) - 1
    prompt = render(src, row, key, messages[:last], True)
    earlier = [j for j in range(last) if messages[j]["role"] == "assistant"]
    if loss == "last" or not earlier:
        return [(prompt, False)]
    segments, pos = [], 0
    for j in earlier:
        if j == 0:
            raise _bad(
                src,
                row,
                "the conversation opens with an assistant turn: with data.assistant_loss all, a user or system turn must come first",
                f"{key}[0].role",
            )
        before = render(src, row, key, messages[:j], True)
        after = render(src, row, key, messages[: j + 1], False)
        if not (after.startswith(before) and prompt.startswith(after) and len(before) >= pos):
            raise _bad(
                src,
                row,
                f"the chat template of the tokenizer at {render.where} renders turn {j} differently once later turns "
                "follow (it rewrites earlier turns, as templates that drop past reasoning do), so the loss of each "
                "assistant turn cannot be placed; set data.assistant_loss: last",
                f"{key}[{j}]",
            )
        segments += [(prompt[pos : len(before)], False), (prompt[len(before) : len(after)], True)]
        pos = len(after)
    segments.append((prompt[pos:], False))
    return [(text, scored) for text, scored in segments if text]


# -------------------------------------------------------------------------------- DPO


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, dict))


def dpo_pair(src: Source, row: int, record: dict) -> tuple[list[dict], str, str, str]:
    """(prompt turns, chosen, rejected, key of the prompt) of one DPO row, string or conversational."""
    chat = [k for k in ("prompt", "chosen", "rejected") if _is_chat(record.get(k))]
    if not chat:
        prompt = string_field(src, row, record, "prompt", "dpo", non_empty=True)
        chosen = string_field(src, row, record, "chosen", "dpo")
        rejected = string_field(src, row, record, "rejected", "dpo")
        return [{"role": "user", "content": prompt}], chosen, rejected, "prompt"
    for k in ("chosen", "rejected"):
        if record.get(k) is None:
            raise _bad(src, row, f"missing ({NEEDS['dpo']}; the row has keys {sorted(record)})", k)
    as_chat = _is_chat(record["chosen"])
    if as_chat != _is_chat(record["rejected"]):  # rejected is judged against chosen
        kind = "a list of turns" if as_chat else "a string"
        raise _bad(src, row, f"expected {kind}, as 'chosen' is, got {type_name(record['rejected'])}", "rejected")
    if not as_chat:
        raise _bad(src, row, f"expected a list of turns, as 'prompt' is, got {type_name(record['chosen'])}", "chosen")
    chosen, rejected = turns(src, row, record["chosen"], "chosen"), turns(src, row, record["rejected"], "rejected")
    p = record.get("prompt")
    if _is_chat(p):
        prompt, pkey = turns(src, row, p, "prompt"), "prompt"
    elif record.get("conversations") is not None:
        prompt, pkey = turns(src, row, record["conversations"], "conversations"), "conversations"
    elif isinstance(p, str) and chosen[0]["role"] == "assistant":
        prompt, pkey = [{"role": "user", "content": p}], "prompt"
    elif p is not None and not isinstance(p, str):
        raise _bad(src, row, f"expected a list of turns or a string, got {type_name(p)}", "prompt")
    else:  # implicit prompt: the shared prefix (trl.data_utils.extract_prompt)
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if chosen == rejected:  # an identical pair: dropped later, as a string pair is
            n -= 1
        prompt, pkey = chosen[:n], "chosen"
        if n < len(chosen) and n < len(rejected) and chosen[n]["role"] != "assistant":
            raise _bad(
                src,
                row,
                f"chosen and rejected differ at turn {n}, a {chosen[n]['role']!r} turn: they answer different "
                "prompts (a pair must share every turn before its final assistant turn)",
                f"chosen[{n}]",
            )
        if not prompt:
            raise _bad(
                src,
                row,
                "no prompt: chosen and rejected share no turn before the answer, and the row has no 'prompt' list",
                "chosen",
            )
    if pkey != "chosen":  # an explicit prompt: full conversations that repeat it are cut to the answer
        chosen = chosen[len(prompt) :] if chosen[: len(prompt)] == prompt and len(chosen) > len(prompt) else chosen
        rejected = (
            rejected[len(prompt) :] if rejected[: len(prompt)] == prompt and len(rejected) > len(prompt) else rejected
        )
    else:
        chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]
    if not any(m["content"].strip() for m in prompt):
        raise _bad(src, row, "empty prompt: every prompt turn is empty", pkey)
    if prompt[-1]["role"] == "assistant":
        raise _bad(
            src,
            row,
            "the prompt ends with an assistant turn; it must end with the user's (or system) turn that chosen and rejected answer",
            f"{pkey}[{len(prompt) - 1}].role",
        )
    answers = []
    for k, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer:
            raise _bad(src, row, "no assistant turn after the shared prompt", k)
        if len(answer) > 1 or answer[0]["role"] != "assistant":
            roles = [m["role"] for m in answer]
            raise _bad(
                src,
                row,
                f"expected one assistant turn answering the prompt, got turns {roles} after it "
                "(a full conversation that does not start with the row's prompt answers a different prompt)",
                k,
            )
        answers.append(answer[0]["content"])
    return prompt, answers[0], answers[1], pkey
