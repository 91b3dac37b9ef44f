"""``dflop.train`` loads the trainer and the launcher on first use: its names resolve to
the modules' objects (``TrainReport`` from the torch-free metrics module, which the
launcher unpickles); a wrong one is an AttributeError."""

from __future__ import annotations

import dflop.train as train
import pytest


def test_the_lazy_names_resolve() -> None:
    from dflop.train import metrics, run

    assert train.TrainReport is metrics.TrainReport
    assert train.run_training is run.run_training and train.print_summary is run.print_summary
    pytest.importorskip("torch")
    from dflop.train import trainer

    assert train.Trainer is trainer.Trainer and trainer.TrainReport is metrics.TrainReport
    with pytest.raises(AttributeError, match="'dflop.train' has no attribute 'Nope'"):
        train.Nope  # noqa: B018
