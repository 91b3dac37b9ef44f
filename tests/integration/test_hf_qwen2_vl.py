"""Qwen2-VL and Qwen2.5-VL from transformers under dflop's runtime (tiny configs, CPU,
gloo).

Units of any size: each image is one unit of ``h x w`` patches, a video one unit per
temporal patch; the encoder replicas split samples' units, the 2 x 2 merger sends one
feature row per 4 patches, and the LLM stages run with each sample's own 3-D mRoPE
positions (Qwen2.5-VL: window attention in the tower). The reference is the unmodified
transformers model run on each sample alone; dflop's split model must give the same
summed loss and gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflop.models.hf import spec_from_config  # noqa: E402
from dflop.models.hf.tiny import tiny_qwen2_5_vl_config, tiny_qwen2_vl_config  # noqa: E402
from dflop.models.spec import VisualItem  # noqa: E402
from dflop.runtime import spawn_local  # noqa: E402
from dflop.runtime.processed_batch import ProcessedBatch, ProcessedSample  # noqa: E402
from hf_harness import (  # noqa: E402
    FROZEN_CASES,
    FROZEN_IDS,
    LAYOUT_IDS,
    LAYOUTS,
    assert_backward_only_where_trained,
    assert_matches,
    freeze_reference,
    reference_step,
    run_rank_step,
)

MODEL_SEED, DATA_SEED = 7, 13
SPAWN_TIMEOUT_S = 120.0
# Per sample: a list of ("image", (h, w)) / ("video", (t, h, w)) items in patches, or
# None (text-only). Multi-image samples have images of different sizes.
SAMPLES = [
    [("image", (4, 6))],
    None,
    [("image", (8, 4))],
    [("image", (2, 2)), ("image", (4, 4))],
    [("video", (2, 4, 4))],
    [("image", (2, 2))],
    None,
    [("image", (6, 6))],
]
TEXT_TOKENS = [9, 12, 7, 10, 8, 6, 15, 5]


FAMILIES = {
    "qwen2_vl": (tiny_qwen2_vl_config, "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": (tiny_qwen2_5_vl_config, "Qwen2_5_VLForConditionalGeneration"),
}


def _config(family):
    config = FAMILIES[family][0]()
    config._attn_implementation = "sdpa"
    return config


def _hf_model(config):
    torch.manual_seed(MODEL_SEED)
    return getattr(transformers, FAMILIES[config.model_type][1])(config)


def _samples(config) -> list[ProcessedSample]:
    """Samples with text, then each item as <vision_start> placeholders <vision_end>,
    then more text; pixels one row per patch."""
    rng = np.random.default_rng(DATA_SEED)
    vision = config.vision_config
    row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size**2
    vocab = config.text_config.vocab_size - 4  # text ids avoid the special ids
    samples = []
    for spec, text in zip(SAMPLES, TEXT_TOKENS):
        ids = rng.integers(0, vocab, text).tolist()
        input_ids, pixels, items = ids[:2], [], []
        for kind, size in spec or []:
            grid = (1, *size) if kind == "image" else size
            patches = grid[0] * grid[1] * grid[2]
            token = config.image_token_id if kind == "image" else config.video_token_id
            input_ids += [config.vision_start_token_id, *[token] * (patches // merge)]
            input_ids += [config.vision_end_token_id]
            pixels.append(torch.from_numpy(rng.standard_normal((patches, row))).float())
            items.append(VisualItem(kind, grid[0], grid_thw=grid))
        prompt = len(input_ids) + text // 2 - 2
        input_ids += ids[2:]
        labels = torch.tensor(input_ids)
        labels[:prompt] = -100
        samples.append(
            ProcessedSample(
                torch.tensor(input_ids),
                labels,
                torch.cat(pixels) if pixels else None,
                tuple(items),
                (config.image_token_id, config.video_token_id),
            )
        )
    return samples


def _hf_forward(model, config, sample: ProcessedSample):
    """The unmodified model's mean loss on one sample alone."""
    kwargs = {}
    rows = np.cumsum([0, *[i.grid_thw[0] * i.unit_tokens for i in sample.items]])
    for kind, pixels_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        picks = [k for k, item in enumerate(sample.items) if item.kind == kind]
        if picks:
            kwargs[pixels_key] = torch.cat(
                [sample.pixel_values[rows[k] : rows[k + 1]] for k in picks]
            )
            kwargs[grid_key] = torch.tensor([sample.items[k].grid_thw for k in picks])
    ids = sample.input_ids[None]
    kinds = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    out = model(input_ids=ids, labels=sample.labels[None], mm_token_type_ids=kinds, **kwargs)
    return out.loss


def _reference(config, samples, trainable="full"):
    model = _hf_model(config)
    freeze_reference(model, spec_from_config(config), trainable, MODEL_SEED)
    targets = ProcessedBatch(samples, None).target_tokens()
    return reference_step(model, samples, targets, lambda m, s: _hf_forward(m, config, s))


