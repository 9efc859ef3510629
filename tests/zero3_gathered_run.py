"""Run under torchrun (2 ranks, DeepSpeed's CPU accelerator): the most parameter elements a ZeRO-3
rank holds gathered at any module's forward or backward, for a tiny Llama, with and without
gradient checkpointing. Compared with memfit's replay (`zero3.zero3_gathered_bytes`) by
tests/test_zero3_runtime.py. Writes a JSON {"gc": n, "nogc": n} to argv[1] on rank 0."""

import json
import os
import sys

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.train import dist
from memfit.train.dsconfig import bucket_sizes

H = 256
CONFIG = dict(vocab_size=321, hidden_size=H, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=128, tie_word_embeddings=True)  # fmt: skip


def peak_gathered(ckpt: bool) -> int:
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, **bucket_sizes(H, 3)},  # what memfit's trainer writes
        "zero_allow_untested_optimizer": True,
    }
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    params = list(model.parameters())
    seen = [0]
    counting = [False]

    def record(*_):
        if counting[0]:
            n = sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist)
            seen[0] = max(seen[0], n)

    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.register_forward_hook(record)
            m.register_full_backward_hook(record)
    x = torch.randint(0, CONFIG["vocab_size"], (4, 24))
    for step in range(3):
        counting[0] = step >= 1  # the trace is complete from the second step on
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return seen[0]


if __name__ == "__main__":
    dist.init_distributed()  # gloo on the CPU accelerator, as memfit's ranks start
    out = {"gc": peak_gathered(True), "nogc": peak_gathered(False)}
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    torch.distributed.barrier()  # every rank's work done, the measurement written
    # leave without tearing down the process group or running C++ destructors: a rank sometimes
    # aborted there after its work was done ("terminate called without an active exception",
    # SIGABRT: a thread destroyed unjoined; 2 of 3 clean-clone CI runs on 2026-11-26, also with
    # destroy_process_group before exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
