"""InternVL3's released sizes (tests/data/hf_configs: 1B, 8B, 38B, written by
make_hf_configs.py from the published architectures) are the models' own and feed the
planner; the shape rules derived from a config and its image processor
(:func:`dflop.models.hf.internvl.family_from_config`) give the processor's own tile and
token counts (transformers' ``GotOcr2ImageProcessor`` and ``InternVLProcessor`` code) on
the shipped real images and on synthetic sizes of many aspect ratios."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflop.data.costs import ENCODER_PRESETS  # noqa: E402
from dflop.data.families import (  # noqa: E402
    get_family,
    image_shapes,
    multi_image_shapes,
    video_shapes,
)
from dflop.models import model_spec  # noqa: E402
from dflop.models.hf import spec_from_config  # noqa: E402
from dflop.models.hf.internvl import family_from_config  # noqa: E402
from dflop.models.hf.tiny import tiny_config  # noqa: E402
from dflop.planner.model import planner_modules  # noqa: E402
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (  # noqa: E402
    GotOcr2ImageProcessorPil,
)
from transformers.models.internvl.processing_internvl import InternVLProcessor  # noqa: E402

CONFIGS = os.path.join(DATA_DIR, "hf_configs")
# Published parameter counts (the checkpoints' model cards), in billions.
PUBLISHED_B = {"internvl3-1b-hf": 0.938, "internvl3-8b-hf": 7.94, "internvl3-38b-hf": 38.4}


def _spec(name):
    return model_spec(f"hf:{os.path.join(CONFIGS, name)}")


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_architecture_is_the_models(name):
    """The config builds the published model (parameter count); the planner's counts from
    the spec's architecture equal the model's; the shape rules are dflop's built-in
    ``internvl`` family (448 px tiles, 1,025 tower tokens, 256 LLM tokens, 1 to 12 tiles
    and a thumbnail)."""
    spec = _spec(name)
    with torch.device("meta"):
        model = spec.model_class(spec.config)
    actual = sum(p.numel() for p in model.parameters())
    assert actual / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.01)
    encoder, llm = spec.architecture()
    enc, dec = planner_modules(encoder, llm)
    planned = sum(
        m.num_layers * m.params_per_layer + m.first_stage_params + m.last_stage_params
        for m in (enc, dec)
    )
    assert planned == pytest.approx(actual, rel=0.002)
    assert spec.family == get_family("internvl")
    assert (spec.tokens_per_unit, spec.token_merge) == (1024, 4)  # 256 rows per tile
    if name != "internvl3-38b-hf":  # InternViT-300M: dflop's vit-300m preset
        preset = ENCODER_PRESETS["vit-300m"]
        for field in ("hidden_size", "num_layers", "intermediate_size", "num_heads"):
            assert getattr(preset, field) == getattr(encoder, field), field
        assert (encoder.tokens_per_unit, encoder.projector_input_size) == (1025, 4096)


def _processor(tile=448, max_patches=12, min_patches=1):
    return GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile},
        crop_to_patches=True,
        min_patches=min_patches,
        max_patches=max_patches,
    )


def _processor_counts(processor, height, width, seq_length, max_patches=None):
    """(tiles, LLM visual tokens) of one image by the image processor's own tile count
    (``get_number_of_image_patches``, what ``InternVLProcessor`` expands ``<image>`` by):
    ``<img>`` + ``image_seq_length`` per tile + ``</img>`` (the records test checks this
    layout token for token against the processor). Not ``_get_num_multimodal_tokens``:
    transformers 5.25 stopped counting ``<img>`` / ``</img>`` there, 5.24 counted them."""
    images_kwargs = {"crop_to_patches": True}
    if max_patches is not None:
        images_kwargs["max_patches"] = max_patches
    tiles = processor.get_number_of_image_patches(height, width, images_kwargs)
    return tiles, seq_length * tiles + 2


SIZES = [(1, 1), (448, 448), (449, 447), (100, 3000), (3000, 100), (896, 448), (448, 1344)]
SIZES += [(2240, 1792), (1080, 1920), (1, 5000), (5000, 1), (300, 301), (672, 896)]


def _synthetic_sizes(scale, count=300):
    rng = np.random.default_rng(0)
    sizes = [(h * scale // 448, w * scale // 448) for h, w in SIZES]
    heights = np.exp(rng.uniform(0, np.log(6 * scale), count)).astype(int) + 1
    ratios = np.exp(rng.uniform(np.log(1 / 12), np.log(12), count))
    widths = np.maximum(1, (heights * ratios).astype(int))
    return [(max(1, h), max(1, w)) for h, w in sizes] + list(zip(heights, widths))


@pytest.mark.parametrize(
    "case", ["released", "tiny", "tiny_6_tiles", "min_2_tiles"], ids=lambda c: c
)
def test_shape_rules_are_the_processors(case):
    """Single images (synthetic sizes, aspect ratios 1:12 to 12:1 and extremes), each
    image of multi-image samples (``max_patches // images`` tiles) and videos (one tile
    per frame, at most 32): the family's units and visual tokens are the processor's."""
    if case == "released":
        config = _spec("internvl3-8b-hf").config
        processor, scale = _processor(), 448
    else:
        config = tiny_config("internvl")
        high, low = {"tiny": (12, 1), "tiny_6_tiles": (6, 1), "min_2_tiles": (9, 2)}[case]
        processor, scale = _processor(32, high, low), 32
    family = family_from_config(config, processor)
    per_tile = config.image_seq_length
    assert family.llm_tokens_per_tile == per_tile
    sizes = _synthetic_sizes(scale)
    units, tokens = image_shapes(family, [w for _, w in sizes], [h for h, _ in sizes])
    for (h, w), u, t in zip(sizes, units, tokens):
        assert (int(u), int(t)) == _processor_counts(processor, h, w, per_tile), (h, w)
    # multi-image: sample k has k + 1 images of the first sizes
    index = [k for k in range(5) for _ in range(k + 1)]
    picked = [sizes[i] for i in range(len(index))]
    units, tokens = multi_image_shapes(
        family, index, [w for _, w in picked], [h for h, _ in picked], 5
    )
    for k in range(5):
        limit = max(1, family.max_tiles // (k + 1))
        counts = [
            _processor_counts(processor, h, w, per_tile, limit)
            for (h, w), owner in zip(picked, index)
            if owner == k
        ]
        assert (int(units[k]), int(tokens[k])) == tuple(map(sum, zip(*counts))), k
    # videos: the processor's "Frame{i}: <img> + context + </img>" per (sampled) frame
    holder = SimpleNamespace(
        start_image_token="<img>",
        end_image_token="</img>",
        image_token="<IMG_CONTEXT>",
        image_seq_length=per_tile,
    )
    for frames in (1, 5, 32, 40):
        units, tokens = video_shapes(family, frames)
        sampled = min(frames, family.max_frames)
        video = {"pixel_values_videos": [torch.zeros(sampled, 1)]}
        text = InternVLProcessor.replace_video_token(holder, video, 0)
        visual = sum(text.count(t) for t in ("<img>", "</img>", "<IMG_CONTEXT>"))
        assert (int(units[0]), int(tokens[0])) == (sampled, visual)


REAL_IMAGES = [
    "photo_640x480.png",
    "photo_1024x768.jpg",
    "scan_1700x2200_progressive.jpg",
    "exif_rotated_800x600.jpg",
    "anim_500x375.gif",
    "chart_200x150.bmp",
    "lossy_800x600.webp",
    "lossless_300x200.webp",
    "alpha_640x360.webp",
    "document_2480x3508.png",
    "icon_16x16.png",
]


def test_real_images_tile_as_the_processor_tiles_them():
    """The shipped real images (16 px to 2480 x 3508, EXIF, animated, alpha) through the
    released-size processor: the tiles it makes are the family's count from the file
    header, and so are the records' items and placeholders."""
    from dflop.models.hf.records import header_size
    from PIL import Image

    spec = _spec("internvl3-1b-hf")
    processor = spec.image_processor()
    family = spec.family
    folder = os.path.join(DATA_DIR, "llava_mini", "images")
    seen = set()
    for name in REAL_IMAGES:
        path = os.path.join(folder, name)
        height, width = header_size(path, name)
        with Image.open(path) as im:
            image = im.convert("RGB")
        out = processor(images=[image], crop_to_patches=True, return_tensors="pt")
        tiles = int(out["num_patches"][0])
        units, tokens = image_shapes(family, width, height)
        assert (int(units[0]), int(tokens[0])) == (tiles, 2 + 256 * tiles), name
        assert out["pixel_values"].shape == (tiles, 3, 448, 448)
        seen.add(tiles)
    assert len(seen) >= 4, seen
    inputs = spec.dataset_inputs()
    with open(os.path.join(DATA_DIR, "llava_mini", "llava_mini.json")) as f:
        record = json.load(f)[12]  # three images: 12 // 3 = 4 tiles each at most
    sample = inputs.sample(record, image_folder=folder, lazy=True)
    assert [item.kind for item in sample.items] == ["image"] * 3
    assert all(item.units <= 4 + 1 for item in sample.items)
    assert int(sample.placeholder_mask.sum()) == 256 * sample.units
    start, end = inputs.wrap
    assert (start, end) == (151665, 151666)  # <img>, </img> of the released vocabulary
    ids = sample.input_ids.tolist()
    assert ids.count(start) == ids.count(end) == 3


