"""Numerical parity of memfit's DPO (and SFT) losses with TRL 1.16, driven through TRL's own code.

What runs on each side, for one batch of demo preference pairs and one policy/reference pair:

* TRL: a real `trl.DPOTrainer` built from a tiny in-memory `datasets.Dataset` of the demo pairs in
  conversational form (prompt = user turn, chosen/rejected = assistant turn). TRL tokenizes it with the
  demo chat template (`_prepare_dataset`), collates it with its `DataCollatorForPreference`
  (chosen rows then rejected rows, right padding, `completion_mask`) and computes the loss with
  `DPOTrainer.compute_loss` (its fused LM head, its masking); metrics are read from `trainer._metrics`.
* memfit: `memfit.data.prepare("dpo", ...)` token ids, `StepRunner.loss` (memfit's `collate`,
  `sequence_logps`, `dpo_loss`) on the same model objects.

Tokenization: memfit renders the prompt with the chat template and appends EOS to each response; TRL
renders prompt+response with the same template (which ends the assistant turn with EOS). The test asserts
the two produce identical prompt/chosen/rejected ids for the pairs used, so the comparison covers
tokenization, collation, masking and the loss.

The policy is the demo model with small seeded noise added to its weights, so the log-ratios (and thus
rewards, margins, accuracies) are non-trivial; the reference is the unperturbed model.

Label smoothing is compared at 0 only: in TRL 1.16 `loss_type="sigmoid"` ignores `label_smoothing`
(it is used by `robust` and `exo_pair`), while memfit's sigmoid applies cDPO smoothing.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

N_PAIRS = 4
TOL = 1e-5
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@pytest.fixture(scope="module")
def pairs(mixed_dpo_pairs):
    """memfit's tokenized rows for four demo pairs of mixed lengths, and their records (conftest)."""
    return mixed_dpo_pairs


def _models(demo_model):
    from transformers import AutoModelForCausalLM

    kw = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    ref = AutoModelForCausalLM.from_pretrained(demo_model, **kw)
    policy = AutoModelForCausalLM.from_pretrained(demo_model, **kw)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return policy, ref


def _trl_trainer(demo_model, records, policy, ref, tmp_path, beta, loss_type):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(demo_model)
    ds = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in records
        ]
    )
    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        beta=beta,
        loss_type=[loss_type],
        per_device_train_batch_size=len(records),
        max_length=None,
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataset_num_proc=None,
        logging_strategy="no",
        save_strategy="no",
    )
    return DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds, processing_class=tok)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_trl(demo_model, pairs, tmp_path, beta):
    from memfit.train.steps import StepRunner

    rows, records = pairs
    policy, ref = _models(demo_model)
    for loss_type in ("sigmoid", "ipo", "hinge"):
        trainer = _trl_trainer(demo_model, records, policy, ref, tmp_path / loss_type, beta, loss_type)

        # Same token ids from TRL's own tokenization as from memfit.data.prepare.
        trl_rows = [
            {k: list(ex[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in trainer.train_dataset
        ]
        ours = [{k: list(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows]
        assert trl_rows == ours

        policy.train()
        batch = trainer.data_collator(trl_rows)
        trainer._metrics["train"].clear()
        with torch.no_grad():
            trl_loss = float(trainer.compute_loss(trainer.model, batch))
        trl_metrics = {k: trainer._metrics["train"][k][-1] for k in METRICS}

        runner = StepRunner(
            "dpo",
            policy,
            ref,
            pad_id=trainer.processing_class.pad_token_id,
            dpo={"beta": beta, "loss_type": loss_type, "label_smoothing": 0.0},
            ref="model",
        )
        with torch.no_grad():
            loss, sums, _ = runner.loss(rows)
        n = len(rows)
        assert float(loss) == pytest.approx(trl_loss, abs=TOL, rel=0), loss_type
        assert sums["loss"] / n == pytest.approx(trl_loss, abs=TOL, rel=0), loss_type
        for k in METRICS:
            assert sums[k] / n == pytest.approx(trl_metrics[k], abs=TOL, rel=0), (loss_type, k)
        # Non-trivial check: the policy differs from the reference.
        assert abs(trl_metrics["rewards/margins"]) > 1e-4


def test_sft_loss_matches_trl(demo_model, repo, tmp_path):
    """memfit's `sft_loss` on its collated batch == TRL's `SFTTrainer.compute_loss` (fused LM head).

    Both get memfit's pre-tokenized rows (input_ids, labels with -100 on the prompt); TRL keeps
    pre-tokenized datasets as is and pads labels with -100 in `DataCollatorForLanguageModeling`.
    """
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from memfit import data
    from memfit.train.batches import collate
    from memfit.train.losses import IGNORE_INDEX, sft_loss

    out = tmp_path / "sft"
    data.prepare("sft", repo / "data/demo/sft.jsonl", demo_model, out, max_len=32, eval_fraction=0.05)
    all_rows = data.load_split(out, "train")
    by_len: dict[int, dict] = {}
    for r in all_rows:
        by_len.setdefault(len(r["input_ids"]), r)
    rows = list(by_len.values())[:N_PAIRS]
    assert len({len(r["input_ids"]) for r in rows}) > 1  # padding is exercised
    assert all(IGNORE_INDEX in r["labels"] for r in rows)  # the prompt is masked

    policy, _ = _models(demo_model)
    tok = AutoTokenizer.from_pretrained(demo_model)
    ds = Dataset.from_list([{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in rows])
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        per_device_train_batch_size=len(rows),
        max_length=None,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_strategy="no",
        save_strategy="no",
    )
    trainer = SFTTrainer(model=policy, args=args, train_dataset=ds, processing_class=tok)
    policy.train()
    examples = [{k: list(ex[k]) for k in ("input_ids", "labels")} for ex in trainer.train_dataset]
    batch = trainer.data_collator(examples)
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model, batch))
        ours_batch = collate("sft", rows, tok.pad_token_id)
        logits = policy(input_ids=ours_batch["input_ids"], attention_mask=ours_batch["attention_mask"]).logits
        ours, n = sft_loss(logits, ours_batch["labels"])
    assert n == sum(sum(1 for y in r["labels"][1:] if y != IGNORE_INDEX) for r in rows)
    assert float(ours) == pytest.approx(trl_loss, abs=TOL, rel=0)
