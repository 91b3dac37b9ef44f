"""LLaVA-OneVision from transformers under dflop's runtime (tiny config, CPU, gloo).

The reference is the unmodified ``LlavaOnevisionForConditionalGeneration`` run on each
sample alone (its own anyres packing, pooling, newline rows and loss); dflop's split model
(encoder replicas, LLM pipeline stages, samples packed into microbatches) must give the
same summed loss and the same gradients for every parameter. The weights reach dflop's
ranks through a checkpoint folder written by ``save_pretrained`` (the stage loader reads
the original keys), and dflop's own checkpoint writer round-trips through
``from_pretrained``.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflop.models.hf import hf_model_spec, spec_from_config  # noqa: E402
from dflop.models.hf.tiny import tiny_llava_onevision_config  # noqa: E402
from dflop.models.spec import VisualItem  # noqa: E402
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
from transformers.models.llava_onevision.modeling_llava_onevision import (  # noqa: E402
    image_size_to_num_patches,
)

MODEL_SEED, DATA_SEED = 5, 11
SPAWN_TIMEOUT_S = 120.0
# Per sample: ("image", (h, w)) anyres single image, ("tiles", n) multi-image,
# ("video", frames), or None (text-only). Sizes exercise wide, tall, small and large
# images (the last one is downsampled by anyres_max_4).
SAMPLES = [
    ("image", (50, 90)),
    None,
    ("image", (120, 40)),
    ("tiles", 2),
    ("video", 3),
    ("image", (20, 20)),
    None,
    ("image", (96, 96)),
]
TEXT_TOKENS = [9, 12, 7, 10, 8, 6, 15, 5]


def _config():
    config = tiny_llava_onevision_config()
    config._attn_implementation = "sdpa"
    return config


def _hf_model(config):
    torch.manual_seed(MODEL_SEED)
    return transformers.LlavaOnevisionForConditionalGeneration(config)


def _visual(config, model, kind, arg, rng):
    """(pixels [U, C, S, S], items, number of LLM visual rows by the HF model's own code,
    placeholder id)."""
    side = config.vision_config.image_size
    if kind == "image":
        units = image_size_to_num_patches(arg, config.image_grid_pinpoints, side)
        items = (VisualItem("image", units, *arg),)
    elif kind == "tiles":
        units = arg
        items = tuple(VisualItem("tile", 1) for _ in range(arg))
    else:
        units = arg
        items = (VisualItem("video", arg),)
    pixels = torch.from_numpy(rng.standard_normal((units, 3, side, side))).float()
    with torch.no_grad():
        if kind == "video":
            out = model.model.get_video_features(pixels[None], return_dict=True)
            rows = out.pooler_output.shape[1]
        else:
            sizes = torch.tensor([list(arg)] if kind == "image" else [[side, side]] * units)
            out = model.model.get_image_features(
                pixels,
                sizes,
                batch_num_images=None if kind == "image" else torch.tensor([units]),
                return_dict=True,
            )
            rows = sum(f.shape[0] for f in out.pooler_output)
    token = config.video_token_index if kind == "video" else config.image_token_index
    return pixels, items, rows, token


def _samples(config) -> list[ProcessedSample]:
    model = _hf_model(config)
    rng = np.random.default_rng(DATA_SEED)
    vocab = config.text_config.vocab_size - 2  # text ids avoid the placeholder ids
    placeholders = (config.image_token_index, config.video_token_index)
    samples = []
    for spec, text in zip(SAMPLES, TEXT_TOKENS):
        ids = torch.from_numpy(rng.integers(0, vocab, text)).long()
        pixels, items, rows, token = None, (), 0, None
        if spec is not None:
            pixels, items, rows, token = _visual(config, model, spec[0], spec[1], rng)
        prompt = text // 2
        input_ids = torch.cat([ids[:2], torch.full((rows,), token or 0), ids[2:]])[: text + rows]
        labels = input_ids.clone()
        labels[: 2 + rows + prompt - 2] = -100  # prompt and placeholders carry no loss
        samples.append(ProcessedSample(input_ids, labels, pixels, items, placeholders))
    return samples


def _hf_forward(model, config, sample: ProcessedSample):
    """The unmodified model's mean loss on one sample alone."""
    fields = spec_from_config(config).dataset_inputs().model_fields(sample)
    fields["input_ids"], fields["labels"] = sample.input_ids[None], sample.labels[None]
    return model(**fields).loss


