"""memfit's per-sequence sdpa for padding-free rows (memfit.train.varlen_attention, docs/speed.md):
each sequence of the one row attends over itself only, computed in a padded block of
[sequences, longest] with no mask, never over the row's T x T square; a padded batch on the same
model still runs transformers' own masked sdpa; a row whose sequences are not named is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from memfit.space import Candidate
from memfit.train import varlen_attention
from memfit.train.batches import padding_free_batch
from memfit.train.modeling import attn_implementation

SMALL = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "use_cache": False,
}
LENGTHS = [7, 3, 12, 5]


def _model(config, attn: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32)


def _row(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]
    ids = torch.tensor([[t for s in seqs for t in s]])
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    return seqs, ids, positions


@pytest.mark.parametrize(
    "config",
    [LlamaConfig(**SMALL), MistralConfig(**SMALL, sliding_window=4)],
    ids=["llama", "mistral-sliding-window-4"],
)
def test_each_sequence_of_the_row_computes_what_it_computes_alone(config):
    """The row's logits and its gradients equal each sequence's own forward under transformers'
    sdpa (fp32, 1e-5); with Mistral's sliding window of 4 tokens, shorter than three of the
    sequences, the window applies within each sequence."""
    varlen_attention.register()
    stock, ours = _model(config, "sdpa"), _model(config, varlen_attention.NAME)
    seqs, ids, positions = _row(LENGTHS)
    alone = torch.cat([stock(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    row = ours(input_ids=ids, position_ids=positions, **varlen_attention.seq_lens_kwargs(positions)).logits[0]
    torch.testing.assert_close(row, alone, rtol=1e-5, atol=1e-5)
    alone.square().mean().backward()
    row.square().mean().backward()
    for (name, a), (_, b) in zip(stock.named_parameters(), ours.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_attention_runs_on_the_sequences_blocks_without_a_mask(monkeypatch):
    """SDPA sees [sequences, heads, longest, head_dim] under its causal kernel with its own GQA and no
    mask: the sequences of 7, 3, 12 and 5 tokens as a block of the 12 and one of the other three
    padded to 7 (1 x 144 + 3 x 49 score positions, against 4 x 144 in one block), never the row's
    27 x 27 square."""
    varlen_attention.register()
    model = _model(LlamaConfig(**SMALL), varlen_attention.NAME)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), attn_mask, is_causal, kw.get("enable_gqa")))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    _, ids, positions = _row(LENGTHS)
    model(input_ids=ids, position_ids=positions, **varlen_attention.seq_lens_kwargs(positions))
    layer = [((1, 4, 12, 16), (1, 2, 12, 16), None, True, True), ((3, 4, 7, 16), (3, 2, 7, 16), None, True, True)]
    assert calls == layer * 2


def test_one_long_sequence_gets_a_block_of_its_own():
    """Sequences of similar lengths share one block; one long sequence among short ones (heavy-tailed
    lengths) gets its own, when that saves a quarter of the single block's S x M^2."""
    assert varlen_attention.split_blocks([20, 18, 19, 17]) == [[0, 2, 1, 3]]
    assert varlen_attention.split_blocks([30, 400, 25, 41, 28]) == [[1], [3, 0, 4, 2]]
    assert varlen_attention.split_blocks([5]) == [[0]]


def test_a_padded_batch_on_the_same_model_runs_transformers_masked_sdpa():
    """A batch with a 2-D attention mask (padded rows) gets transformers' own mask and attention:
    the same logits as the stock sdpa model, where the rows are real."""
    varlen_attention.register()
    config = LlamaConfig(**SMALL)
    stock, ours = _model(config, "sdpa"), _model(config, varlen_attention.NAME)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    real = mask.bool()
    torch.testing.assert_close(
        ours(input_ids=ids, attention_mask=mask).logits[real], stock(input_ids=ids, attention_mask=mask).logits[real]
    )


def test_a_row_of_sequences_without_their_lengths_is_refused():
    """Restarting position ids without cu_seq_lens would attend across the sequences: refused, naming
    what is missing, rather than trained on silently."""
    varlen_attention.register()
    model = _model(LlamaConfig(**SMALL), varlen_attention.NAME)
    _, ids, positions = _row(LENGTHS)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        model(input_ids=ids, position_ids=positions)


def test_sequence_lengths_from_the_position_ids():
    kw = varlen_attention.seq_lens_kwargs(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]]))
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 8] and kw["max_length_q"] == 3
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["max_length_k"] == 3
    # lengths 3, 2, 3 in one block of 3 x 3 slots, longest first; the short one's last slot reads token 0
    (block,), slot_of = kw["memfit_blocks"]
    reads, seqs, longest = block
    assert (seqs, longest) == (3, 3) and reads.tolist() == [0, 1, 2, 5, 6, 7, 3, 4, 0]
    assert slot_of.tolist() == [0, 1, 2, 6, 7, 3, 4, 5]
    with pytest.raises(ValueError, match="start every sequence at 0"):
        varlen_attention.seq_lens_kwargs(torch.tensor([[1, 2, 0, 1]]))


def test_a_probe_pads_with_sequences_no_longer_than_its_rows():
    """A probe pads the padding-free row to rows x seq_len tokens; the padding forms sequences no
    longer than the longest row, so the per-sequence block is the rows' own block (4 x 12) plus the
    padding and at most one row more: at least training's worst case (4 rows of seq_len, 128 slots),
    not (rows + 1) x the padding's 101 tokens."""
    rows = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in LENGTHS]
    batch = padding_free_batch(rows, 0, pad_to=4 * 32)
    kw = varlen_attention.seq_lens_kwargs(batch["position_ids"])
    lengths = kw["cu_seq_lens_q"].diff().tolist()
    assert lengths[:4] == LENGTHS and sum(lengths) == 128 and kw["max_length_q"] == max(LENGTHS)
    padding, longest = 128 - sum(LENGTHS), max(LENGTHS)
    assert 128 <= len(lengths) * longest <= 4 * longest + padding + longest


def test_padding_free_under_sdpa_loads_the_per_sequence_attention():
    """The trainer's choice (memfit.train.modeling.attn_implementation): padding_free sdpa runs
    memfit's per-sequence sdpa; padded sdpa, eager and flash keep transformers' own."""
    assert attn_implementation(Candidate(attn="sdpa", padding_free=True)) == varlen_attention.NAME
    assert attn_implementation(Candidate(attn="sdpa")) == "sdpa"
    assert attn_implementation(Candidate(attn="eager", padding_free=True)) == "eager"
    assert attn_implementation(Candidate(attn="flash", padding_free=True)) == "flash_attention_2"
