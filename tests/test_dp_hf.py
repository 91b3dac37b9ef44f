"""dflop.dp.hf.BalancedTrainer: the Hugging Face Trainer trains on dflop's balanced
microbatches (one process here; the sampler's multi-rank behaviour is tested in
test_dp_sampler.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dflop.dp.hf import BalancedTrainer  # noqa: E402

LENGTHS = np.random.default_rng(0).integers(4, 40, 32)


def _data():
    rng = np.random.default_rng(1)
    return [{"input_ids": rng.integers(1, 64, n).tolist()} for n in LENGTHS]


def _collate(items):
    width = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, : len(x["input_ids"])] = torch.tensor(x["input_ids"])
        mask[i, : len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_trainer_runs_dflops_microbatches(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=1, use_cpu=True, report_to=[], save_strategy="no",
        remove_unused_columns=False, logging_steps=1,
    )  # fmt: skip
    trainer = BalancedTrainer(
        model=transformers.LlamaForCausalLM(config), args=args, train_dataset=_data(),
        data_collator=_collate, sample_costs=LENGTHS.astype(float) ** 1.5,
    )  # fmt: skip
    expected = list(trainer.balanced_sampler())  # 4 steps x 2 microbatches of 8 samples
    batches = list(trainer.get_train_dataloader())
    assert [b["input_ids"].shape[0] for b in batches] == [len(mb) for mb in expected]
    assert len({len(mb) for mb in expected}) > 1  # sizes follow the costs, not a fixed count
    assert sorted(i for mb in expected for i in mb) == list(range(len(LENGTHS)))
    result = trainer.train()
    assert result.global_step == 4 and np.isfinite(result.training_loss)
