"""A tiny LLaVA-OneVision: CPU tests, the end-to-end examples and profiling on a laptop.
Same architecture as the real models, a few thousand times smaller (32 px tiles of 8 px
patches; hidden sizes of 32 and 64). Reached by model type through
:mod:`dflop.models.hf.tiny` (``tiny_config("llava_onevision")``)."""

from __future__ import annotations

from typing import Any

from dflop.models.hf.common import require_transformers, tiny_decoder

__all__ = ["save_tiny_llava_onevision", "tiny_llava_onevision_config"]


def tiny_llava_onevision_config(
    *,
    vision_layers: int = 2,
    text_layers: int = 2,
    vocab_size: int = 320,
    max_grid: int = 3,
    max_crops: int = 4,
) -> Any:
    """A ``LlavaOnevisionConfig``: SigLIP (32 px, 8 px patches: 16 tokens per unit,
    hidden 32), Qwen2 (hidden 64, 4 heads, 2 KV heads), anyres grids up to ``max_grid`` x
    ``max_grid`` crops, ``anyres_max_<max_crops>``; image/video token ids are the last two
    of the vocabulary."""
    transformers = require_transformers()
    tile = 32
    grid = range(1, max_grid + 1)
    pinpoints = [[tile * r, tile * c] for r in grid for c in grid]
    return transformers.LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "patch_size": 8,
            "image_size": tile,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": 2,
            "vision_use_head": False,
        },
        text_config={
            "model_type": "qwen2",
            **tiny_decoder(vocab_size, text_layers),
            "tie_word_embeddings": False,
        },
        image_token_index=vocab_size - 2,
        video_token_index=vocab_size - 1,
        image_grid_pinpoints=pinpoints,
        vision_aspect_ratio=f"anyres_max_{max_crops}",
        tie_word_embeddings=False,
    )


def save_tiny_llava_onevision(
    folder: str, *, seed: int = 0, weights: bool = True, **sizes: Any
) -> str:
    """A local model folder of :func:`tiny_llava_onevision_config` (``sizes`` passed on):
    ``config.json``, the image processor's ``preprocessor_config.json`` (32 px tiles, the
    config's grids) and, with ``weights``, safetensors of the model built after
    ``torch.manual_seed(seed)``. Train it with ``dflop train --model hf:FOLDER``."""
    import torch

    from dflop.models.hf.llava_onevision.spec import LlavaOnevisionSpec

    transformers = require_transformers()
    config = tiny_llava_onevision_config(**sizes)
    LlavaOnevisionSpec(config).image_processor().save_pretrained(folder)
    if weights:
        torch.manual_seed(seed)
        transformers.LlavaOnevisionForConditionalGeneration(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder
