"""Writes the config.json of nine released vision-language models (architecture only,
no weights), for planning real sizes offline: LLaVA-OneVision 0.5B / 7B / 72B
(``llava-hf/llava-onevision-qwen2-*-ov-hf``), Qwen2-VL 2B / 7B / 72B
(``Qwen/Qwen2-VL-*-Instruct``) and InternVL3 1B / 8B / 38B (``OpenGVLab/InternVL3-*-hf``).

The machine this project is built on cannot reach the Hugging Face Hub, so the files are
not downloads: each is transformers' own config class filled with the architecture
fields of the model's published config (layers, widths, heads, KV heads, vocabulary,
token ids, anyres grids, rope). ``tests/unit/models/test_hf_configs.py`` (InternVL3:
``test_hf_internvl_config.py``) checks each against the model's published parameter count. Run: ``python tests/data/hf_configs/make_hf_configs.py``.
"""

from __future__ import annotations

import os

import transformers

HERE = os.path.dirname(os.path.abspath(__file__))

# Qwen2 decoders: hidden, intermediate, layers, heads, KV heads, vocabulary, tied head.
QWEN2 = {
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "72b": (8192, 29568, 80, 64, 8, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
}

# InternViT towers (InternVL 2.5 / 3): hidden, intermediate, layers, heads, q/k/v biases,
# q/k norms and RMSNorm (InternViT-6B) or LayerNorm.
INTERNVIT = {
    "300m": (1024, 4096, 24, 16, True, False),  # InternViT-300M-448px-V2_5
    "6b": (3200, 12800, 45, 25, False, True),  # InternViT-6B-448px-V2_5 (45 of 48 layers)
}
INTERNVL3_VOCAB = 151674  # Qwen2.5's tokens plus InternVL's <img>, <IMG_CONTEXT>, <box>, ...


def _text(size: str, model_type: str, **extra: object) -> dict:
    hidden, inter, layers, heads, kv, vocab, tied = QWEN2[size]
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        **extra,
    }


def llava_onevision(size: str) -> transformers.LlavaOnevisionConfig:
    tile = 384
    grid = range(1, 7)
    return transformers.LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 26,
            "num_attention_heads": 16,
            "image_size": tile,
            "patch_size": 14,
            "vision_use_head": False,
        },
        text_config=_text(size, "qwen2", rope_theta=1e6),
        image_token_index=151646,
        video_token_index=151647,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        image_grid_pinpoints=[[tile * r, tile * c] for r in grid for c in grid],
        tie_word_embeddings=QWEN2[size][6],
    )


def qwen2_vl(size: str) -> transformers.Qwen2VLConfig:
    text = _text(
        size,
        "qwen2_vl_text",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [16, 24, 24],
        },
    )
    return transformers.Qwen2VLConfig(
        vision_config={
            "depth": 32,
            "embed_dim": 1280,
            "hidden_size": text["hidden_size"],
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        text_config=text,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=QWEN2[size][6],
    )


def internvl3(vit: str, llm: str) -> transformers.InternVLConfig:
    hidden, inter, layers, heads, biases, six_b = INTERNVIT[vit]
    text = _text(llm, "qwen2", rope_theta=1e6)
    text.update(vocab_size=INTERNVL3_VOCAB, tie_word_embeddings=False)  # InternVL3: untied
    return transformers.InternVLConfig(
        vision_config={
            "model_type": "internvl_vision",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "attention_bias": biases,
            "use_qk_norm": six_b,
            "norm_type": "rms_norm" if six_b else "layer_norm",
            "layer_norm_eps": 1e-6,
            "image_size": 448,
            "patch_size": 14,
            "use_mean_pooling": True,
        },
        text_config=text,
        image_token_id=151667,
        image_seq_length=256,
        downsample_ratio=0.5,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


MODELS = {
    "llava-onevision-qwen2-0.5b-ov": lambda: llava_onevision("0.5b"),
    "llava-onevision-qwen2-7b-ov": lambda: llava_onevision("7b"),
    "llava-onevision-qwen2-72b-ov": lambda: llava_onevision("72b"),
    "qwen2-vl-2b-instruct": lambda: qwen2_vl("1.5b"),
    "qwen2-vl-7b-instruct": lambda: qwen2_vl("7b"),
    "qwen2-vl-72b-instruct": lambda: qwen2_vl("72b"),
    "internvl3-1b-hf": lambda: internvl3("300m", "0.5b"),
    "internvl3-8b-hf": lambda: internvl3("300m", "7b"),
    "internvl3-38b-hf": lambda: internvl3("6b", "32b"),
}

if __name__ == "__main__":
    for name, make in MODELS.items():
        make().save_pretrained(os.path.join(HERE, name))
        print("wrote", name)