def _reference(config, samples, trainable="full"):
    model = _hf_model(config)
    freeze_reference(model, spec_from_config(config), trainable, MODEL_SEED)
    targets = ProcessedBatch(samples, 16).target_tokens()
    loss_sum, grads = reference_step(
        model, samples, targets, lambda m, sample: _hf_forward(m, config, sample)
    )
    return loss_sum, int(targets.sum()), grads


def _rank_step(rank, world_size, folder, layout_kw, assignment, trainable="full", order=None):
    spec = hf_model_spec(folder)
    batch = ProcessedBatch(_samples(spec.config), spec.tokens_per_unit)
    return run_rank_step(rank, spec, batch, layout_kw, assignment, MODEL_SEED, trainable, order)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava_ov_tiny")
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
    """Frozen parts: the loss and every trainable gradient equal transformers' with the
    same parts frozen; frozen stages run no backward."""
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


@pytest.mark.parametrize(
    "trainable, layout", [("full", 0), ("encoder=lora,llm=lora", 2)], ids=["full", "lora_both-tp2"]
)
def test_zero_bubble_h1_matches_transformers(checkpoint, trainable, layout):
    """ZB-H1's split backward (I then W) on the HF family: the loss and every trainable
    gradient equal transformers', under tensor parallelism with LoRA adapters too."""
    layout_kw, assignment, world = LAYOUTS[layout]
    config = _config()
    ref_loss, _, ref_grads = _reference(config, _samples(config), trainable)
    results = spawn_local(
        _rank_step,
        world,
        args=(checkpoint, layout_kw, assignment, trainable, "zb-h1"),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert_matches(results, ref_loss, ref_grads, layout_kw)
    assert all(r["kinds"] == ["F", "I", "W"] for r in results if r["backward_passes"])


def test_packed_samples_do_not_see_each_other(reference):
    """Two samples packed into one sequence give each one's loss and gradients alone."""
    config = _config()
    spec = spec_from_config(config)
    samples = _samples(config)
    batch = ProcessedBatch(samples, spec.tokens_per_unit)
    info = _single_stage_info(spec)
    stage = build_stage(spec, info, seed=MODEL_SEED)

    def run(ids):
        stage.zero_grad(set_to_none=True)
        text = batch.text_inputs(ids)
        x = stage.embed(text.token_ids)
        loss, n = stage.loss(x, text.cu_seqlens, text.labels)
        loss.backward()
        return loss.item(), {
            k: p.grad.clone() for k, p in stage.named_parameters() if p.grad is not None
        }

    together_loss, together = run([1, 6])
    alone = [run([i]) for i in (1, 6)]
    assert together_loss == pytest.approx(alone[0][0] + alone[1][0], rel=1e-5)
    for name, grad in together.items():
        expected = alone[0][1][name] + alone[1][1][name]
        assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-6), name


def _single_stage_info(spec):
    layout = RuntimeLayout.simple(
        encoder_layers=spec.encoder_layers,
        llm_layers=spec.llm_layers,
        num_microbatches=1,
        global_batch=8,
    )
    return rank_info(layout, 1)  # the LLM's only rank


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
    original = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(checkpoint)
    reloaded = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        str(tmp_path / "out")
    )
    ours = reloaded.state_dict()
    for name, value in original.state_dict().items():
        assert torch.equal(value, ours[name]), name


@pytest.mark.parametrize("released", [False, True], ids=["tiny", "released_defaults"])
def test_shape_rules_match_the_model(released):
    """dflop's anyres/multi-image/video rules, derived from the config, give the units and
    LLM visual tokens the model's own code gives (random sizes, incl. extreme aspect
    ratios and images large enough to be downsampled); for the tiny config and for
    transformers' default config (the released models' SigLIP-384 / 14 px, 6 x 6 grids,
    anyres_max_9)."""
    from types import SimpleNamespace

    from dflop.data.families import image_shapes, multi_image_shapes, video_shapes
    from dflop.models.hf.llava_onevision import family_from_config
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
    )

    config = transformers.LlavaOnevisionConfig() if released else _config()
    family = family_from_config(config)
    if released:  # dflop's built-in family is exactly the released models' rule
        from dflop.data.families import get_family

        assert family == get_family("llava-ov")
    holder = SimpleNamespace(config=config)  # what the model's own methods read
    side = config.vision_config.image_size
    tile_tokens, newline = family.encoder_tokens_per_tile, torch.zeros(4)
    rng = np.random.default_rng(0)
    scale = 12 if released else 1
    sizes = [(1, 1), (32, 32), (33, 31), (20, 300), (300, 20), (96, 97), (500, 500)]
    sizes = [(h * scale, w * scale) for h, w in sizes]
    sizes += [tuple(int(v) for v in rng.integers(1, 400 * scale, 2)) for _ in range(40)]
    for h, w in sizes:
        units = image_size_to_num_patches((h, w), config.image_grid_pinpoints, side)
        packed, _ = LlavaOnevisionModel.pack_image_features(
            holder,
            [torch.zeros(units, tile_tokens, 4)],
            torch.tensor([[h, w]]),
            newline,
            config.vision_aspect_ratio,
        )
        ours_units, ours_tokens = image_shapes(family, w, h)
        assert (int(ours_units[0]), int(ours_tokens[0])) == (units, packed[0].shape[0]), (h, w)
    units, tokens = multi_image_shapes(family, [0, 0, 0], [10, 20, 30], [30, 20, 10], 1)
    packed, _ = LlavaOnevisionModel.pack_image_features(
        holder, [torch.zeros(1, tile_tokens, 4)] * 3, torch.tensor([[side, side]] * 3), newline
    )
    assert (int(units[0]), int(tokens[0])) == (3, sum(f.shape[0] for f in packed))
    frames, tokens = video_shapes(family, 5)
    pooled = LlavaOnevisionModel.apply_pooling(holder, torch.zeros(5, tile_tokens, 4))
    assert (int(frames[0]), int(tokens[0])) == (5, pooled.shape[0] * pooled.shape[1] + 1)