def _rank_step(rank, world_size, family, layout_kw, assignment, trainable="full"):
    spec = spec_from_config(_config(family))
    batch = ProcessedBatch(_samples(spec.config), None)
    return run_rank_step(rank, spec, batch, layout_kw, assignment, MODEL_SEED, trainable)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def reference(request):
    config = _config(request.param)
    return request.param, _reference(config, _samples(config))


@pytest.mark.parametrize("layout_kw, assignment, world", LAYOUTS, ids=LAYOUT_IDS)
def test_runtime_matches_transformers(reference, layout_kw, assignment, world):
    family, (loss_sum, grads) = reference
    results = spawn_local(
        _rank_step,
        world,
        args=(family, layout_kw, assignment),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert_matches(results, loss_sum, grads, layout_kw)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("trainable, layout", FROZEN_CASES, ids=FROZEN_IDS)
def test_frozen_parts_match_transformers(family, trainable, layout):
    """Frozen parts: the loss and every trainable gradient equal transformers' with the
    same parts frozen; frozen stages run no backward."""
    layout_kw, assignment, world = LAYOUTS[layout]
    config = _config(family)
    loss_sum, grads = _reference(config, _samples(config), trainable)
    results = spawn_local(
        _rank_step,
        world,
        args=(family, layout_kw, assignment, trainable),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert_matches(results, loss_sum, grads, layout_kw)
    assert_backward_only_where_trained(results, trainable)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_unit_alone_encodes_as_in_the_whole_tower(family):
    """The premise of splitting units: a video's temporal patches, encoded one unit at a
    time, give the whole tower's features (windows included)."""
    config = _config(family)
    model = _hf_model(config)
    spec = spec_from_config(config)
    stage = spec.whole_module("encoder", seed=MODEL_SEED)
    sample = _samples(config)[4]  # the video: 2 units of 4 x 4 patches
    grid = torch.tensor([sample.items[0].grid_thw])
    with torch.no_grad():
        whole = model.model.get_video_features(sample.pixel_values, grid).pooler_output[0]
        units = torch.tensor([[1, 4, 4], [1, 4, 4]])
        ours = torch.cat(
            [stage(sample.pixel_values[k * 16 : (k + 1) * 16], units[k : k + 1]) for k in (0, 1)]
        )
    torch.testing.assert_close(ours, whole, rtol=1e-5, atol=1e-6)


def test_native_rule_matches_the_processor():
    """dflop's native (Qwen-VL) shape rule gives the processor's own resize for random
    sizes (extreme aspect ratios included), and the patch grids of the shipped real images
    through the model's processor."""
    import json
    import os

    from dflop.data.families import QWEN2_VL, native_grid
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(0)
    sizes = [(int(w), int(h)) for w, h in rng.integers(8, 6000, size=(2000, 2))]
    sizes += [(16, 3000), (3000, 16), (1, 150), (28, 28)]
    for w, h in sizes:
        if max(w, h) / min(w, h) > 200:
            continue  # the processor refuses these
        rows, cols = native_grid(QWEN2_VL, w, h)
        expected = smart_resize(h, w, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
        assert (int(rows[0]) * 14, int(cols[0]) * 14) == expected, (w, h)
    # The tiny model's records: grids from headers equal the processor's on the pixels.
    spec = spec_from_config(_config("qwen2_vl"))
    inputs = spec.dataset_inputs()
    root = os.path.join(DATA_DIR, "llava_mini")
    with open(os.path.join(root, "llava_mini.json")) as f:
        records = json.load(f)
    samples = [
        inputs.sample(records[i], image_folder=os.path.join(root, "images"), lazy=True)
        for i in (0, 5, 9, 10, 13)
    ]
    batch = ProcessedBatch(samples, None)
    for k, i in enumerate((0, 5, 9, 10, 13)):  # the files the trainer checks first
        image = records[i].get("image")
        paths = [] if image is None else [image] if isinstance(image, str) else image
        expected = [os.path.join(root, "images", p) for p in paths]
        assert batch.visual_files(k) == list(dict.fromkeys(expected))
    pixels = batch.pixel_values(list(range(len(samples))))  # checks the grids
    encoder_tokens = sum(sum(t) for t in batch.unit_tokens())
    assert pixels.shape[0] == encoder_tokens
    # The planner prices the pixels the runtime holds: bytes per encoder token.
    from dflop.planner.model import planner_modules

    priced = planner_modules(*spec.architecture())[0].input_bytes_per_token
    assert priced == pixels.numel() * pixels.element_size() / encoder_tokens
    merge = spec.token_merge
    for sample in samples:
        wrap = 2 * len(sample.items)  # vision start and end
        expected = sum(item.unit_tokens // merge for item in sample.items)
        assert int(sample.placeholder_mask.sum()) == expected
        assert int((sample.labels == -100).sum()) >= expected + wrap


def test_a_corrupt_image_is_named():
    import json
    import os

    inputs = spec_from_config(_config("qwen2_vl")).dataset_inputs()
    root = os.path.join(DATA_DIR, "llava_mini")
    with open(os.path.join(root, "llava_mini.json")) as f:
        records = json.load(f)
    with pytest.raises(ValueError, match=r"record 25: cannot read .*corrupt\.png"):
        inputs.sample(records[25], image_folder=os.path.join(root, "images"), where="record 25")


def test_video_frames_become_temporal_patches(tmp_path):
    """A frames folder: frames sampled and padded to pairs, each pair one unit whose
    patch rows hold the two frames' own patches in the [C, 2, P, P] layout of the video
    processor, the placeholders one per 4 patches inside vision start/end."""
    import json
    import os

    from dflop.models.hf.tiny import save_tiny_qwen_vl

    spec = spec_from_config(_config("qwen2_vl"))
    folder = save_tiny_qwen_vl(str(tmp_path / "q"), weights=False)
    spec = type(spec)(spec.config, folder)
    inputs = spec.dataset_inputs()
    root = os.path.join(DATA_DIR, "llava_mini")
    with open(os.path.join(root, "llava_mini.json")) as f:
        records = json.load(f)
    record = next(r for r in records if r.get("video") == "clip_frames")
    videos = os.path.join(root, "videos")
    sample = inputs.sample(record, video_folder=videos, lazy=True)
    (item,) = sample.items
    frames = sorted(
        n for n in os.listdir(os.path.join(videos, "clip_frames")) if n.endswith(".jpg")
    )
    assert sample.files == tuple(os.path.join(videos, "clip_frames", n) for n in frames)
    assert item.kind == "video" and item.units == (len(frames) + 1) // 2
    t, rows, cols = item.grid_thw
    assert rows * cols <= 64 * 64 // 16  # within the folder's video bounds
    assert int(sample.placeholder_mask.sum()) == t * rows * cols // spec.token_merge
    pixels = ProcessedBatch([sample], None).pixel_values([0])
    vision = spec.config.vision_config
    p, c = vision.patch_size, vision.in_channels
    assert pixels.shape == (t * rows * cols, c * 2 * p * p)
    from PIL import Image

    first = [Image.open(os.path.join(videos, "clip_frames", n)).convert("RGB") for n in frames[:2]]
    alone = inputs.frame_processor(images=first, return_tensors="pt")["pixel_values"]
    alone = alone.view(2, rows * cols, c, 2, p, p)[:, :, :, 0]
    unit0 = pixels[: rows * cols].view(rows * cols, c, 2, p, p)
    assert torch.equal(unit0[:, :, 0], alone[0]) and torch.equal(unit0[:, :, 1], alone[1])
    # The profile (what the planner samples) has the converter's units and tokens.
    from dflop.data.reader import read_records

    found = read_records(
        os.path.join(root, "llava_mini.json"),
        family=spec.family,
        image_folder=os.path.join(root, "images"),
        video_folder=videos,
        text_counter=inputs.text_counter(),
    )
    k = next(i for i, r in enumerate(found.records) if r.data.get("video") == "clip_frames")
    shapes = found.distribution.samples
    assert int(shapes.encoder_units[k]) == t
    assert int(shapes.tokens_per_unit[k]) == rows * cols
    assert int(shapes.llm_visual_tokens[k]) == int(sample.placeholder_mask.sum()) + 2
    # An odd count repeats the last frame; a long video is sampled down to max_frames.
    assert inputs._frames(list("abcde")) == list("abcdee")
    long = inputs._frames([f"f{k}" for k in range(100)])
    assert len(long) == 32 and long[0] == "f0" and long[-1] == "f99"


def test_encoder_costs_scale_with_tokens():
    """A patch-sequence encoder's cost model prices encoder tokens: two units of 512
    patches cost what one of 1,024 does, and the setting survives JSON."""
    from dataclasses import replace

    from dflop.data.shapes import SampleShapes
    from dflop.profiling import CostModel, PerformanceModel
    from dflop.profiling.perf_model import EncoderTimeCoefficients, LLMTimeCoefficients

    perf = PerformanceModel(
        encoder=EncoderTimeCoefficients(per_unit_s=0.01, constant_s=0.001),
        llm=LLMTimeCoefficients(per_token_s=1e-5, per_token_sq_s=0.0, constant_s=0.0),
        tokens_per_unit=1024,
        encoder_per_token=True,
    )
    shapes = SampleShapes(
        encoder_units=np.array([2, 1, 1]),
        tokens_per_unit=np.array([512, 1024, 256]),
        llm_visual_tokens=np.array([256, 256, 64]),
        text_tokens=np.array([10, 10, 10]),
        modality=np.array([2, 1, 1], dtype=np.int8),
    )
    costs = CostModel(perf).costs(shapes)[:, 0]
    np.testing.assert_allclose(costs, [0.01, 0.01, 0.0025])
    assert PerformanceModel.from_dict(perf.to_dict()).encoder_per_token
    per_unit = CostModel(replace(perf, encoder_per_token=False)).costs(shapes)[:, 0]
    np.testing.assert_allclose(per_unit, [0.02, 0.01, 0.01])
    with pytest.raises(ValueError, match="encoder_per_token needs"):
        replace(perf, tokens_per_unit=0)
