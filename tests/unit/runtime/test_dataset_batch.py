"""Tests of DatasetBatch (dflop.runtime.dataset_batch): real tensors from the records of
the mini LLaVA dataset, consistent with the shapes every rank plans with, loaded only for
the requested samples, and a pipelined step on them equal to a single-process run."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys

import numpy as np
import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
PIL_Image = pytest.importorskip("PIL.Image")

from dflop.data.dataset import iter_samples  # noqa: E402
from dflop.data.shapes import Modality  # noqa: E402
from dflop.models import build_model, model_config  # noqa: E402
from dflop.models.decoder import IGNORE_INDEX, next_token_targets  # noqa: E402
from dflop.runtime import RuntimeLayout, Topology, spawn_local  # noqa: E402
from dflop.runtime import dataset_batch as db  # noqa: E402
from dflop.runtime.dataset_batch import (  # noqa: E402
    END_TOKEN_ID,
    RESERVED_TOKEN_IDS,
    DatasetBatch,
    DatasetSampleError,
    read_records,
)
from dflop.runtime.engine import PipelineEngine, build_stage  # noqa: E402
from dflop.runtime.step_data import StepPlan  # noqa: E402
from dflop.runtime.synthetic_batch import ShapeScaler  # noqa: E402
from dflop.scheduling.balance import schedule_from_assignment  # noqa: E402

MINI = os.path.join(DATA_DIR, "llava_mini")
JSON = os.path.join(MINI, "llava_mini.json")
IMAGES = os.path.join(MINI, "images")
VIDEOS = os.path.join(MINI, "videos")
CONFIG = model_config("tiny")
TPU = CONFIG.vision.tokens_per_unit
SIDE = CONFIG.vision.image_size_px
SCALER = ShapeScaler.for_model(CONFIG)
MODEL_SEED = 5


def _records():
    return read_records(JSON, image_folder=IMAGES, video_folder=VIDEOS)


def _by_id(records):
    return {r.data["id"]: r for r in records}


@pytest.fixture(autouse=True)
def _fresh_caches():
    db.clear_caches()
    yield
    db.clear_caches()


def _expected_unit(path: str) -> torch.Tensor:
    with PIL_Image.open(path) as image:
        rgb = image.convert("RGB").resize((SIDE, SIDE), PIL_Image.Resampling.BICUBIC)
    array = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1)
    return torch.from_numpy(array.copy()) / 127.5 - 1.0


# ---------------------------------------------------------------- shapes vs tensors


@pytest.mark.parametrize("family", ["llava-ov", "internvl"])
def test_tensors_match_the_shapes(family):
    records = read_records(JSON, family, image_folder=IMAGES, video_folder=VIDEOS)
    assert len(records) == 19  # the readable records with pixels on disk
    # The profiler's reasons, plus the video file without frames and the image that
    # only size fields describe (not on disk: nothing to decode).
    assert records.distribution.skipped["video_without_frames"] == 1
    batch = DatasetBatch(records.records, CONFIG, SCALER, family=family)
    shapes = batch.shapes
    scaled = SCALER.scale(records.distribution.samples)
    for name in ("encoder_units", "llm_visual_tokens", "text_tokens", "modality", "target_tokens"):
        np.testing.assert_array_equal(getattr(shapes, name), getattr(scaled, name))
    assert (shapes.llm_visual_tokens == shapes.encoder_units * TPU).all()
    targets = batch.target_tokens()
    # The targets the runtime lays out are the shapes' (the profile's, scaled).
    np.testing.assert_array_equal(targets, shapes.target_tokens)
    assert not shapes.targets_estimated
    for i in range(len(batch)):
        pixels = batch.pixel_values([i])
        assert pixels.shape == (shapes.encoder_units[i], 3, SIDE, SIDE)
        assert pixels.dtype == torch.float32
        if pixels.numel():
            assert float(pixels.min()) >= -1.0 and float(pixels.max()) <= 1.0
        text = batch.text_inputs([i])
        assert text.token_ids.shape == (int(shapes.seq_len[i]),)
        assert text.cu_seqlens.tolist() == [0, int(shapes.seq_len[i])]
        assert text.unit_counts.tolist() == [int(shapes.encoder_units[i])]
        assert int(text.image_token_mask.sum()) == shapes.encoder_units[i] * TPU
        assert bool((text.labels[text.image_token_mask] == IGNORE_INDEX).all())
        assert bool((text.token_ids[~text.image_token_mask] > 0).all())
        assert int(text.token_ids.max()) < CONFIG.decoder.vocab_size
        counted = next_token_targets(text.labels, text.cu_seqlens) != IGNORE_INDEX
        assert int(counted.sum()) == targets[i] >= 1
    # Packing several samples is the concatenation of the single ones, in that order.
    both = batch.text_inputs([3, 0])
    one, zero = batch.text_inputs([3]), batch.text_inputs([0])
    assert torch.equal(both.token_ids, torch.cat([one.token_ids, zero.token_ids]))
    assert torch.equal(both.labels, torch.cat([one.labels, zero.labels]))
    assert torch.equal(
        batch.pixel_values([3, 0]), torch.cat([batch.pixel_values([3]), batch.pixel_values([0])])
    )


def test_labels_are_the_assistant_turns_only():
    records = _records()
    batch = DatasetBatch(records.records, CONFIG, SCALER)
    for i, raw in enumerate(batch.records):
        turns = raw.data["conversations"]
        answers = [t["value"] for t in turns if t["from"] == "gpt"]
        text = batch.text_inputs([i])
        labelled = text.labels[text.labels != IGNORE_INDEX].tolist()
        assert labelled, raw.data["id"]
        body = bytes(t - RESERVED_TOKEN_IDS for t in labelled if t != END_TOKEN_ID)
        if len(answers) == 1:  # the labels are a prefix of the answer's bytes
            assert answers[0].encode().startswith(body), raw.data["id"]
        else:  # text-long: a prefix of each answer, in order
            assert body.startswith(answers[0].encode()[:1])
        # A labelled position is labelled with its own token (shifted by the loss).
        keep = text.labels != IGNORE_INDEX
        assert torch.equal(text.labels[keep], text.token_ids[keep])


def test_placeholders_sit_where_the_images_are():
    recs = _by_id(_records().records)
    batch = DatasetBatch([recs["multi-2"], recs["text-1"]], CONFIG, SCALER)
    # "<image> and <image>: what differs?" with two images, capped to 1 unit (the first
    # image's): its placeholders follow BOS (and the user token when the turn's quota
    # has room for it); the second slot is empty.
    text = batch.text_inputs([0])
    assert batch.shapes.encoder_units[0] == 1
    _assert_one_run_after_bos(text, TPU)
    # A record without a placeholder gets its units prepended to the first turn.
    plain = {
        "id": "no-placeholder",
        "image": "photo_640x480.png",
        "conversations": [
            {"from": "human", "value": "Describe."},
            {"from": "gpt", "value": "A photo."},
        ],
    }
    other = DatasetBatch([plain], CONFIG, SCALER, image_folder=IMAGES)
    text = other.text_inputs([0])
    _assert_one_run_after_bos(text, int(other.shapes.encoder_units[0]) * TPU)


def _assert_one_run_after_bos(text, length: int) -> None:
    mask = text.image_token_mask.tolist()
    first = mask.index(True)
    assert first in (1, 2)  # after BOS, or BOS and the user token
    if first == 2:
        assert text.token_ids[1] == db.USER_TOKEN_ID
    assert all(mask[first : first + length]) and not any(mask[first + length :])


# ---------------------------------------------------------------- pixels


def test_pixels_are_deterministic_and_follow_the_images():
    recs = _by_id(_records().records)
    chosen = [recs["single-0"], recs["single-1"], recs["multi-3"]]
    first = DatasetBatch(chosen, CONFIG, SCALER).pixel_values([0, 1, 2])
    db.clear_caches()
    second = DatasetBatch(chosen, CONFIG, SCALER).pixel_values([0, 1, 2])
    assert torch.equal(first, second)
    # single-0: the base image (unit 0) is the whole image resized; single-1 differs.
    assert torch.allclose(first[0], _expected_unit(os.path.join(IMAGES, "photo_640x480.png")))
    assert not torch.equal(first[0], first[2])
    # multi-3 (3 images, one unit each, capped to 1): the first image, resized.
    assert torch.equal(first[-1], first[0])


def test_video_frames_are_sampled_uniformly():
    recs = _by_id(_records().records)
    batch = DatasetBatch([recs["video-long"], recs["video-frames"]], CONFIG, SCALER)
    assert batch.shapes.modality.tolist() == [Modality.VIDEO] * 2
    # 40 frames -> 32 (family cap) -> 8 units (/4) -> 4 (scaler cap): frames 0, 13, 26, 39.
    assert batch.shapes.encoder_units.tolist() == [4, 2]
    long_frames = batch.pixel_values([0])
    folder = os.path.join(VIDEOS, "long_clip_frames")
    for unit, k in enumerate([0, 13, 26, 39]):
        assert torch.allclose(
            long_frames[unit], _expected_unit(os.path.join(folder, f"{k:04d}.png"))
        )
    short = batch.pixel_values([1])  # 8 frames (notes.txt is not one) -> frames 0 and 7
    folder = os.path.join(VIDEOS, "clip_frames")
    assert torch.allclose(short[0], _expected_unit(os.path.join(folder, "frame_000.jpg")))
    assert torch.allclose(short[1], _expected_unit(os.path.join(folder, "frame_007.jpg")))


# ---------------------------------------------------------------- what is loaded


def _no_pillow():
    raise AssertionError("an LLM-side call decoded pixels")


def test_each_call_loads_only_what_it_needs(monkeypatch):
    recs = _by_id(_records().records)
    chosen = [recs["text-1"], recs["single-0"], recs["text-long"], recs["video-frames"]]

    def no_tokens(text):
        raise AssertionError("an encoder-side call tokenised text")

    batch = DatasetBatch(chosen, CONFIG, SCALER, tokenizer=no_tokens)
    empty = batch.pixel_values([0, 2])  # text-only samples: nothing to decode
    assert empty.shape == (0, 3, SIDE, SIDE)
    assert batch.stats["images_decoded"] == 0
    pixels = batch.pixel_values([1])
    assert pixels.shape[0] == batch.shapes.encoder_units[1]
    assert batch.stats["images_decoded"] == 1 and batch.stats["samples_tokenised"] == 0

    monkeypatch.setattr(db, "_pil", _no_pillow)
    text_side = DatasetBatch(chosen, CONFIG, SCALER)
    text = text_side.text_inputs([0, 1, 2, 3])
    assert text.token_ids.numel() == int(text_side.shapes.seq_len.sum())
    assert text_side.stats == {"units_rendered": 0, "images_decoded": 0, "samples_tokenised": 4}
    text_side.text_inputs([1])  # cached: the compare mode runs a step twice
    assert text_side.stats["samples_tokenised"] == 4


def test_a_tokenizer_changes_tokens_not_shapes():
    class Tokenizer:
        name_or_path = "fake"

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return [1000 + len(w) for w in text.split()]

    records = _records().records
    plain = DatasetBatch(records, CONFIG, SCALER)
    tokenized = DatasetBatch(records, CONFIG, SCALER, tokenizer=Tokenizer())
    np.testing.assert_array_equal(plain.shapes.seq_len, tokenized.shapes.seq_len)
    np.testing.assert_array_equal(plain.target_tokens(), tokenized.target_tokens())
    ids = tokenized.text_inputs(range(len(records))).token_ids
    assert int(ids.max()) < CONFIG.decoder.vocab_size
    assert not torch.equal(ids, plain.text_inputs(range(len(records))).token_ids)


def test_draw_matches_the_distribution_sample():
    records = _records()
    scaled = SCALER.scale(records.distribution.sample(12, seed=9))
    batch = DatasetBatch(records.draw(12, seed=9), CONFIG, SCALER)
    for name in ("encoder_units", "llm_visual_tokens", "text_tokens", "modality"):
        np.testing.assert_array_equal(getattr(batch.shapes, name), getattr(scaled, name))


# ---------------------------------------------------------------- errors


def test_unreadable_records_name_file_and_index(tmp_path):
    raws = {
        r.data.get("id") if isinstance(r.data, dict) else None: r
        for r in iter_samples(JSON, image_folder=IMAGES, video_folder=VIDEOS)
    }
    with pytest.raises(DatasetSampleError, match=r"llava_mini\.json: sample 25: unreadable_image"):
        DatasetBatch([raws["single-0"], raws["corrupt-image"]], CONFIG, SCALER)
    with pytest.raises(DatasetSampleError, match=r"sample 16: video_without_frames.*extract"):
        DatasetBatch([raws["video-file-meta"]], CONFIG, SCALER)
    with pytest.raises(DatasetSampleError, match=r"sample 20: missing_image.*not_here\.png"):
        DatasetBatch([raws["meta-wh-no-file"]], CONFIG, SCALER)
    # A file whose header parses but whose pixels do not: found when decoding, and only
    # by the ranks that decode it.
    shutil.copy(os.path.join(IMAGES, "photo_640x480.png"), tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[:120])
    record = {
        "id": "cut",
        "image": "truncated.png",
        "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
    }
    batch = DatasetBatch([record], CONFIG, SCALER, image_folder=tmp_path)
    batch.text_inputs([0])
    with pytest.raises(DatasetSampleError, match=r"batch sample 0 \(id 'cut'\).*truncated\.png"):
        batch.pixel_values([0])


def test_missing_pillow_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match="pip install pillow"):
        db._pil()


# ---------------------------------------------------------------- a pipelined step

BATCH_IDS = ["single-0", "multi-2", "video-frames", "text-1", "single-9", "text-long"]
ASSIGNMENT = [0, 1, 0, 1, 1, 0]


# DecoderConfig.image_newline: a per-sample row after all of a sample's units (here after
# the last image of "multi-2" and the last frame of "video-frames").
NEWLINE_CONFIG = dataclasses.replace(
    CONFIG, decoder=dataclasses.replace(CONFIG.decoder, image_newline=True)
)


def _global_batch(config=CONFIG) -> DatasetBatch:
    recs = _by_id(_records().records)
    return DatasetBatch([recs[k] for k in BATCH_IDS], config, ShapeScaler.for_model(config))


def _step_plan(
    batch: DatasetBatch, encoder_dp: int, config=CONFIG
) -> tuple[RuntimeLayout, StepPlan]:
    layout = RuntimeLayout.simple(
        encoder_dp=encoder_dp,
        encoder_layers=CONFIG.vision.layers,
        llm_layers=CONFIG.decoder.layers,
        num_microbatches=2,
        global_batch=len(BATCH_IDS),
    )
    shapes = batch.shapes
    costs = np.stack([shapes.encoder_tokens, shapes.seq_len], axis=1).astype(float)
    schedule = schedule_from_assignment(costs, ASSIGNMENT, 2, 1, microbatch_dims=[0])
    plan = StepPlan.build(
        schedule,
        shapes,
        layout,
        batch.target_tokens(),
        tokens_per_unit=TPU,
        visual_newline=config.decoder.image_newline,
    )
    return layout, plan


def _rank_step(rank: int, world_size: int, encoder_dp: int, config=CONFIG):
    batch = _global_batch(config)  # every rank builds it from the same records
    layout, plan = _step_plan(batch, encoder_dp, config)
    topology = Topology.create(layout, rank)
    stage = build_stage(config, topology.info, seed=MODEL_SEED)
    result = PipelineEngine(topology, stage).run_step(plan, batch)
    prefix = "vision." if topology.info.module == "encoder" else "decoder."
    grads = {
        prefix + n: p.grad.numpy().copy() for n, p in stage.named_parameters() if p.grad is not None
    }
    return result.loss_sum, result.num_target_tokens, batch.stats, grads


@pytest.mark.parametrize(
    ("encoder_dp", "config"),
    [(1, CONFIG), (2, CONFIG), (2, NEWLINE_CONFIG)],
    ids=["dp1", "dp2", "dp2-image_newline"],
)
def test_pipelined_step_on_real_records_matches_single_process(encoder_dp, config):
    if encoder_dp > 1:  # the real tiles and frames of single samples are shared
        _, plan = _step_plan(_global_batch(config), encoder_dp, config)
        assert any(
            np.unique(mb.split.sample_ids).size < mb.split.num_pieces for mb in plan.microbatches
        )
    results = spawn_local(
        _rank_step, 1 + encoder_dp, args=(encoder_dp, config), timeout_s=60.0, num_threads=1
    )
    torch.set_num_threads(1)
    model = build_model(config, seed=MODEL_SEED)
    batch = _global_batch(config)
    sum_loss, num_targets = model(**batch.model_inputs(np.arange(len(BATCH_IDS))))
    (sum_loss / num_targets).backward()
    ref = {name: p.grad.numpy() for name, p in model.named_parameters()}
    *encoders, llm = results
    for loss_sum, targets, _, _ in results:
        assert targets == int(num_targets) == int(batch.target_tokens().sum())
        assert loss_sum == pytest.approx(sum_loss.item(), rel=1e-5)
    # Encoder ranks decoded but never tokenised; the LLM rank the opposite.
    for encoder in encoders:
        assert encoder[2]["samples_tokenised"] == 0 and encoder[2]["images_decoded"] > 0
    assert llm[2]["images_decoded"] == 0 and llm[2]["samples_tokenised"] == len(BATCH_IDS)
    seen = set()
    for *_, grads in results:
        for name, grad in grads.items():
            tol = 1e-6 + 1e-4 * float(np.abs(ref[name]).max())
            assert float(np.abs(grad - ref[name]).max()) <= tol, name
            seen.add(name)
    assert seen == set(ref)