LLAVA_MINI = "tests/data/llava_mini"
TRAIN_RECORDS = [0, 5, 9, 10, 12, 13, 17, 18]  # sizes 16 px .. 2480 x 3508, multi-image, text


def _real_samples(config, lazy=False):
    """The shipped real-format records through the model's own image processor."""
    import json
    import os

    inputs = spec_from_config(config).dataset_inputs()
    root = os.path.join(DATA_DIR, "llava_mini")
    with open(os.path.join(root, "llava_mini.json")) as f:
        records = json.load(f)
    return [
        inputs.sample(
            records[i],
            image_folder=os.path.join(root, "images"),
            where=f"record {i}",
            lazy=lazy,
        )
        for i in TRAIN_RECORDS
    ]


def _train_rank(rank, world_size, steps):
    """A few optimizer steps of the tiny model on the real records; the losses."""
    spec = spec_from_config(_config())
    batch = ProcessedBatch(_real_samples(spec.config), spec.tokens_per_unit)
    layout_kw = dict(encoder_dp=2, num_microbatches=2)
    layout, plan = step_plan(spec, batch, layout_kw, [0, 1, 0, 1, 0, 1, 0, 1])
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


def test_trains_on_real_records():
    """Real images (16 px to 2480 x 3508, multi-image) through the HF image processor,
    encoder dp 2: the loss falls over a few steps, and every rank reports the same."""
    results = spawn_local(_train_rank, 3, args=(6,), timeout_s=SPAWN_TIMEOUT_S, num_threads=1)
    losses = results[0]
    assert all(np.allclose(r, losses) for r in results)
    assert losses[-1] < 0.8 * losses[0], losses


def test_lazy_samples_load_what_eager_ones_hold():
    """Lazy samples (sizes from headers, pixels on first use) give the eager tensors."""
    eager = ProcessedBatch(_real_samples(_config()), 16)
    lazy = ProcessedBatch(_real_samples(_config(), lazy=True), 16)
    for name in ("encoder_units", "llm_visual_tokens", "text_tokens", "modality"):
        assert np.array_equal(getattr(lazy.shapes, name), getattr(eager.shapes, name)), name
    ids = list(range(len(eager)))
    pixels = lazy.pixel_values(ids)
    assert torch.equal(pixels, eager.pixel_values(ids))
    lazy.release_pixels()  # what the runtime does once a step's pieces are read
    assert torch.equal(lazy.pixel_values(ids), pixels)  # decoded again, the same
    # The planner prices the pixels the runtime holds: bytes per encoder token.
    from dflop.planner.model import planner_modules

    spec = spec_from_config(_config())
    encoder_tokens = int(lazy.shapes.encoder_units.sum()) * spec.tokens_per_unit
    priced = planner_modules(*spec.architecture())[0].input_bytes_per_token
    assert priced == pixels.numel() * pixels.element_size() / encoder_tokens
    assert torch.equal(lazy.text_inputs(ids).token_ids, eager.text_inputs(ids).token_ids)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_corrupt_image_is_named(lazy):
    import json
    import os

    root = os.path.join(DATA_DIR, "llava_mini")
    with open(os.path.join(root, "llava_mini.json")) as f:
        record = json.load(f)[25]
    inputs = spec_from_config(_config()).dataset_inputs()
    with pytest.raises(ValueError, match=r"record 25: cannot (decode|read) .*corrupt\.png"):
        sample = inputs.sample(
            record, image_folder=os.path.join(root, "images"), where="record 25", lazy=lazy
        )
        ProcessedBatch([sample], 16).pixel_values([0])


