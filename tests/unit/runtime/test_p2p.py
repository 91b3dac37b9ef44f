"""The point-to-point helpers the pipeline engine and the bridge communicator share
(their debug-header paths run end to end in test_pipeline.py and test_communicator.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dflop.runtime import p2p  # noqa: E402


def test_tags_are_distinct_per_microbatch_direction_and_header():
    tags = {
        p2p.message_tag(mb, direction, header)
        for mb in range(50)
        for direction in (p2p.FORWARD, p2p.BACKWARD)
        for header in (False, True)
    }
    assert len(tags) == 50 * 2 * 2 and min(tags) == 0


def test_header_round_trip_mismatch_and_payload_size():
    sent = p2p.debug_header(3, p2p.BACKWARD, (5, 8), torch.bfloat16)
    assert sent.shape == (p2p.HEADER_LEN,) and sent.dtype == torch.int64
    same = p2p.debug_header(3, p2p.BACKWARD, (5, 8), torch.bfloat16)
    assert p2p.header_mismatch(sent, same) is None
    assert p2p.header_payload_bytes(sent) == 5 * 8 * 2
    expected = p2p.debug_header(4, p2p.BACKWARD, (5, 2, 4), torch.float32)
    assert p2p.header_mismatch(sent, expected) == (
        "microbatch: sent 3, expected 4, dtype: sent 3, expected 1, "
        "shape: sent (5, 8), expected (5, 2, 4)"
    )
    assert p2p.header_payload_bytes(torch.zeros(p2p.HEADER_LEN, dtype=torch.int64)) == 0
    with pytest.raises(ValueError, match="at most 4 dims"):
        p2p.debug_header(0, p2p.FORWARD, (1, 1, 1, 1, 1), torch.float32)
