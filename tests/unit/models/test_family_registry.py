"""A model family is one folder plus one registry line; tiling rules are strategy objects.

The Hugging Face families register through :mod:`dflop.models.hf.registry` (a fake family
built in a temporary folder goes through the same public registration), and every
``FamilySpec.tiling`` is a :class:`~dflop.data.families.TilingRule` of
:data:`~dflop.data.families.TILING_RULES`. The expected shapes below are hard numbers
recorded from the code before the rules became objects (the ``spec.tiling == ...``
branches of ``data/families.py`` and ``runtime/dataset_batch.py``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")  # dflop.models builds on torch

from dflop.data.families import (  # noqa: E402
    FAMILIES,
    TILING_RULES,
    FamilySpec,
    ImageUnit,
    get_family,
    image_shapes,
    multi_image_shapes,
    shapes_from_descriptors,
    tiling_rule,
    video_shapes,
)
from dflop.data.shapes import Modality  # noqa: E402
from dflop.models.hf import registry, spec_from_config  # noqa: E402
from dflop.models.hf import tiny as hf_tiny  # noqa: E402

BUILTIN_TYPES = ("llava_onevision", "qwen2_vl", "qwen2_5_vl", "internvl")
HF_DIR = Path(registry.__file__).resolve().parent

# --------------------------------------------------------------------------- the registry

FAKE_FAMILY = {
    "__init__.py": """
        from dflop.models.hf.family import HFFamily


        def _spec_class(model_type):
            from fake_vl_family.spec import FakeSpec

            return FakeSpec


        def _records_class(model_type):
            from fake_vl_family.records import FakeRecords

            return FakeRecords


        def _tiny_config(model_type, **sizes):
            from types import SimpleNamespace

            return SimpleNamespace(model_type=model_type, **sizes)


        def _save_tiny(folder, model_type, **options):
            import os

            with open(os.path.join(folder, "config.json"), "w") as f:
                f.write('{"model_type": "%s"}' % model_type)
            return folder


        FAMILY = HFFamily(
            name="fake_vl",
            model_types=("fake_vl", "fake_vl_2"),
            spec_class=_spec_class,
            records_class=_records_class,
            tiny_config=_tiny_config,
            save_tiny=_save_tiny,
            title="A fake family",
        )
    """,
    "spec.py": """
        class FakeSpec:
            def __init__(self, config, checkpoint_dir=None):
                self.config = config
                self.checkpoint_dir = checkpoint_dir
    """,
    "records.py": """
        class FakeRecords:
            pass
    """,
}


@pytest.fixture
def fake_family(tmp_path, monkeypatch):
    """The fake family's folder (a package outside dflop), registered for the test."""
    package = tmp_path / "fake_vl_family"
    package.mkdir()
    for name, text in FAKE_FAMILY.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("fake_vl_family")]:
        monkeypatch.delitem(sys.modules, name)
    import fake_vl_family

    family = registry.register_family(fake_vl_family.FAMILY)  # the one registry line
    yield family
    registry.unregister_family("fake_vl")


def _hf_families() -> tuple[str, ...]:
    import dflop.models.hf

    return dflop.models.hf.HF_FAMILIES


def test_the_builtin_families():
    assert _hf_families() == BUILTIN_TYPES
    names = [f.name for f in registry.BUILTIN_FAMILIES]
    assert names == ["llava_onevision", "qwen2_vl", "internvl"]
    assert registry.families() == registry.BUILTIN_FAMILIES
    assert registry.spec_class("llava_onevision").__name__ == "LlavaOnevisionSpec"
    assert registry.spec_class("qwen2_vl").__name__ == "Qwen2VLSpec"
    assert registry.spec_class("qwen2_5_vl").__name__ == "Qwen25VLSpec"
    assert registry.records_class("llava_onevision").__name__ == "LlavaOnevisionRecords"
    assert registry.records_class("qwen2_5_vl").__name__ == "QwenVLRecords"
    assert registry.spec_class("internvl").__name__ == "InternVLSpec"
    assert registry.records_class("internvl").__name__ == "InternVLRecords"


def test_every_family_folder_is_one_registry_line():
    """Each folder under models/hf is a family with one line in the registry's list."""
    folders = sorted(p.parent.name for p in HF_DIR.glob("*/__init__.py"))
    assert folders == sorted(f.name for f in registry.BUILTIN_FAMILIES)
    source = (HF_DIR / "registry.py").read_text()
    for name in folders:
        lines = [line for line in source.splitlines() if f'"dflop.models.hf.{name}"' in line]
        assert len(lines) == 1, (name, lines)


def test_a_registered_family_is_found_by_model_type(fake_family, tmp_path):
    assert _hf_families() == (*BUILTIN_TYPES, "fake_vl", "fake_vl_2")
    assert registry.family_for("fake_vl_2") is fake_family
    config = SimpleNamespace(model_type="fake_vl_2")
    spec = spec_from_config(config, checkpoint_dir="somewhere")
    assert type(spec).__name__ == "FakeSpec"
    assert spec.config is config and spec.checkpoint_dir == "somewhere"
    assert registry.records_class("fake_vl").__name__ == "FakeRecords"
    tiny = hf_tiny.tiny_config("fake_vl", text_layers=1)
    assert (tiny.model_type, tiny.text_layers) == ("fake_vl", 1)
    folder = hf_tiny.save_tiny(str(tmp_path), "fake_vl_2")
    assert (Path(folder) / "config.json").read_text() == '{"model_type": "fake_vl_2"}'
    with pytest.raises(ValueError) as err:
        spec_from_config(SimpleNamespace(model_type="bert"))
    assert str(err.value) == (
        "config.model_type='bert' has no dflop adapter; supported: llava_onevision, "
        "qwen2_vl, qwen2_5_vl, internvl, fake_vl, fake_vl_2"
    )


def test_unregistering_restores_the_builtin_families(fake_family):
    registry.unregister_family("fake_vl")
    try:
        assert _hf_families() == BUILTIN_TYPES
        with pytest.raises(ValueError, match="'fake_vl' has no dflop adapter"):
            spec_from_config(SimpleNamespace(model_type="fake_vl"))
    finally:
        registry.register_family(fake_family)


def test_the_unknown_model_type_error_names_the_supported_ones():
    for config in (SimpleNamespace(model_type="bert"), SimpleNamespace()):
        with pytest.raises(ValueError) as err:
            spec_from_config(config)
        model_type = getattr(config, "model_type", None)
        assert str(err.value) == (
            f"config.model_type={model_type!r} has no dflop adapter; supported: "
            "llava_onevision, qwen2_vl, qwen2_5_vl, internvl"
        )
    with pytest.raises(ValueError, match="has no dflop adapter; supported: llava_onevision"):
        hf_tiny.tiny_config("bert")


def test_a_model_type_belongs_to_one_family(fake_family):
    from dataclasses import replace

    with pytest.raises(ValueError, match="named 'fake_vl' is registered already"):
        registry.register_family(fake_family)
    thief = replace(fake_family, name="thief", model_types=("qwen2_vl",))
    with pytest.raises(ValueError, match="'qwen2_vl' belongs to family 'qwen2_vl' already"):
        registry.register_family(thief)
    assert registry.family_for("qwen2_vl").name == "qwen2_vl"
    with pytest.raises(ValueError, match="no Hugging Face family named 'nope'"):
        registry.unregister_family("nope")
    with pytest.raises(ValueError, match="non-empty tuple"):
        replace(fake_family, model_types=())


