"""Measured microbatch times per module, as the calibration feeds them to the cost model."""

from __future__ import annotations

import numpy as np
import pytest
from dflop.train.metrics import RankRecord, measured_microbatch_times


def _record(module: str, dp_rank: int, stage: int, actions, encoder_forward_s=()) -> RankRecord:
    return RankRecord(
        rank=0,
        module=module,
        dp_rank=dp_rank,
        global_stage=stage,
        step_time_s=1.0,
        busy_s=sum(end - start for _, _, start, end in actions),
        actions=tuple(actions),
        encoder_forward_s=tuple(encoder_forward_s),
    )


def test_disaggregated_times_are_each_modules_own() -> None:
    records = [
        _record("encoder", 0, 0, [("forward", 0, 0.0, 1.0), ("backward", 0, 1.0, 3.0)]),
        _record("llm", 0, 1, [("forward", 0, 1.0, 2.0), ("backward", 0, 2.0, 5.0)]),
    ]
    encoder, llm, fraction = measured_microbatch_times(records, 1, 1, 1)
    assert encoder.tolist() == [[3.0]] and llm.tolist() == [[4.0]]
    assert fraction == pytest.approx({"encoder": 1 / 3, "llm": 1 / 4})


def test_a_colocated_first_stage_gives_its_encoder_share_to_the_encoder() -> None:
    """A colocated first stage's forward timed its encoder apart (0.6 s of 1.0 s); its
    backward ran both parts in one pass, so the encoder's backward is taken from the
    encoder's forward share (0.3): 0.6 / 0.3 = 2.0 s of encoder, the rest the LLM's."""
    records = [
        _record(
            "llm",
            1,
            0,
            [("forward", 0, 0.0, 1.0), ("backward", 0, 1.0, 4.0)],
            encoder_forward_s=[(0, 0.6)],
        ),
        _record("llm", 1, 1, [("forward", 0, 1.0, 1.5), ("backward", 0, 2.0, 3.0)]),
    ]
    encoder, llm, fraction = measured_microbatch_times(records, 1, 2, 2, encoder_forward_share=0.3)
    np.testing.assert_allclose(encoder, [[0.0, 2.0]])
    np.testing.assert_allclose(llm, [[0.0, 4.0 - 2.0 + 1.5]])
    assert fraction["encoder"] == pytest.approx(0.3)
    assert fraction["llm"] == pytest.approx((0.4 + 0.5) / 3.5)
    # An encoder backward estimate past the stage's whole backward (3.0 s) is capped there:
    # the LLM's layers never get a negative time.
    encoder, llm, _ = measured_microbatch_times(records, 1, 2, 2, encoder_forward_share=0.1)
    np.testing.assert_allclose(encoder, [[0.0, 0.6 + 3.0]])
    np.testing.assert_allclose(llm, [[0.0, 0.4 + 1.5]])
