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
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=1, use_cpu=True, report_to=[], save_strategy="no",
        remove_unused_columns=False, logging_steps=1,
    )  # fmt: skip
    trainer = BalancedTrainer(
        model=transformers.LlamaForCausalLM(_config()), args=args, train_dataset=_data(),
        data_collator=_collate, sample_costs=LENGTHS.astype(float) ** 1.5,
    )  # fmt: skip
    expected = list(trainer.balanced_sampler())  # 4 steps x 2 microbatches of 8 samples
    batches = list(trainer.get_train_dataloader())
    assert [b["input_ids"].shape[0] for b in batches] == [len(mb) for mb in expected]
    assert len({len(mb) for mb in expected}) > 1  # sizes follow the costs, not a fixed count
    assert sorted(i for mb in expected for i in mb) == list(range(len(LENGTHS)))
    result = trainer.train()
    assert result.global_step == 4 and np.isfinite(result.training_loss)


def _config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip


def _ddp_trainer_step(rank: int, world_size: int) -> dict:
    """One optimizer step of BalancedTrainer on 2 gloo ranks (DDP via accelerate): SGD with
    lr 1 and nothing else, so that the update is the step's gradient."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(
        output_dir=f"/tmp/dflop-test-dp-hf-{rank}", per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", remove_unused_columns=False, optim="sgd", learning_rate=1.0,
        weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0,
        ddp_backend="gloo", disable_tqdm=True,
    )  # fmt: skip
    trainer = BalancedTrainer(
        model=model, args=args, train_dataset=_data(), data_collator=_collate,
        sample_costs=LENGTHS.astype(float) ** 1.5,
    )  # fmt: skip
    step = trainer.balanced_sampler().plan_step(0, 0)
    trainer.train()
    return {
        "world_size": args.world_size,
        "indices": step.indices.tolist(),
        "grads": {n: (before[n] - p.detach()).numpy() for n, p in trainer.model.named_parameters()},
    }


@pytest.mark.integration
def test_two_rank_trainer_step_has_the_global_mean_gradient():
    """Under 2 real ranks each rank trains its balanced share (microbatches of varying
    size); the Trainer's normalisation by the step's tokens over all ranks then gives the
    gradient of the global batch's mean token loss, as one process computes it."""
    from dflop.runtime import spawn_local

    results = spawn_local(_ddp_trainer_step, 2, timeout_s=300.0, num_threads=1)
    assert [r["world_size"] for r in results] == [2, 2]
    assert results[0]["indices"] == results[1]["indices"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    data = _data()
    batch = _collate([data[i] for i in results[0]["indices"]])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    loss = (
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        / (labels != -100).sum()
    )
    loss.backward()
    for name, param in model.named_parameters():
        want = param.grad.numpy()
        for r in results:
            # The update (before - after, float32) carries the gradient to about 1e-4 of the
            # largest entry; a wrong normalisation would be off by tens of percent.
            np.testing.assert_allclose(r["grads"][name], want, atol=2e-3 * np.abs(want).max())


def _fsdp_trainer_on_cpu(rank: int, world_size: int) -> None:
    args = transformers.TrainingArguments(
        output_dir=f"/tmp/dflop-test-dp-hf-fsdp-{rank}", per_device_train_batch_size=4,
        use_cpu=True, report_to=[], ddp_backend="gloo", disable_tqdm=True, fsdp=True,
        fsdp_config={"version": 2},
    )  # fmt: skip
    BalancedTrainer(
        model=transformers.LlamaForCausalLM(_config()), args=args, train_dataset=_data(),
        data_collator=_collate, sample_costs=LENGTHS.astype(float),
    )  # fmt: skip


@pytest.mark.integration
def test_fsdp_requested_on_cpu_is_refused_not_silently_ddp():
    """accelerate would train full DDP replicas instead of FSDP on CPU without a word."""
    from dflop.runtime import SpawnError, spawn_local

    with pytest.raises(SpawnError, match="fsdp is set but accelerate runs without FSDP"):
        spawn_local(_fsdp_trainer_on_cpu, 2, timeout_s=120.0, num_threads=1)