def test_importing_the_registry_imports_no_transformers():
    code = (
        "import sys, dflop.models.hf, dflop.models.hf.tiny; "
        "from dflop.models.hf import HF_FAMILIES; "
        "assert HF_FAMILIES, HF_FAMILIES; "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- tiling rules


def test_the_tiling_names_are_the_strategy_table():
    assert sorted(TILING_RULES) == ["anyres", "dynamic", "native"]
    for name, rule in TILING_RULES.items():
        assert rule.name == name
        spec = FamilySpec("x", name, tile_px=32, encoder_tokens_per_tile=16, llm_tokens_per_tile=16)
        assert tiling_rule(spec) is rule
    for spec in FAMILIES.values():
        assert tiling_rule(spec.name) is TILING_RULES[spec.tiling]
    for bad in ("tiles", "", None):
        with pytest.raises(ValueError) as err:
            FamilySpec("x", bad, tile_px=32, encoder_tokens_per_tile=16, llm_tokens_per_tile=16)
        assert str(err.value) == (
            f"FamilySpec.tiling={bad!r} is not one of {', '.join(TILING_RULES)}"
        )
    assert ", ".join(TILING_RULES) == "anyres, dynamic, native"


W = [640, 1920, 2304, 300, 500, 28, 4000]
H = [480, 1080, 2304, 900, 500, 28, 50]

# Recorded from the code before the strategies (see the module docstring).
RECORDED = {
    "llava-ov": {
        "image": ([5, 16, 37, 4, 5, 2, 7], [2929, 7269, 7371, 2997, 3699, 1485, 1218]),
        "multi": ([2, 1, 3, 1, 0], [1460, 730, 2190, 730, 0]),
        "video": ([1, 7, 32, 32], [197, 1373, 6273, 6273]),
        "video_sized": ([1, 7, 32, 32], [197, 1373, 6273, 6273]),
        "descriptors": (
            [0, 5, 3, 9, 7, 32],
            [0, 729, 729, 729, 729, 729],
            [0, 2929, 2190, 1765, 1218, 6273],
        ),
    },
    "internvl": {
        "image": ([13, 9, 10, 4, 1, 1, 13], [3330, 2306, 2562, 1026, 258, 258, 3330]),
        "multi": ([10, 10, 6, 13, 0], [2564, 2562, 1542, 3330, 0]),
        "video": ([1, 7, 32, 32], [258, 1806, 8256, 8256]),
        "video_sized": ([1, 7, 32, 32], [258, 1806, 8256, 8256]),
        "descriptors": (
            [0, 13, 8, 9, 13, 32],
            [0, 1025, 1025, 1025, 1025, 1025],
            [0, 3330, 2054, 2322, 3330, 8256],
        ),
    },
    "qwen2-vl": {
        "image": ([1, 1, 1, 1, 1, 1, 1], [393, 1224, 1227, 354, 326, 6, 288]),
        "multi": ([2, 1, 3, 1, 0], [1617, 1227, 686, 288, 0]),
        "video": ([1, 4, 16, 16], [258, 1026, 4098, 4098]),
        "video_sized": ([1, 4, 16, 16], [393, 2882, 4098, 5634]),
        "descriptors": (
            [0, 1, 3, 5, 1, 16],
            [0, 1564, 2531, 1564, 1144, 1024],
            [0, 393, 1904, 1957, 288, 4098],
        ),
    },
}
MULTI_INDEX = [0, 0, 1, 2, 2, 2, 3]
FRAMES = [1, 7, 32, 100]
FRAME_W, FRAME_H = [640, 1920, 0, 300], [480, 1080, 0, 900]


def _lists(arrays) -> tuple[list[int], ...]:
    return tuple(np.asarray(a).tolist() for a in arrays)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_each_strategy_gives_the_recorded_shapes(name):
    recorded = RECORDED[name]
    spec = get_family(name)
    rule = tiling_rule(spec)
    w, h = np.array(W, dtype=np.float64), np.array(H, dtype=np.float64)
    # the strategy itself
    assert _lists(rule.image_shapes(spec, w, h)) == recorded["image"]
    idx = np.array(MULTI_INDEX)
    count = np.bincount(idx, minlength=5)
    assert _lists(rule.multi_image_shapes(spec, idx, w, h, count, 5)) == recorded["multi"]
    frames = np.minimum(np.array(FRAMES), spec.max_frames)
    assert _lists(rule.video_shapes(spec, frames)) == recorded["video"]
    sized = rule.video_shapes(spec, frames, np.array(FRAME_W), np.array(FRAME_H))
    assert _lists(sized) == recorded["video_sized"]
    # the public functions over it
    assert _lists(image_shapes(name, W, H)) == recorded["image"]
    assert _lists(multi_image_shapes(name, MULTI_INDEX, W, H, 5)) == recorded["multi"]
    assert _lists(video_shapes(name, FRAMES)) == recorded["video"]
    assert _lists(video_shapes(name, FRAMES, FRAME_W, FRAME_H)) == recorded["video_sized"]
    mod = [Modality.TEXT, Modality.IMAGE, Modality.MULTI_IMAGE, Modality.VIDEO]
    shapes = shapes_from_descriptors(
        name,
        [*mod, Modality.IMAGE, Modality.VIDEO],
        [10, 20, 30, 40, 50, 60],
        image_sample_index=[1, 2, 2, 2, 4],
        image_width_px=[640, 1920, 300, 500, 4000],
        image_height_px=[480, 1080, 900, 500, 50],
        video_num_frames=[1, 1, 1, 9, 1, 64],
        video_frame_width_px=[0, 0, 0, 640, 0, 0],
        video_frame_height_px=[0, 0, 0, 480, 0, 0],
    )
    got = (shapes.encoder_units, shapes.tokens_per_unit, shapes.llm_visual_tokens)
    assert _lists(got) == recorded["descriptors"]


def test_anyres_applies_the_rule_once_per_size():
    """Over 256 images the anyres rule runs once per distinct size: same numbers."""
    units, tokens = image_shapes("llava-ov", W * 43, H * 43)
    assert units[:7].tolist() == RECORDED["llava-ov"]["image"][0]
    assert tokens[:7].tolist() == RECORDED["llava-ov"]["image"][1]
    assert (int(units.sum()), int(tokens.sum())) == (3268, 1159624)


def _expand(groups) -> list[ImageUnit]:
    """``[((item, kind, rows, cols), n), ...]``: n crops (index 0..n-1) of each group."""
    return [
        ImageUnit(item, kind, rows, cols, index)
        for (item, kind, rows, cols), n in groups
        for index in range(n)
    ]


UNIT_SIZES = {
    "single_wide": ([(1920, 1080)], False),
    "single_tall": ([(300, 900)], False),
    "single_small": ([(28, 28)], False),
    "multi": ([(640, 480), (1920, 1080), (300, 900)], True),
}
# Recorded from DatasetBatch's unit listing before the strategies.
RECORDED_UNITS = {
    "llava-ov": {
        "single_wide": [((0, "full", 1, 1), 1), ((0, "anyres", 3, 5), 15)],
        "single_tall": [((0, "full", 1, 1), 1), ((0, "anyres", 3, 1), 3)],
        "single_small": [((0, "full", 1, 1), 1), ((0, "anyres", 1, 1), 1)],
        "multi": [((0, "full", 1, 1), 1), ((1, "full", 1, 1), 1), ((2, "full", 1, 1), 1)],
    },
    "internvl": {
        "single_wide": [((0, "full", 1, 1), 1), ((0, "dynamic", 2, 4), 8)],
        "single_tall": [((0, "full", 1, 1), 1), ((0, "dynamic", 3, 1), 3)],
        "single_small": [((0, "dynamic", 1, 1), 1)],
        "multi": [
            ((0, "dynamic", 1, 1), 1),
            ((1, "full", 1, 1), 1),
            ((1, "dynamic", 1, 2), 2),
            ((2, "full", 1, 1), 1),
            ((2, "dynamic", 3, 1), 3),
        ],
    },
    "qwen2-vl": {  # a renderer of fixed tiles cuts native images as dynamic ones
        "single_wide": [((0, "full", 1, 1), 1), ((0, "dynamic", 2, 4), 8)],
        "single_tall": [((0, "full", 1, 1), 1), ((0, "dynamic", 3, 1), 3)],
        "single_small": [((0, "dynamic", 1, 1), 1)],
        "multi": [
            ((0, "full", 1, 1), 1),
            ((0, "dynamic", 3, 4), 12),
            ((1, "full", 1, 1), 1),
            ((1, "dynamic", 2, 4), 8),
            ((2, "full", 1, 1), 1),
            ((2, "dynamic", 3, 1), 3),
        ],
    },
}


@pytest.mark.parametrize("name", sorted(RECORDED_UNITS))
@pytest.mark.parametrize("case", sorted(UNIT_SIZES))
def test_each_strategy_lists_the_recorded_units(name, case):
    spec = get_family(name)
    sizes, multi = UNIT_SIZES[case]
    units = tiling_rule(spec).image_units(spec, sizes, multi)
    assert units == _expand(RECORDED_UNITS[name][case])
