"""Tiny Qwen2-VL and Qwen2.5-VL models: CPU tests, the end-to-end examples and profiling
on a laptop. Same architecture as the real models, a few thousand times smaller (4 px
patches; hidden sizes of 32 and 64). Reached by model type through
:mod:`dflop.models.hf.tiny` (``tiny_config("qwen2_vl")``, ``tiny_config("qwen2_5_vl")``)."""

from __future__ import annotations

from typing import Any

from dflop.models.hf.common import require_transformers, tiny_decoder

__all__ = ["save_tiny_qwen_vl", "tiny_qwen2_5_vl_config", "tiny_qwen2_vl_config"]


def _qwen_text(vocab_size: int, text_layers: int) -> dict[str, Any]:
    return {
        **tiny_decoder(vocab_size, text_layers),
        "bos_token_id": 0,
        "eos_token_id": 1,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
    }


def _qwen_ids(vocab_size: int) -> dict[str, Any]:
    return {
        "image_token_id": vocab_size - 4,
        "video_token_id": vocab_size - 3,
        "vision_start_token_id": vocab_size - 2,
        "vision_end_token_id": vocab_size - 1,
        "tie_word_embeddings": False,
    }


def tiny_qwen2_5_vl_config(
    *, vision_layers: int = 2, text_layers: int = 2, vocab_size: int = 320
) -> Any:
    """A ``Qwen2_5_VLConfig`` like :func:`tiny_qwen2_vl_config`, with a SwiGLU tower of
    width 32 and window attention: windows of 16 px (2 x 2 merged tokens), the last
    block attending over the whole unit."""
    transformers = require_transformers()
    return transformers.Qwen2_5_VLConfig(
        vision_config={
            "depth": vision_layers,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 16,
            "fullatt_block_indexes": [vision_layers - 1],
        },
        text_config=_qwen_text(vocab_size, text_layers),
        **_qwen_ids(vocab_size),
    )


def tiny_qwen2_vl_config(
    *, vision_layers: int = 2, text_layers: int = 2, vocab_size: int = 320
) -> Any:
    """A ``Qwen2VLConfig``: vision tower of 4 px patches (2 frames deep), width 32, 2 x 2
    merger; Qwen2 decoder (hidden 64, 4 heads, 2 KV heads, mRoPE sections 2/3/3); the
    image, video, vision-start and vision-end token ids are the last four of the
    vocabulary."""
    transformers = require_transformers()
    return transformers.Qwen2VLConfig(
        vision_config={
            "depth": vision_layers,
            "embed_dim": 32,
            "hidden_size": 64,
            "mlp_ratio": 2,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        text_config=_qwen_text(vocab_size, text_layers),
        **_qwen_ids(vocab_size),
    )


def save_tiny_qwen_vl(
    folder: str, *, family: str = "qwen2_vl", seed: int = 0, weights: bool = True, **sizes: Any
) -> str:
    """A local model folder of :func:`tiny_qwen2_vl_config` (``family="qwen2_5_vl"``:
    :func:`tiny_qwen2_5_vl_config`): ``config.json``, an image processor of the model's
    patch sizes whose resize bounds keep images between 16 x 16 and 128 x 128 pixels
    (at most 1,024 patches, for CPU runs), video frames within 16 x 16 and 64 x 64
    pixels, and, with ``weights``, safetensors of the model
    built after ``torch.manual_seed(seed)``; ``sizes`` go to the config function (e.g.
    ``vocab_size=151936``, a real Qwen2 vocabulary)."""
    import torch

    transformers = require_transformers()
    make, cls = {
        "qwen2_vl": (tiny_qwen2_vl_config, "Qwen2VLForConditionalGeneration"),
        "qwen2_5_vl": (tiny_qwen2_5_vl_config, "Qwen2_5_VLForConditionalGeneration"),
    }[family]
    config = make(**sizes)
    vision = config.vision_config
    module = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl
    module.Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        min_pixels=16 * 16,
        max_pixels=128 * 128,
    ).save_pretrained(folder)
    # The video processor's frame bounds (its class needs torchvision: written as JSON).
    import json
    import os

    with open(os.path.join(folder, "video_preprocessor_config.json"), "w") as f:
        json.dump({"size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}}, f)
    if weights:
        torch.manual_seed(seed)
        getattr(transformers, cls)(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder
