"""The flags of `memfit estimate` and `memfit fit`, every default shown by `--help`.

The search levers (`SPACE_FLAGS`) take a comma-separated list (`--zero 0,2,3 --grad-ckpt on,off
--micro-batch 1,2,4`): one value prices one configuration, several make `memfit estimate` rank
the cross product (memfit.estimate.rank). Their defaults are filled by `cli_checks.fill_defaults`
once the other flags are known (ZeRO's depends on the GPUs), so the parser holds None for them.
"""

from __future__ import annotations

import argparse

from memfit.estimate.cli_settings_flags import add_budget_args, add_trace_args
from memfit.estimate.memory.method_terms import METHODS
from memfit.estimate.settings import DEFAULT_SETTINGS
from memfit.methods import KERNELS
from memfit.space import LOSS_IMPLS

_ON = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after every help text, except where the text already says its
    default in words (a default that depends on other flags)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)


def _listed(convert, choices=None):
    """An argparse type: a comma-separated list of values, each converted and checked."""

    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",")]
        if "" in items:
            raise argparse.ArgumentTypeError(f"{text!r}: an empty value in the list")
        out = []
        for item in items:
            try:
                value = convert(item)
            except (ValueError, KeyError):
                raise argparse.ArgumentTypeError(f"{item!r} is not a valid value") from None
            if choices is not None and value not in choices:
                allowed = ", ".join(str(c) for c in choices)
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {allowed}")
            out.append(value)
        return list(dict.fromkeys(out))

    return parse


class _Explain(argparse.Action):
    """--explain: print the glossary of the table's terms and exit 0, as --help does (no other
    flag needed)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from memfit.estimate.cli_render import explain

        print(explain())
        parser.exit(0)


def _on_off(text: str) -> bool:
    return _ON[text.lower()]


# flag dest -> Candidate field, for the levers that take a list (the ranked search space)
SPACE_FLAGS = {
    "zero": "zero",
    "grad_ckpt": "grad_ckpt",
    "micro_batch": "micro_batch",
    "seq_len": "seq_len",
    "finetune": "finetune",
    "attn": "attn",
    "loss_impl": "loss_impl",
    "precision": "precision",
    "offload_optimizer": "offload_optimizer",
    "offload_param": "offload_param",
    "sequence_parallel": "sequence_parallel",
    "padding_free": "padding_free",
    "compile": "compile",
    "kernels": "kernels",
}


def parser(prog: str, maximize: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=_Formatter,
        description=(
            "Largest seq_len or micro_batch that fits."
            if maximize
            else "Predict peak GPU memory, host memory and step time of one fine-tuning configuration; "
            "with comma-separated values for the search levers (--zero 0,2,3 --grad-ckpt on,off "
            "--micro-batch 1,2,4 ...), rank every combination, fastest fitting first."
        ),
    )
    if maximize:
        p.add_argument("--maximize", required=True, choices=["seq_len", "micro_batch"], help="what to maximize")
        p.add_argument(
            "--max-seq-len",
            type=int,
            default=None,
            help="seq_len: the longest length searched (default: the model's context, or with "
            "--allow-beyond-context as long as memory allows)",
        )
    else:
        p.add_argument(
            "--explain",
            action=_Explain,
            help="print what each line of the table means and which module computes it, then exit",
        )
    _add_job_args(p, maximize)
    _add_lever_args(p, maximize)
    add_budget_args(p)
    add_trace_args(p)
    return p


def given_flags(prog: str, maximize: bool, argv: list[str]) -> set[str]:
    """The dests the user gave on the command line (not defaults): the same parser with every
    default suppressed, so only given flags land in the namespace."""
    p = parser(prog, maximize)
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_known_args(argv)[0]))


def _add_job_args(p: argparse.ArgumentParser, maximize: bool) -> None:
    """What is trained where: model, GPUs, method, fine-tuning, shapes."""
    one = "" if maximize else "; a comma-separated list ranks each"
    p.add_argument("--model", required=True, help="catalog name, a HF config.json, or a model directory")
    p.add_argument("--gpu", required=True, help="GPU catalog name, or cpu")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs (ranks) per node")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes")
    p.add_argument(
        "--method",
        choices=list(METHODS),
        default="sft",
        help="training method: sft (one sequence a row); dpo (chosen + rejected and a reference); rm (a "
        "reward model: the pair, a one-output score head, no vocabulary logits); orpo, simpo (the pair, "
        "no reference); kto (one row with gradient, its KL completion without, and a reference)",
    )
    p.add_argument(
        "--finetune",
        type=_listed(str, ["full", "lora", "qlora"]),
        default=None,
        metavar="{full,lora,qlora}",
        help=f"what is trained (default: full{one})",
    )
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: 16)")
    p.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated linear names (default: every linear of the decoder layer)",
    )
    p.add_argument("--seq-len", type=_listed(int), default=None, help=f"tokens per sequence (default: 2048{one})")
    p.add_argument(
        "--micro-batch",
        type=_listed(int),
        default=None,
        help=f"sequences (DPO: pairs) per GPU per micro step (default: 1{one})",
    )
    p.add_argument("--grad-accum", type=int, default=None, help="micro steps per optimizer step (default: 1)")
    if not maximize:
        p.add_argument(
            "--global-batch",
            type=int,
            default=None,
            help="sequences (DPO: pairs) per optimizer step: each configuration's --grad-accum is the one that "
            "trains it (micro batch x data-parallel ranks x grad accum), as the workflow's train.global_batch, "
            "so ranked configurations train the same batch (default: none, --grad-accum as given)",
        )


def _add_lever_args(p: argparse.ArgumentParser, maximize: bool) -> None:
    """The search levers: compute (precision, checkpointing, attention, loss), memory (ZeRO,
    offload, sequence parallelism, tiling), the DPO reference and the advice switch."""
    one = "" if maximize else "; a comma-separated list ranks each"
    _add_compute_levers(p, one)
    _add_memory_levers(p, one)
    p.add_argument(
        "--ref",
        choices=["precomputed", "model", "adapter"],
        default=None,
        help="the reference of dpo and kto (default: model for full, adapter for LoRA)",
    )
    p.add_argument(
        "--advice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="when it does not fit (or fits with little room), try memfit's levers one at a time and "
        "print those that make it fit (default: on, off for a traced model, where each lever traces)",
    )


def _add_compute_levers(p: argparse.ArgumentParser, one: str) -> None:
    """Precision, gradient checkpointing, attention kernel, loss implementation."""
    p.add_argument(
        "--precision",
        type=_listed(str, ["bf16", "fp16", "fp32"]),
        default=None,
        metavar="{bf16,fp16,fp32}",
        help=f"weights and compute dtype (default: bf16{one})",
    )
    p.add_argument(
        "--grad-ckpt",
        nargs="?",
        const=[True],
        type=_listed(_on_off, [True, False]),
        default=None,
        metavar="on|off",
        help=f"gradient checkpointing per decoder layer (default: on{one}: on,off)",
    )
    p.add_argument(
        "--no-grad-ckpt", dest="grad_ckpt", action="store_const", const=[False], help="same as --grad-ckpt off"
    )
    p.add_argument(
        "--attn",
        type=_listed(str, ["flash", "sdpa", "eager"]),
        default=None,
        metavar="{flash,sdpa,eager}",
        help=f"attention kernel (default: flash{one})",
    )
    p.add_argument(
        "--loss-impl",
        type=_listed(str, list(LOSS_IMPLS)),
        default=None,
        metavar="{" + ",".join(LOSS_IMPLS) + "}",
        help=f"full: logits then fp32 log-softmax | chunked: per token chunk, recomputed in backward (default: full{one})",
    )
    p.add_argument(
        "--padding-free",
        nargs="?",
        const=[True],
        type=_listed(_on_off, [True, False]),
        default=None,
        metavar="on|off",
        help="each micro batch as one row of its sequences' tokens, no padding (not kto; default: "
        f"off{one}: on,off); its step time is priced on --row-tokens",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const=[True],
        type=_listed(_on_off, [True, False]),
        default=None,
        metavar="on|off",
        help=f"regional torch.compile of the decoder layers, priced as eager unless a calibration measured it (default: off{one}: on,off)",
    )
    p.add_argument(
        "--kernels",
        type=_listed(str, list(KERNELS)),
        default=None,
        metavar="{" + ",".join(KERNELS) + "}",
        help="liger: Liger-Kernel's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy (sft and dpo; a "
        f"CUDA GPU and the liger-kernel package where it trains; default: none{one}: none,liger)",
    )
    p.add_argument(
        "--row-tokens",
        type=float,
        default=None,
        help="--padding-free: the data's mean tokens per sequence, what its step computes (prepare_data's "
        "stats.json length.mean; default: --seq-len, the worst case)",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=None,
        help="chunked: tokens per chunk (default: 256 MiB of fp32 logits a chunk)",
    )


def _add_memory_levers(p: argparse.ArgumentParser, one: str) -> None:
    """ZeRO stage, offload, sequence parallelism, tiled MLP, activation offload."""
    p.add_argument(
        "--zero",
        type=_listed(int, [0, 1, 2, 3]),
        default=None,
        metavar="{0,1,2,3}",
        help="DeepSpeed ZeRO stage (default: 0 on one GPU of one node, where memfit's H100 probes "
        "measured ZeRO-3 1.9x slower than ZeRO-0 and partitioning saves nothing; 3 on several GPUs "
        f"or with --offload-param/--offload-optimizer cpu{one})",
    )
    p.add_argument(
        "--offload-optimizer",
        type=_listed(str, ["none", "cpu"]),
        default=None,
        metavar="{none,cpu}",
        help=f"optimizer states on the host (default: none{one})",
    )
    p.add_argument(
        "--offload-param",
        type=_listed(str, ["none", "cpu"]),
        default=None,
        metavar="{none,cpu}",
        help=f"ZeRO-3 parameters on the host (default: none{one})",
    )
    p.add_argument(
        "--pin-memory", action=argparse.BooleanOptionalAction, default=False, help="page-locked offload buffers"
    )
    p.add_argument("--offload-ratio", type=float, default=1.0, help="ZeRO-3: share of optimizer states offloaded")
    p.add_argument(
        "--sequence-parallel",
        type=_listed(int),
        default=None,
        help=f"Ulysses sequence parallelism: GPUs that split each sequence (DeepSpeed ALST) (default: 1{one})",
    )
    flag = argparse.BooleanOptionalAction
    p.add_argument("--tiled-mlp", action=flag, default=False, help="DeepSpeed ALST's TiledMLP: MLPs a tile at a time")
    p.add_argument(
        "--mlp-tile-tokens", type=int, help="tiled MLP: tokens per sequence in a tile (default: hidden size)"
    )
    p.add_argument("--activation-offload", action=flag, default=False, help="checkpointed layer inputs to host RAM")
    p.add_argument(
        "--sub-group-size",
        type=int,
        default=DEFAULT_SETTINGS.sub_group_size,
        help="ZeRO-3 optimizer sub-group size, elements",
    )
