"""The shapes of one micro step every activation term reads (`MicroStep`: the sequences, their
length, the dtype, which linears train or are adapted, the MLP's tiles) and the decoder layer's
linears by role (`linear_names`); memfit.estimate.memory.activation_memory, trainer_terms,
held_logits and padding_mask count their bytes from it."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.estimate.memory.method_terms import grad_seqs
from memfit.estimate.models.arch import ModelArch
from memfit.estimate.models.params import lora_adapts_experts, lora_targets, param_layout
from memfit.estimate.settings import Settings, dtype_bytes
from memfit.space import Candidate


@dataclass(frozen=True)
class MicroStep:
    """Shapes of one micro step. t = tokens in the forward whose activations are kept
    (micro_batch * seq_len times the method's grad_sequences: doubled for the concatenated
    chosen+rejected batch of DPO, ORPO, SimPO and the reward model), d = compute dtype bytes."""

    arch: ModelArch
    dtype: int  # d
    seqs: int  # b: sequences in the forward
    seq_len: int  # s
    full: bool  # full fine-tuning: every weight (norms included) is trained
    targets: frozenset[str]  # adapted linears (LoRA/QLoRA)
    expert_adapters: bool = False  # LoRA on the routed experts and router (peft all-linear, MoE)
    # every nn.Linear saves its input, frozen ones too (ZeRO-3's patched F.linear: see
    # `zero3_linear_inputs`)
    linear_inputs_saved: bool = False
    # the tiled MLP (Candidate.tiled_mlp, memfit.train.long_context): its tiles (0: not tiled)
    mlp_tiles: int = 0
    # padding_free (Candidate.padding_free): the sequences concatenated into the one row of
    # `seq_len` tokens (seqs is 1 then); 0: padded rows
    packed_seqs: int = 0

    @property
    def tokens(self) -> int:
        return self.seqs * self.seq_len

    @property
    def tile_rows(self) -> int:
        """Rows of one MLP tile: the micro step's tokens over the tiles (0: not tiled)."""
        return -(-self.tokens // self.mlp_tiles) if self.mlp_tiles else 0

    def trainable(self, linear: str) -> bool:
        """Whether the linear's input is saved for the backward: its weight trains (full), it
        is adapted (LoRA's A saves it), or every linear saves its input (`linear_inputs_saved`)."""
        return self.full or self.linear_inputs_saved or linear in self.targets

    def rmsnorm(self, out_saved: bool, needs_grad: bool = True) -> int:
        """Saved by one RMSNorm: the fp32 input (pow() saves it; the input itself when d == 4),
        the normalised y (weight * y saves it when the weight is trained: full fine-tuning only),
        the output (saved by the next trained or adapted linear) and rsqrt."""
        d, t, h = self.dtype, self.tokens, self.arch.hidden_size
        if not needs_grad:  # input without grad (LoRA layer 0 sees the frozen embedding)
            return d * t * h if out_saved else 0
        normalised = d * t * h if self.full else 0
        out = d * t * h if out_saved else 0
        return 4 * t * h + normalised + out + 4 * t


def micro_step(arch: ModelArch, cand: Candidate, method: str, settings: Settings) -> MicroStep:
    """The micro step's shapes. padding_free: one row of every sequence's tokens, the probes'
    worst case of micro_batch x seq_len tokens (DPO: 2 x micro_batch sequences; memfit.train.batches
    `padding_free_batch`, `dpo_padding_free_batch`): the linears see the same tokens as the padded
    batch, the attention one sequence of all of them (its masks and eager's scores are row x row)."""
    full = cand.finetune == "full"
    seqs = grad_seqs(cand, method)
    packed = seqs if cand.padding_free else 0
    return MicroStep(
        arch=arch,
        dtype=dtype_bytes(cand.precision),
        seqs=1 if packed else seqs,
        seq_len=cand.seq_len * (packed or 1),
        packed_seqs=packed,
        full=full,
        targets=frozenset(n for n, _, _ in (lora_targets(arch, settings) if not full else ())),
        expert_adapters=not full and lora_adapts_experts(arch, settings, cand.finetune),
        mlp_tiles=mlp_tiles(arch, cand, settings) if cand.tiled_mlp else 0,
    )


def mlp_tiles(arch: ModelArch, cand: Candidate, settings: Settings) -> int:
    """Tiles of the tiled MLP: ceil(seq / tile_tokens) (memfit.train.long_context.tile_mlps;
    tile_tokens defaults to the hidden size, DeepSpeed's TiledMLP rule `ceil(seqlen / hidden)`)."""
    return -(-cand.seq_len // (settings.mlp_tile_tokens or arch.hidden_size))


def linear_names(arch: ModelArch) -> dict[str, set[str] | str]:
    """The decoder layer's linears by role (Llama/Qwen names, or GLM's fused ones)."""
    names = {n for n, _, _ in param_layout(arch).linear_shapes}
    return {
        "qkv": {"q_proj", "k_proj", "v_proj", "query_key_value"} & names,
        "o": "o_proj" if "o_proj" in names else "dense",
        "up": {"gate_proj", "up_proj", "gate_up_proj", "dense_h_to_4h"} & names,
        "down": "down_proj" if "down_proj" in names else "dense_4h_to_h",
    }
