"""A padding-free collator: a microbatch's samples packed into one sequence.

Why it matters for balancing: :class:`~dflop.dp.BalancedBatchSampler` prices a microbatch
as the sum of its samples' costs. A padded batch costs ``samples x longest`` instead, so a
microbatch that pairs one long sample with many short ones pays for padding the balancer
never saw. Packed, a microbatch's work is what the balancer priced.

The model must keep the packed samples apart. Hugging Face decoders do when they get
``position_ids`` that restart at every sample and no attention mask (transformers derives
the block-diagonal mask from the restarts for the sdpa and eager attentions, but only
without a KV cache: the batch says ``use_cache=False``; flash attention takes the sample
boundaries, ``flash_attention_kwargs=True``). Models whose
position ids are not one number per token (Qwen2-VL's 3-D rotary positions) are not
supported: use a padding collator for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dflop.errors import InputTypeError

__all__ = ["PackingCollator"]

_PACKER_KEYS = frozenset(
    {"position_ids", "use_cache", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
)
"""Fields the collator makes for the packed row."""
_PER_ROW_KEYS = frozenset({"batch_num_images", "pixel_values_videos", "video_grid_thw"})
"""Fields that describe a whole batch row (a sample's images or frames as one group)."""


class PackingCollator:
    """Packs samples (mappings of field -> values) into one row for a DataLoader's
    ``collate_fn`` or the Trainer's ``data_collator``.

    * ``sequence_keys`` (default ``input_ids`` and ``labels``): 1-D per sample, the same
      length within a sample; concatenated into ``(1, total_tokens)``. Each sample's first
      label becomes ``ignore_index``, so no sample is trained to predict the next one's
      first token.
    * ``position_ids`` ``(1, total_tokens)``: ``0 .. length - 1`` per sample.
    * every other tensor field (``pixel_values``, ``image_sizes``, ...): concatenated
      along dim 0 over the samples that have it, in sample order (the order of their
      placeholder tokens in the packed row); for ``pad_keys`` (default ``pixel_values``)
      trailing dims that differ between samples are zero-padded to the largest (as image
      processors pad anyres crops), for other fields they must agree.
    * refused, naming the sample: an ``attention_mask`` that masks tokens (an all-ones one
      is dropped: with a mask transformers would not keep the samples apart), any other
      field with one entry per token (list it in ``sequence_keys``), the fields the
      collator makes, and per-row fields (``batch_num_images``, ``pixel_values_videos``,
      ``video_grid_thw``: multi-image and video samples cannot share a row).
    * ``use_cache=False`` (with a cache, transformers would not see the restarts and the
      samples would attend to each other); ``use_cache_flag=False`` leaves it out for a
      model whose forward takes no such argument.
    * ``flash_attention_kwargs=True`` adds ``cu_seq_lens_q/k`` and ``max_length_q/k``.
    * no samples (a ``BalancedBatchSampler`` padding microbatch): a two-token row of
      zeros with one target, so the loss stays finite; its loss scale is 0.

    Args:
        sequence_keys: the per-token fields.
        label_key: the field whose first entry per sample is masked (None: none).
        ignore_index: the label the loss skips.
        use_cache_flag: add ``use_cache=False`` to the batch.
        flash_attention_kwargs: also return the flash-attention boundaries.
        pad_keys: fields whose trailing dims may differ between samples (zero-padded).
    """

    def __init__(
        self,
        sequence_keys: Sequence[str] = ("input_ids", "labels"),
        *,
        label_key: str | None = "labels",
        ignore_index: int = -100,
        use_cache_flag: bool = True,
        flash_attention_kwargs: bool = False,
        pad_keys: Sequence[str] = ("pixel_values",),
    ) -> None:
        self.sequence_keys = tuple(sequence_keys)
        if not self.sequence_keys or not all(isinstance(k, str) for k in self.sequence_keys):
            raise InputTypeError("sequence_keys must be a non-empty sequence of field names")
        if label_key is not None and label_key not in self.sequence_keys:
            raise ValueError(f"label_key={label_key!r} is not one of sequence_keys")
        self.label_key = label_key
        self.ignore_index = int(ignore_index)
        self.use_cache_flag = bool(use_cache_flag)
        self.flash_attention_kwargs = bool(flash_attention_kwargs)
        self.pad_keys = frozenset(pad_keys)

    def _check_field(self, i: int, key: str, value: Any, length: int) -> None:
        """A sample's field other than the sequence keys: refuse what packing would get
        wrong silently."""
        if key in _PACKER_KEYS:
            raise ValueError(
                f"sample {i} has a {key!r} field: the collator makes it for the packed row"
            )
        if key in _PER_ROW_KEYS:
            raise ValueError(
                f"sample {i} has a {key!r} field, which describes one batch row: such samples "
                "(multi-image, video) cannot share a packed row; use a padding collator"
            )
        if not isinstance(value, Tensor):
            raise InputTypeError(
                f"sample {i}: field {key!r} is a {type(value).__name__}; fields other than "
                f"{list(self.sequence_keys)} must be tensors (concatenated along dim 0)"
            )
        if key == "attention_mask":
            # A packed row has no padding; a mask would also stop transformers from
            # keeping the samples apart (it derives their boundaries only without one).
            if value.dim() != 1 or value.numel() != length or not bool(value.all()):
                raise ValueError(
                    f"sample {i}: its attention_mask masks tokens; a packed row holds only "
                    "real tokens (strip the padding first)"
                )
        elif value.dim() == 1 and value.numel() == length:
            raise ValueError(
                f"sample {i}: field {key!r} has one entry per token; list it in "
                "sequence_keys to pack it with the tokens, or drop it"
            )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not samples:
            # A padding microbatch (BalancedBatchSampler): a two-token row of zeros whose
            # one target keeps the loss finite; its loss scale is 0.
            return self([{key: torch.zeros(2, dtype=torch.long) for key in self.sequence_keys}])
        pieces: dict[str, list[Tensor]] = {k: [] for k in self.sequence_keys}
        others: dict[str, list[Tensor]] = {}
        lengths = []
        for i, sample in enumerate(samples):
            if not isinstance(sample, Mapping):
                raise InputTypeError(
                    f"sample {i}: expected a mapping of field -> values, got "
                    f"{type(sample).__name__}"
                )
            length = None
            for key in self.sequence_keys:
                if key not in sample:
                    raise ValueError(f"sample {i} has no {key!r} field")
                values = torch.as_tensor(sample[key])
                if values.dim() != 1 or (length is not None and values.numel() != length):
                    raise ValueError(
                        f"sample {i}: {key!r} must be 1-D with the length of "
                        f"{self.sequence_keys[0]!r} ({length}), got shape {tuple(values.shape)}"
                    )
                length = values.numel()
                pieces[key].append(values)
            if not length:
                raise ValueError(f"sample {i} is empty")
            lengths.append(length)
            if self.label_key is not None:
                labels = pieces[self.label_key][-1].clone()
                labels[0] = self.ignore_index
                pieces[self.label_key][-1] = labels
            for key, value in sample.items():
                if key not in pieces:
                    self._check_field(i, key, value, length)
                    if key != "attention_mask":
                        others.setdefault(key, []).append(value)
        batch: dict[str, Any] = {key: torch.cat(values)[None] for key, values in pieces.items()}
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
        for key, values in others.items():
            batch[key] = _concat(key, values, pad=key in self.pad_keys)
        if self.flash_attention_kwargs:
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
            batch.update(
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                max_length_k=max(lengths),
            )  # fmt: skip
        if self.use_cache_flag:
            batch["use_cache"] = False
        return batch


def _concat(key: str, values: list[Tensor], pad: bool) -> Tensor:
    """Concatenated along dim 0; with ``pad``, trailing dims zero-padded to the largest."""
    dims = {v.dim() for v in values}
    if len(dims) != 1 or 0 in dims:
        raise ValueError(
            f"field {key!r}: samples' tensors must have the same number of dims (>= 1), got "
            f"shapes {[tuple(v.shape) for v in values]}"
        )
    trailing = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    if not pad and any(list(v.shape[1:]) != trailing for v in values):
        shapes = [tuple(v.shape) for v in values]
        raise ValueError(
            f"field {key!r}: samples' tensors differ beyond dim 0 ({shapes}); only pad_keys "
            "are zero-padded (where the model knows each one's true size, as image_sizes "
            "tells LLaVA-OneVision its crops)"
        )
    padded = []
    for v in values:
        if list(v.shape[1:]) != trailing:
            grown = v.new_zeros((v.shape[0], *trailing))
            grown[tuple(slice(0, s) for s in v.shape)] = v
            v = grown
        padded.append(v)
    return torch.cat(padded)