def test_configs_dflop_cannot_follow_are_refused():
    """Non-square tiles, a processor of another tile size, a pixel shuffle that is not
    1 / N, and a feature selection keeping the CLS token raise errors naming them."""
    config = tiny_config("internvl")
    with pytest.raises(ValueError, match="tiles are 448 px, the model's"):
        family_from_config(config, _processor(448))
    config.downsample_ratio = 0.4
    with pytest.raises(ValueError, match="downsample_ratio=0.4"):
        family_from_config(config, _processor(32))
    config = tiny_config("internvl")
    config.vision_config.image_size = (32, 64)
    with pytest.raises(ValueError, match="square tiles"):
        family_from_config(config, _processor(32))
    config = tiny_config("internvl")
    config.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="vision_feature_select_strategy='full'"):
        spec_from_config(config)
    config = tiny_config("internvl")
    config.vision_feature_layer = 0
    with pytest.raises(ValueError, match="vision_feature_layer=0"):
        spec_from_config(config)


def test_plan_the_38b_model(tmp_path):
    """dflop plan --model hf:<config folder> plans InternVL3-38B (InternViT-6B's 25 heads,
    Qwen2.5-32B) at its real size with the analytic costs."""
    from cli_harness import run_cli

    out = tmp_path / "plan.json"
    folder = os.path.join(CONFIGS, "internvl3-38b-hf")
    args = ["--gpus", "64", "--global-batch", "128", "--batches", "1", "-o", str(out)]
    result = run_cli("plan", "--model", f"hf:{folder}", *args)
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert plan["inputs"]["llm"]["num_layers"] == 64
    assert plan["inputs"]["encoder"]["num_layers"] == 45
    assert plan["layouts"], "no layout fits"
