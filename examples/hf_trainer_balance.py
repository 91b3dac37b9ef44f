"""The Hugging Face Trainer on dflop's balanced, padding-free microbatches (CPU is enough).

A tiny LLaVA-OneVision (built from a config: nothing is downloaded) trains on LLaVA-format
records with real image files (default: dflop's test records). Every optimizer step,
:class:`dflop.dp.hf.BalancedTrainer` gives each data-parallel rank a balanced share of the
step's samples as ``gradient_accumulation_steps`` microbatches, and
:class:`dflop.dp.PackingCollator` packs each microbatch into one sequence, so that a
microbatch costs what the balancer priced (no padding).

Run it on 2 CPU processes with either launcher:

    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer_balance.py
    torchrun --nproc-per-node 2 examples/hf_trainer_balance.py

(accelerate's ``--multi_gpu`` is its multi-process launcher; without GPUs the ranks run
on CPU with gloo) or in one process: ``python examples/hf_trainer_balance.py``. Needs
``pip install "dflop[hf]"`` and torch. The records used are the single-image and
text-only ones: LLaVA-OneVision takes several anyres images in one packed row, but
multi-image (tile) and video records need one batch row per sample (a padding collator).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile

import numpy as np
import torch
import transformers
from dflop.dp import PackingCollator
from dflop.dp.hf import BalancedTrainer
from dflop.models.hf import spec_from_config
from dflop.models.hf.tiny import tiny_llava_onevision_config
from dflop.profiling import CostModel
from dflop.runtime.processed_batch import ProcessedBatch
from dflop.train.planning import quick_profile

LLAVA_MINI = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "llava_mini")


class RecordDataset(torch.utils.data.Dataset):
    """LLaVA records as the model's inputs: token ids and labels (placeholder runs as long
    as the model's own rule makes them) and each image through its image processor."""

    def __init__(self, records: list[dict], inputs, image_folder: str) -> None:
        self.inputs, self.image_folder = inputs, image_folder
        # Shapes only (sizes from the file headers): what pricing the samples needs. A
        # record whose files do not read is skipped, with the reason.
        self.records, self.shapes, skipped = [], [], []
        for i, record in enumerate(records):
            try:
                shape = inputs.sample(
                    record, image_folder=image_folder, where=f"record {i}", lazy=True
                )
            except (OSError, ValueError) as error:
                skipped.append(str(error))
                continue
            self.records.append(record)
            self.shapes.append(shape)
        if skipped and int(os.environ.get("RANK", "0")) == 0:  # said once, not per rank
            print(f"skipped {len(skipped)} record(s) that do not read, e.g. {skipped[0]}")

    def _sample(self, index: int, lazy: bool):
        return self.inputs.sample(
            self.records[index], image_folder=self.image_folder, where=f"record {index}", lazy=lazy
        )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        return self.inputs.model_fields(self._sample(index, lazy=False))

    def costs(self, spec) -> np.ndarray:
        """Per sample, its training seconds on this machine: dflop's quick profile of the
        same model (encoder per unit, LLM per token) priced over the samples' shapes.
        Every rank must use the same numbers: rank 0 prices, the others receive them."""
        costs = [None]
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            shapes = ProcessedBatch(self.shapes, spec.tokens_per_unit).shapes
            costs[0] = CostModel(quick_profile(spec)).costs(shapes).sum(axis=1)
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(costs, src=0)
        return costs[0]


def single_image_or_text(record: dict) -> bool:
    image = record.get("image")
    return "video" not in record and (image is None or isinstance(image, str))


class AllParametersTrainer(BalancedTrainer):
    """A text-only microbatch leaves the vision tower out of the graph, and DDP reduces
    every parameter's gradient: a zero term keeps them all in (as LLaVA-style trainers do)
    instead of DDP's find_unused_parameters walk of the graph and its warning."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        zero = 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
        return (out[0] + zero, *out[1:]) if return_outputs else out + zero


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=os.path.join(LLAVA_MINI, "llava_mini.json"))
    p.add_argument("--image-folder", default=os.path.join(LLAVA_MINI, "images"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2, help="microbatches per rank per step")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args()

    config = tiny_llava_onevision_config()
    spec = spec_from_config(config)
    with open(args.data) as f:
        records = [r for r in json.load(f) if single_image_or_text(r)]
    dataset = RecordDataset(records, spec.dataset_inputs(), args.image_folder)

    torch.manual_seed(0)
    model = transformers.LlavaOnevisionForConditionalGeneration(config)
    cpu = not torch.cuda.is_available()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # by accelerate launch or torchrun
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="dflop-hf-trainer-"),
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.accumulation,
        num_train_epochs=args.epochs, learning_rate=3e-3, logging_steps=1, save_strategy="no",
        report_to=[], remove_unused_columns=False, use_cpu=cpu,
        ddp_backend="gloo" if cpu and launched else None, disable_tqdm=True, seed=0,
        ddp_find_unused_parameters=False,  # every parameter is in the graph: see below
    )  # fmt: skip
    trainer = AllParametersTrainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=PackingCollator(),
        sample_costs=dataset.costs(spec),
    )  # fmt: skip
    sampler = trainer.balanced_sampler()
    if training_args.process_index == 0:
        for step in range(sampler.steps_per_epoch()):
            info = sampler.plan_step(0, step)
            rank_costs = info.rank_costs.sum(axis=1)
            print(
                f"epoch 0 step {step}: {info.global_batch} samples over "
                f"{training_args.world_size} rank(s), rank seconds {np.round(rank_costs, 4).tolist()}"
                f" (max/mean {rank_costs.max() / rank_costs.mean():.3f})",
                flush=True,
            )
    result = trainer.train()
    if training_args.process_index == 0:
        print(f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}")
    if torch.distributed.is_initialized():  # both ranks leave together, the group closed
        # What holds the process group (DDP's reducer in the trainer's accelerator) goes
        # first, while every rank is still here: freed on main()'s return, after the
        # group was destroyed, a rank once hung in that teardown (1 run in ~100).
        del trainer, model
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
