"""InternVL from transformers under dflop's runtime (tiny config, CPU, gloo).

The reference is the unmodified ``InternVLForConditionalGeneration`` run on each sample
alone (its own tower with the CLS token, pixel shuffle, projector, scatter into the
``<IMG_CONTEXT>`` positions and loss); dflop's split model (encoder replicas and tensor
parallelism, LLM pipeline stages, samples packed into microbatches) must give the same
summed loss and the same gradients for every parameter, on a batch of single images of
different tile counts, multi-image, video and text-only samples. The records of the
shipped real-format dataset go through the model's own image processor and are laid out
as transformers' ``InternVLProcessor`` lays them out; ``dflop train --model hf:DIR``
trains the tiny folder.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cli_harness import run_cli  # noqa: E402
from dflop.models.hf import hf_model_spec, spec_from_config  # noqa: E402
from dflop.models.hf.tiny import save_tiny, tiny_config  # noqa: E402
from dflop.models.spec import StageSlice, VisualItem  # noqa: E402
from dflop.runtime import RuntimeLayout, Topology, spawn_local  # noqa: E402
from dflop.runtime.engine import PipelineEngine, build_stage  # noqa: E402
from dflop.runtime.processed_batch import ProcessedBatch, ProcessedSample  # noqa: E402
from dflop.runtime.topology import rank_info  # noqa: E402
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
    step_plan,
)

MODEL_SEED, DATA_SEED = 5, 11
SPAWN_TIMEOUT_S = 120.0
LLAVA_MINI = os.path.join(DATA_DIR, "llava_mini")
# Per sample: ("image", [tiles per image]) one image or several (multi-image; each its own
# tile count, thumbnail included), ("video", frames), or None (text-only).
SAMPLES = [
    ("image", [5]),
    None,
    ("image", [1]),
    ("image", [3, 1]),
    ("video", 3),
    ("image", [7]),
    None,
    ("image", [2, 2, 1]),
]
TEXT_TOKENS = [9, 12, 7, 10, 8, 6, 15, 5]


def _config(**changes):
    config = tiny_config("internvl")
    for key, value in changes.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    return config


def _hf_model(config):
    torch.manual_seed(MODEL_SEED)
    return transformers.InternVLForConditionalGeneration(config)


def _samples(config) -> list[ProcessedSample]:
    """Text, then each image as <img> 16 x tiles <IMG_CONTEXT> </img> (a video's frames
    each so, after a frame label), then more text; pixels one tile per unit."""
    rng = np.random.default_rng(DATA_SEED)
    image = config.image_token_id
    start, end = image - 2, image - 1
    per_tile = 16
    side = config.vision_config.image_size[0]
    vocab = config.text_config.vocab_size - 3  # text ids avoid the special ids
    samples = []
    for spec, text in zip(SAMPLES, TEXT_TOKENS):
        ids = rng.integers(0, vocab, text).tolist()
        visual, items = [], []
        if spec is not None and spec[0] == "image":
            for tiles in spec[1]:
                visual += [start, *[image] * (per_tile * tiles), end]
                items.append(VisualItem("image", tiles))
        elif spec is not None:
            for _ in range(spec[1]):
                visual += [*rng.integers(0, vocab, 2).tolist(), start, *[image] * per_tile, end]
            items.append(VisualItem("video", spec[1]))
        input_ids = torch.tensor(ids[:2] + visual + ids[2:]).long()
        labels = input_ids.clone()
        labels[: 2 + len(visual) + text // 2 - 2] = -100  # prompt and images carry no loss
        units = sum(item.units for item in items)
        pixels = None
        if units:
            pixels = torch.from_numpy(rng.standard_normal((units, 3, side, side))).float()
        samples.append(ProcessedSample(input_ids, labels, pixels, tuple(items), (image,)))
    return samples


def _hf_forward(model, config, sample: ProcessedSample):
    """The unmodified model's mean loss on one sample alone."""
    fields = spec_from_config(config).dataset_inputs().model_fields(sample)
    fields["input_ids"], fields["labels"] = sample.input_ids[None], sample.labels[None]
    return model(**fields).loss