def _tied_config():
    config = _config()
    config.tie_word_embeddings = True
    config.text_config.tie_word_embeddings = True
    return config


def test_tied_embeddings_over_pipeline_stages(tmp_path):
    """A head tied to the token embedding (LLaVA-OneVision 0.5B ties them), the LLM split
    over 2 stages, loaded from a checkpoint that stores the tied weight once: both copies
    get the tied parameter's whole gradient (the transformers model's), and the saved
    checkpoint stores it once and loads with from_pretrained."""
    config = _tied_config()
    folder = str(tmp_path / "tied")
    _hf_model(config).save_pretrained(folder)
    ref_loss, _, ref_grads = _reference(config, _samples(config))
    layout_kw = dict(llm_pp=2, num_microbatches=2)
    results = spawn_local(
        _rank_step,
        3,
        args=(folder, layout_kw, [0, 1, 0, 1, 0, 1, 0, 1]),
        timeout_s=SPAWN_TIMEOUT_S,
        num_threads=1,
    )
    assert results[0]["loss_sum"] == pytest.approx(ref_loss, rel=1e-5)
    embed = "model.language_model.embed_tokens.weight"
    first, last = results[1]["grads"], results[2]["grads"]
    tol = 1e-6 + 1e-4 * float(np.abs(ref_grads[embed]).max())
    assert float(np.abs(first[embed] - ref_grads[embed]).max()) <= tol
    assert float(np.abs(last["lm_head.weight"] - ref_grads[embed]).max()) <= tol
    # Saved once; from_pretrained re-ties it.
    _save_from_stages(hf_model_spec(folder), str(tmp_path / "out"), llm_pp=2)
    reloaded = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        str(tmp_path / "out")
    )
    original = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(folder)
    assert reloaded.lm_head.weight is reloaded.model.language_model.embed_tokens.weight
    for name, value in original.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[name]), name


def _chatml_tokenizer(folder, texts):
    """A small BPE tokenizer with ChatML's special tokens, saved like a checkpoint's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=250, special_tokens=specials))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    fast.save_pretrained(folder)
    return fast


def test_records_follow_the_chat_template(tmp_path):
    """With a checkpoint tokenizer that has ChatML's tokens, a record is laid out as the
    chat template: the system turn, each turn inside <|im_start|>role ... <|im_end|>, the
    image placeholders in the user turn; the answer and its end of turn are the labels."""
    import json
    import os

    from dflop.models.hf.tiny import save_tiny_llava_onevision

    root = os.path.join(DATA_DIR, "llava_mini")
    with open(os.path.join(root, "llava_mini.json")) as f:
        records = json.load(f)
    folder = save_tiny_llava_onevision(str(tmp_path / "ov"), weights=False)
    texts = [t["value"] for r in records for t in r.get("conversations") or [] if "value" in t]
    tokenizer = _chatml_tokenizer(folder, texts)
    inputs = hf_model_spec(folder).dataset_inputs()
    assert inputs.template is not None
    record = records[0]
    sample = inputs.sample(record, image_folder=os.path.join(root, "images"))
    ids, labels = sample.input_ids.tolist(), sample.labels.tolist()
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    system = list(inputs.template.system)
    assert ids[: len(system)] == system and ids.count(start) == 1 + len(record["conversations"])
    assert ids.count(end) == ids.count(start)
    image = ids.index(inputs.config.image_token_index)
    user = inputs.template.header("human")
    assert ids[len(system) : len(system) + len(user)] == list(user) and image > len(system)
    answer = record["conversations"][-1]["value"]
    target = [t for t in labels if t != -100]
    encoded = tokenizer.encode(answer, add_special_tokens=False)
    assert target == encoded + list(inputs.template.footer)
    # The profiler's count of the record's text tokens matches the layout.
    turns = [(t["from"], t["value"]) for t in record["conversations"]]
    counted, counted_targets = inputs.text_counter().count_turns(turns)
    text_tokens = len(ids) - int(sample.placeholder_mask.sum())
    assert abs(counted - text_tokens) <= 2
    # ... and its count of the targets is exactly the labels' (what the loss runs on).
    assert counted_targets == len(target) == int(ProcessedBatch([sample], 16).target_tokens()[0])
