"""One length policy for every sample, applied by the data profiler and the runtime alike.

A model has a longest sequence it takes (its position limit, or what memory allows);
LLaVA's ``model_max_length`` cuts longer conversations. dflop does what LLaVA does, with
one difference: visual tokens are never cut (an image's or a video's tokens are all or
nothing). A sample of ``visual + text`` tokens over ``max_seq_len`` is, by
:attr:`LengthPolicy.too_long`:

* ``"truncate"`` (the default): its text is cut to ``max_seq_len - visual`` tokens, from
  the end (the runtime keeps every visual token and the first text tokens in order), so its
  target tokens are those left in the kept text (:meth:`TextTokenCounter.targets_in_prefix`
  counts them from the conversation's layout). A sample whose visual tokens alone exceed
  the limit cannot be cut: it is skipped and counted (reason ``too_long``);
* ``"skip"``: left out and counted (reason ``too_long``, with the file and index of the
  first ones in the report);
* ``"error"``: the run stops at the first one, naming its file, index and tokens.

The profile (:class:`~dflop.data.reader.RecordSet`) and the runtime's batches
(:func:`dflop.runtime.processed_batch.truncate_sample`) apply the same rule, so the planner
never sees a sample the runtime would run differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.data.shapes import SampleShapes

__all__ = ["TOO_LONG_CHOICES", "LengthPolicy", "TooLongError"]

TOO_LONG_CHOICES = ("truncate", "skip", "error")
"""What a sample over the length limit becomes (see the module docstring)."""


class TooLongError(ValueError):
    """A sample is over the length limit and the policy is ``"error"``."""


@dataclass(frozen=True)
class LengthPolicy:
    """The longest sample (``max_seq_len`` LLM tokens) and what a longer one becomes.

    Attributes:
        max_seq_len: tokens (visual + text) of the longest sample (>= 2).
        too_long: ``"truncate"``, ``"skip"`` or ``"error"`` (see the module docstring).
        why: what set the limit (``"the model's position limit"``, ``"--max-seq-len"``, ...),
            for messages.
    """

    max_seq_len: int
    too_long: str = "truncate"
    why: str = "max_seq_len"

    def __post_init__(self) -> None:
        if isinstance(self.max_seq_len, bool) or not isinstance(
            self.max_seq_len, (int, np.integer)
        ):
            raise ValueError(f"LengthPolicy.max_seq_len={self.max_seq_len!r} must be an int")
        if self.max_seq_len < 2:
            raise ValueError(f"LengthPolicy.max_seq_len={self.max_seq_len} must be >= 2")
        if self.too_long not in TOO_LONG_CHOICES:
            raise ValueError(
                f"LengthPolicy.too_long={self.too_long!r} must be one of {TOO_LONG_CHOICES}"
            )

    def outcome(self, shapes: SampleShapes) -> tuple[np.ndarray, np.ndarray]:
        """``(keep, cut)``: per sample whether it stays and whether its text is cut."""
        over = shapes.seq_len > self.max_seq_len
        if self.too_long == "truncate":
            cuttable = shapes.llm_visual_tokens < self.max_seq_len
            return ~over | cuttable, over & cuttable
        return ~over, np.zeros(len(shapes), dtype=bool)

    def describe(self, where: str, shapes: SampleShapes, i: int) -> str:
        """One line about sample ``i`` being over the limit, with the choices."""
        visual = int(shapes.llm_visual_tokens[i])
        return (
            f"{where}: {int(shapes.seq_len[i])} tokens ({visual} visual, "
            f"{int(shapes.text_tokens[i])} text) exceed max_seq_len={self.max_seq_len} "
            f"({self.why}); --too-long truncate cuts its text"
            + (
                " (not this one: its visual tokens alone exceed the limit)"
                if visual >= self.max_seq_len
                else ""
            )
            + ", skip leaves it out (counted), error stops here"
        )