def _reference(config, samples, trainable="full"):
    model = _hf_model(config)
    freeze_reference(model, spec_from_config(config), trainable, MODEL_SEED)
    targets = ProcessedBatch(samples, 64).target_tokens()
    loss_sum, grads = reference_step(
        model, samples, targets, lambda m, sample: _hf_forward(m, config, sample)
    )
    return loss_sum, int(targets.sum()), grads


def _rank_step(rank, world_size, folder, layout_kw, assignment, trainable="full"):
    spec = hf_model_spec(folder)
    batch = ProcessedBatch(_samples(spec.config), spec.tokens_per_unit)
    return run_rank_step(rank, spec, batch, layout_kw, assignment, MODEL_SEED, trainable)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("internvl_tiny")
    _hf_model(_config()).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def reference():
    config = _config()
    return _reference(config, _samples(config))


@pytest.mark.parametrize("layout_kw, assignment, world", LAYOUTS, ids=LAYOUT_IDS)
def test_runtime_matches_transformers(checkpoint, reference, layout_kw, assignment, world):
    ref_loss, ref_targets, ref_grads = reference
    results = spawn_local(
        _rank_step,
        world,
        args=(checkpoint, layout_kw, assignment),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert all(r["targets"] == ref_targets for r in results)
    assert_matches(results, ref_loss, ref_grads, layout_kw)


@pytest.mark.parametrize("trainable, layout", FROZEN_CASES, ids=FROZEN_IDS)
def test_frozen_parts_match_transformers(checkpoint, trainable, layout):
    """Frozen parts (the projector is ``multi_modal_projector``, the rest of the encoder
    the tower): the loss and every trainable gradient equal transformers' with the same
    parts frozen; frozen stages run no backward."""
    layout_kw, assignment, world = LAYOUTS[layout]
    config = _config()
    ref_loss, _, ref_grads = _reference(config, _samples(config), trainable)
    results = spawn_local(
        _rank_step,
        world,
        args=(checkpoint, layout_kw, assignment, trainable),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert_matches(results, ref_loss, ref_grads, layout_kw)
    assert_backward_only_where_trained(results, trainable)


VARIANTS = {
    "released": {},
    # InternViT-6B's: RMSNorm, q/k norms, no q/k/v biases.
    "vit_6b_style": {"norm_type": "rms_norm", "use_qk_norm": True, "attention_bias": False},
    # the tower's final layernorm applies to the last hidden state
    "post_layernorm": {"use_mean_pooling": False},
    # an earlier layer's output (the layers after it never run)
    "feature_layer_-2": {"vision_feature_layer": -2},
    "feature_layer_1": {"vision_feature_layer": 1},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_encoder_stages_give_the_models_features(variant):
    """The encoder over one or two pipeline stages gives the model's own
    ``get_image_features`` (CLS token dropped, pixel shuffle, projector) for the tower
    variants InternVL checkpoints use; its gradients are the model's."""
    changes = dict(VARIANTS[variant])
    top = {k: changes.pop(k) for k in list(changes) if k == "vision_feature_layer"}
    config = tiny_config("internvl", vision_layers=3)
    for key, value in changes.items():
        setattr(config.vision_config, key, value)
    for key, value in top.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    spec = spec_from_config(config)
    model = _hf_model(config)
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    whole = model.model.get_image_features(pixels, return_dict=True).pooler_output.flatten(0, 1)
    layers = spec.encoder_layers
    assert layers == {"feature_layer_-2": 2, "feature_layer_1": 1}.get(variant, 3)
    cut = max(1, layers - 1)
    stages = [
        spec.build_stage(StageSlice("encoder", (0, cut), True, cut == layers), seed=MODEL_SEED)
    ]
    if cut < layers:
        stages.append(
            spec.build_stage(StageSlice("encoder", (cut, layers), False, True), seed=MODEL_SEED)
        )
    x = pixels
    for stage in stages:
        x = stage(x)
        if stage is not stages[-1]:
            assert x.shape == (4, stage.tokens_per_unit, stage.hidden_size)
    torch.testing.assert_close(x, whole, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(whole)
    whole.backward(grad)
    x.backward(grad)
    name = "model.multi_modal_projector.linear_1.weight"
    ours = stages[-1].get_parameter(name).grad
    torch.testing.assert_close(ours, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6)
    first = "model.vision_tower.encoder.layer.0.attention.q_proj.weight"
    ours = stages[0].get_parameter(first).grad
    torch.testing.assert_close(ours, model.get_parameter(first).grad, rtol=1e-4, atol=1e-6)


def _save_from_stages(spec, folder, **layout_kw):
    """Every stage of a pipeline over ``layout_kw`` built, their state saved together."""
    layout = RuntimeLayout.simple(
        **layout_kw,
        encoder_layers=spec.encoder_layers,
        llm_layers=spec.llm_layers,
        num_microbatches=1,
        global_batch=1,
    )
    state = {}
    for rank in range(layout.world_size):
        state.update(build_stage(spec, rank_info(layout, rank)).state_dict())
    spec.save_checkpoint(folder, state)


def test_checkpoint_round_trip(tmp_path, checkpoint):
    """Stages loaded from a folder, saved by dflop, load with from_pretrained unchanged."""
    _save_from_stages(hf_model_spec(checkpoint), str(tmp_path / "out"), encoder_pp=2, llm_pp=2)
    original = transformers.InternVLForConditionalGeneration.from_pretrained(checkpoint)
    reloaded = transformers.InternVLForConditionalGeneration.from_pretrained(str(tmp_path / "out"))
    ours = reloaded.state_dict()
    for name, value in original.state_dict().items():
        assert torch.equal(value, ours[name]), name


@pytest.mark.slow
def test_tied_embeddings_over_pipeline_stages(tmp_path):
    """InternVL's default ties the head to the token embedding; over 2 LLM stages both
    copies get the tied parameter's whole gradient (the transformers model's), and the
    saved checkpoint stores it once and loads with from_pretrained."""
    config = _config(tie_word_embeddings=True)
    config.text_config.tie_word_embeddings = True
    folder = str(tmp_path / "tied")
    _hf_model(config).save_pretrained(folder)
    ref_loss, _, ref_grads = _reference(config, _samples(config))
    results = spawn_local(
        _rank_step,
        3,
        args=(folder, dict(llm_pp=2, num_microbatches=2), [0, 1, 0, 1, 0, 1, 0, 1]),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert results[0]["loss_sum"] == pytest.approx(ref_loss, rel=1e-5)
    embed = "model.language_model.embed_tokens.weight"
    first, last = results[1]["grads"], results[2]["grads"]
    tol = 1e-6 + 1e-4 * float(np.abs(ref_grads[embed]).max())
    assert float(np.abs(first[embed] - ref_grads[embed]).max()) <= tol
    assert float(np.abs(last["lm_head.weight"] - ref_grads[embed]).max()) <= tol
    _save_from_stages(hf_model_spec(folder), str(tmp_path / "out"), llm_pp=2)
    reloaded = transformers.InternVLForConditionalGeneration.from_pretrained(str(tmp_path / "out"))
    assert reloaded.lm_head.weight is reloaded.model.language_model.embed_tokens.weight


# --------------------------------------------------------------------------- records


def _records():
    with open(os.path.join(LLAVA_MINI, "llava_mini.json")) as f:
        return json.load(f)


def _tokenizer(folder, texts):
    """A small BPE tokenizer with InternVL's special tokens (``<img>``, ``</img>``,
    ``<IMG_CONTEXT>``, ``<video>``), named as the released tokenizers name them; no ChatML
    tokens, so records are laid out without a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    tok.train_from_iterator(
        [*texts, "Frame1: Frame2: \n"],
        trainers.BpeTrainer(vocab_size=250, special_tokens=specials),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )
    fast.save_pretrained(folder)
    return fast


def _processor(folder):
    """transformers' own InternVLProcessor of the folder (image processor and tokenizer;
    its video processor needs torchvision, absent here, and is left out)."""

    class ImagesOnly(transformers.InternVLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImagesOnly(
        image_processor=transformers.AutoImageProcessor.from_pretrained(folder),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        video_processor=None,
        image_seq_length=16,
    )


@pytest.fixture(scope="module")
def tokenized_folder(tmp_path_factory):
    """The tiny folder (1 to 12 tiles per image, as released) with a tokenizer of
    InternVL's tokens, whose ``<IMG_CONTEXT>`` is the config's image token id."""
    folder = str(tmp_path_factory.mktemp("internvl_tok"))
    texts = [t["value"] for r in _records() for t in r.get("conversations") or [] if "value" in t]
    tokenizer = _tokenizer(folder, texts)
    save_tiny(folder, "internvl", weights=False, max_tiles=12)
    config = transformers.AutoConfig.from_pretrained(folder)
    config.image_token_id = tokenizer.context_image_token_id
    config.save_pretrained(folder)
    return folder


REAL_RECORDS = [0, 1, 2, 5, 9, 10, 12, 13, 17]  # 16 px .. 2480 x 3508, multi-image, text


def test_records_are_laid_out_as_the_processor_does(tokenized_folder):
    """Each image record's human turn is the processor's own input_ids for the same text
    (the ``<image>`` markers as its ``<IMG_CONTEXT>`` markers): ``<img>``, 16 context tokens
    per tile (tiles by the processor's crop_to_patches, thumbnail last), ``</img>``; the
    pixels are its pixel_values; multi-image records tile each image with max_patches //
    images; the answer is the labels."""
    spec = hf_model_spec(tokenized_folder)
    inputs = spec.dataset_inputs()
    assert inputs.template is None and spec.family.max_tiles == 12
    processor = _processor(tokenized_folder)
    tokenizer = processor.tokenizer
    assert inputs.wrap == (tokenizer.start_image_token_id, tokenizer.end_image_token_id)
    records = _records()
    images = os.path.join(LLAVA_MINI, "images")
    seen_tiles = set()
    for i in REAL_RECORDS:
        record = records[i]
        sample = inputs.sample(record, image_folder=images, where=f"record {i}")
        human, answer = (turn["value"] for turn in record["conversations"])
        names = record.get("image") or []
        names = [names] if isinstance(names, str) else names
        files = [os.path.join(images, n) for n in names]
        from PIL import Image

        pictures = [Image.open(f).convert("RGB") for f in files]
        text = human.replace("<image>", processor.image_token)
        if pictures and "<image>" not in human:
            text = processor.image_token * len(pictures) + text
        limit = max(1, 12 // max(1, len(pictures)))
        out = processor(
            text=text,
            images=pictures or None,
            max_patches=limit,
            return_tensors="pt",
        )
        expected = out["input_ids"][0].tolist() + tokenizer.encode(answer)
        assert sample.input_ids.tolist() == expected, i
        target = [t for t in sample.labels.tolist() if t != -100]
        assert target == tokenizer.encode(answer)
        if pictures:
            assert torch.equal(sample.pixel_values, out["pixel_values"])
            seen_tiles.update(item.units for item in sample.items)
        else:
            assert sample.pixel_values is None and "pixel_values" not in out
    assert {1, 5, 7, 13} <= seen_tiles, seen_tiles  # one tile, several grids


def test_video_records_are_laid_out_as_the_processor_does(tokenized_folder):
    """A frames folder: every frame one tile (resized, not cropped), at ``<video>`` the
    processor's ``Frame1: <img>...</img>\\nFrame2: ...``; a long video sampled to
    max_frames; the profile (what the planner samples) has the sample's units and visual
    tokens."""
    from dflop.data.reader import read_records
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    spec = hf_model_spec(tokenized_folder)
    inputs = spec.dataset_inputs()
    processor = _processor(tokenized_folder)
    tokenizer = processor.tokenizer
    records = _records()
    videos = os.path.join(LLAVA_MINI, "videos")
    record = next(r for r in records if r.get("video") == "clip_frames")
    sample = inputs.sample(record, video_folder=videos)
    frames = sorted(
        n for n in os.listdir(os.path.join(videos, "clip_frames")) if n.endswith(".jpg")
    )
    (item,) = sample.items
    assert item.kind == "video" and item.units == len(frames)
    # The processor's own replacement text for a video of these frames.
    video_inputs = {"pixel_values_videos": [torch.zeros(len(frames), 3, 32, 32)]}
    replaced = InternVLProcessor.replace_video_token(processor, video_inputs, 0)
    human, answer = (turn["value"] for turn in record["conversations"])
    text = human.replace("<video>", replaced)
    expected = tokenizer(text)["input_ids"] + tokenizer.encode(answer)
    assert sample.input_ids.tolist() == expected
    from PIL import Image

    pictures = [Image.open(os.path.join(videos, "clip_frames", n)).convert("RGB") for n in frames]
    alone = processor.image_processor(pictures, crop_to_patches=False, return_tensors="pt")
    assert torch.equal(sample.pixel_values, alone["pixel_values"])
    assert int(sample.placeholder_mask.sum()) == 16 * len(frames)
    long = inputs.frames([f"f{k}" for k in range(100)])
    assert len(long) == 32 and long[0] == "f0" and long[-1] == "f99"
    # The profile's units and visual tokens are the converter's (the <img> / </img> pairs
    # counted as visual; the frame labels are text).
    found = read_records(
        os.path.join(LLAVA_MINI, "llava_mini.json"),
        family=spec.family,
        image_folder=os.path.join(LLAVA_MINI, "images"),
        video_folder=videos,
        text_counter=inputs.text_counter(),
    )
    shapes = found.distribution.samples
    by_id = {r.data.get("id"): k for k, r in enumerate(found.records)}
    k = by_id[record["id"]]
    assert int(shapes.encoder_units[k]) == len(frames)
    assert int(shapes.llm_visual_tokens[k]) == (16 + 2) * len(frames)
    for i in REAL_RECORDS:
        if records[i].get("id") not in by_id:
            continue
        k = by_id[records[i]["id"]]
        image_sample = inputs.sample(
            records[i], image_folder=os.path.join(LLAVA_MINI, "images"), lazy=True
        )
        assert int(shapes.encoder_units[k]) == image_sample.units, i
        wraps = 2 * len(image_sample.items)
        visual = int(image_sample.placeholder_mask.sum()) + wraps
        assert int(shapes.llm_visual_tokens[k]) == visual, i


def _real_samples(config, lazy=False, records=REAL_RECORDS):
    inputs = spec_from_config(config).dataset_inputs()
    data = _records()
    return [
        inputs.sample(
            data[i],
            image_folder=os.path.join(LLAVA_MINI, "images"),
            video_folder=os.path.join(LLAVA_MINI, "videos"),
            where=f"record {i}",
            lazy=lazy,
        )
        for i in records
    ]


def test_lazy_samples_load_what_eager_ones_hold():
    """Lazy samples (tile counts from headers, pixels on first use) give the eager
    tensors; the planner prices the pixels the runtime holds."""
    config = _config()
    spec = spec_from_config(config)
    eager = ProcessedBatch(_real_samples(config), spec.tokens_per_unit)
    lazy = ProcessedBatch(_real_samples(config, lazy=True), spec.tokens_per_unit)
    for name in ("encoder_units", "llm_visual_tokens", "text_tokens", "modality"):
        assert np.array_equal(getattr(lazy.shapes, name), getattr(eager.shapes, name)), name
    ids = list(range(len(eager)))
    pixels = lazy.pixel_values(ids)
    assert torch.equal(pixels, eager.pixel_values(ids))
    from dflop.planner.model import planner_modules

    encoder_tokens = int(lazy.shapes.encoder_units.sum()) * spec.tokens_per_unit
    priced = planner_modules(*spec.architecture())[0].input_bytes_per_token
    assert priced == pixels.numel() * pixels.element_size() / encoder_tokens
    assert torch.equal(lazy.text_inputs(ids).token_ids, eager.text_inputs(ids).token_ids)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_corrupt_image_is_named(lazy):
    record = _records()[25]
    inputs = spec_from_config(_config()).dataset_inputs()
    with pytest.raises(ValueError, match=r"record 25: cannot (decode|read) .*corrupt\.png"):
        sample = inputs.sample(
            record, image_folder=os.path.join(LLAVA_MINI, "images"), where="record 25", lazy=lazy
        )
        ProcessedBatch([sample], 64).pixel_values([0])


TRAIN_RECORDS = [0, 5, 9, 10, 12, 13, 14, 17]  # sizes 16 px .. 2480 x 3508, multi, video


def _train_rank(rank, world_size, steps):
    """A few optimizer steps of the tiny model on the real records; the losses."""
    spec = spec_from_config(_config())
    batch = ProcessedBatch(_real_samples(spec.config, records=TRAIN_RECORDS), spec.tokens_per_unit)
    layout, plan = step_plan(spec, batch, dict(encoder_dp=2, num_microbatches=2), [0, 1] * 4)
    topology = Topology.create(layout, rank)
    stage = build_stage(spec, topology.info, seed=MODEL_SEED)
    engine = PipelineEngine(topology, stage)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        result = engine.run_step(plan, batch)
        optimizer.step()
        losses.append(result.loss)
    return losses


@pytest.mark.slow
def test_trains_on_real_records():
    """Real images (16 px to 2480 x 3508, multi-image) and video frames through the HF
    image processor, encoder dp 2: the loss falls over a few steps, and every rank
    reports the same."""
    results = spawn_local(_train_rank, 3, args=(6,), timeout_s=SPAWN_TIMEOUT_S, num_threads=1)
    losses = results[0]
    assert all(np.allclose(r, losses) for r in results)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
def test_train_cli_on_real_records(tmp_path, quick_perf):
    """``dflop train --model hf:DIR`` on the tiny folder and the real-format records
    (images of any size as dynamic tiles, multi-image, video frames, text-only) with an
    LLM pipeline of 2 stages: the loss falls, and the saved Hugging Face folder loads
    with from_pretrained with the encoder, projector and head trained."""
    folder = save_tiny(str(tmp_path / "tiny"), "internvl", seed=3)
    out, metrics = tmp_path / "trained", tmp_path / "metrics.json"
    result = run_cli(
        "train",
        "--model",
        f"hf:{folder}",
        "--data",
        os.path.join(LLAVA_MINI, "llava_mini.json"),
        "--image-folder",
        os.path.join(LLAVA_MINI, "images"),
        "--video-folder",
        os.path.join(LLAVA_MINI, "videos"),
        "--layout",
        "enc_dp=1,llm_pp=2,m=2",
        "--steps",
        "8",
        "--global-batch",
        "6",
        "--lr",
        "3e-3",
        "--save-hf",
        str(out),
        "--json",
        str(metrics),
        "--quiet",
        "--perf",
        quick_perf(f"hf:{folder}"),
        timeout_s=600.0,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    losses = [step["loss"] for step in json.loads(metrics.read_text())["steps"]]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.85 * np.mean(losses[:2]), losses
    cls = transformers.InternVLForConditionalGeneration
    before, after = cls.from_pretrained(folder).state_dict(), cls.from_pretrained(str(out))
    after = after.state_dict()
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert "lm_head.weight" in moved
    assert "model.multi_modal_projector.linear_1.weight" in moved
    assert any(k.startswith("model.vision_tower.encoder.layer.0.") for k in moved)
