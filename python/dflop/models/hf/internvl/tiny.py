"""A tiny InternVL: CPU tests, the end-to-end examples and profiling on a laptop. Same
architecture as the released InternVL 2.5 / 3 models (InternViT with a CLS token, pixel
shuffle 0.5, LayerNorm + MLP projector, Qwen2 decoder), a few thousand times smaller
(32 px tiles of 4 px patches: 65 tower tokens and 16 LLM tokens per tile; hidden sizes of
32 and 64). Reached by model type through :mod:`dflop.models.hf.tiny`
(``tiny_config("internvl")``)."""

from __future__ import annotations

from typing import Any

from dflop.models.hf.common import require_transformers, tiny_decoder

__all__ = ["save_tiny_internvl", "tiny_internvl_config"]


def tiny_internvl_config(
    *, vision_layers: int = 2, text_layers: int = 2, vocab_size: int = 320
) -> Any:
    """An ``InternVLConfig``: InternViT (32 px tiles, 4 px patches, hidden 32, 2 heads,
    q/k/v biases), pixel shuffle 0.5 (16 LLM tokens per tile), Qwen2 (hidden 64, 4 heads,
    2 KV heads); ``<img>``, ``</img>`` and ``<IMG_CONTEXT>`` (``image_token_id``) are the
    last three ids of the vocabulary, in the released checkpoints' order."""
    transformers = require_transformers()
    return transformers.InternVLConfig(
        vision_config={
            "model_type": "internvl_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 4,
            "attention_bias": True,
            "use_mean_pooling": True,
        },
        text_config={
            "model_type": "qwen2",
            **tiny_decoder(vocab_size, text_layers),
            "tie_word_embeddings": False,
        },
        image_token_id=vocab_size - 1,
        image_seq_length=16,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def save_tiny_internvl(
    folder: str, *, seed: int = 0, weights: bool = True, max_tiles: int = 6, **sizes: Any
) -> str:
    """A local model folder of :func:`tiny_internvl_config` (``sizes`` passed on):
    ``config.json``, the image processor's ``preprocessor_config.json`` (32 px tiles, 1 to
    ``max_tiles`` dynamic tiles plus a thumbnail, the released models' normalisation) and,
    with ``weights``, safetensors of the model built after ``torch.manual_seed(seed)``.
    Train it with ``dflop train --model hf:FOLDER``."""
    import torch

    from dflop.models.hf.internvl.spec import IMAGENET_MEAN, IMAGENET_STD

    transformers = require_transformers()
    config = tiny_internvl_config(**sizes)
    tile = int(config.vision_config.image_size[0])
    module = transformers.models.got_ocr2.image_processing_pil_got_ocr2
    module.GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile},
        crop_to_patches=True,
        min_patches=1,
        max_patches=max_tiles,
        image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
    ).save_pretrained(folder)
    if weights:
        torch.manual_seed(seed)
        transformers.InternVLForConditionalGeneration(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder
