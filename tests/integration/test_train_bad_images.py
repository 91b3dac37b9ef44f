"""A dataset image whose header is fine but whose data is not: the record is replaced by
a seeded redraw before its step (the same on every rank and in a resumed run), counted
and reported; with the check off, the run fails naming the file. An unusable dataset
says why in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA_DIR

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from cli_harness import run_cli  # noqa: E402
from dflop.data.image_header import image_decode_error, read_image_size  # noqa: E402
from dflop.train.data import StepShapes  # noqa: E402

MINI = DATA_DIR / "llava_mini"
BROKEN = "photo_1024x768.jpg"
# Records of the shipped mini set: single images (one of them BROKEN), a multi-image
# record that also uses BROKEN, and a text-only record.
RECORDS = (0, 1, 5, 12, 17)


def _dataset(tmp_path: Path) -> tuple[Path, Path]:
    images = tmp_path / "images"
    shutil.copytree(MINI / "images", images)
    data = (images / BROKEN).read_bytes()
    (images / BROKEN).write_bytes(data[: len(data) // 3])  # the header survives
    records = json.loads((MINI / "llava_mini.json").read_text())
    path = tmp_path / "data.json"
    path.write_text(json.dumps([records[i] for i in RECORDS]))
    return path, images


def test_a_truncated_image_has_a_valid_header_but_does_not_decode(tmp_path):
    _, images = _dataset(tmp_path)
    assert read_image_size(images / BROKEN) == (1024, 768)  # what profiling sees
    problem = image_decode_error(images / BROKEN)
    assert problem is not None and BROKEN in problem and "truncated" in problem
    assert image_decode_error(MINI / "images" / BROKEN) is None


def test_replacements_depend_only_on_which_records_are_bad(tmp_path):
    from dflop.data.reader import read_records

    path, images = _dataset(tmp_path)
    records = read_records(path, image_folder=images)
    assert len(records) == len(RECORDS)

    def source(bad: dict[int, str]) -> StepShapes:
        s = StepShapes("tiny", 16, seed=3, distribution=records)
        s.bad_records.update(bad)
        return s

    clean = source({})
    bad = source({1: "x", 3: "y"})
    same_bad_found_later = source({3: "y"})
    same_bad_found_later.bad_records[1] = "x"
    for step in range(5):
        drawn = clean.record_indices(step)
        got = bad.record_indices(step)
        assert not set(got.tolist()) & {1, 3}
        keep = ~np.isin(drawn, [1, 3])
        assert np.array_equal(got[keep], drawn[keep])  # only bad positions move
        assert np.array_equal(got, same_bad_found_later.record_indices(step))
        # Shapes, the batch's records and the records left to check agree with it.
        raw = bad.raw(step)
        assert np.array_equal(raw.encoder_units, records.distribution.samples.encoder_units[got])
        batch = bad.batch(step, 0)
        assert [r.index for r in batch.records] == [records.records[k].index for k in got]
        assert set(bad.unchecked_records(step)) == set(got.tolist())
    with pytest.raises(ValueError, match=r"records with undecodable images .*repair or remove"):
        source({k: "bad" for k in range(len(RECORDS))}).record_indices(0)


def _train(tmp_path: Path, perf: str, path: Path, images: Path, *extra: str):
    metrics = tmp_path / "m.json"
    result = run_cli(
        "train",
        "--data",
        str(path),
        "--image-folder",
        str(images),
        "--layout",
        "enc_dp=1,llm_dp=1,m=2",
        "--global-batch",
        "8",
        "--steps",
        "3",
        "--perf",
        perf,
        "--quiet",
        "--json",
        str(metrics),
        *extra,
    )
    return result, (json.loads(metrics.read_text()) if metrics.exists() else None)


def test_train_replaces_a_record_whose_image_does_not_decode(tmp_path, perf_json):
    path, images = _dataset(tmp_path)
    result, report = _train(tmp_path, perf_json, path, images)
    assert result.returncode == 0, result.stderr
    # Both records that use the broken file (sample 1 and the multi-image sample 3).
    assert sorted(report["bad_records"]) == report["bad_records"]
    assert len(report["bad_records"]) == 2
    assert all(BROKEN in why and "truncated" in why for why in report["bad_records"])
    assert report["samples_replaced"] >= 2
    assert "skipped a record, replaced by a redraw" in result.stdout
    # Steps counted from 1 in every line, as the progress line counts them.
    redraws = [line for line in result.stdout.splitlines() if "replaced by a redraw" in line]
    assert all(1 <= int(line.split(":")[0].split()[1]) <= 3 for line in redraws), redraws
    assert f"skipped 2 record(s) whose images do not decode ({report['samples_replaced']}" in (
        result.stdout
    )
    assert len(report["steps"]) == 3 and all(np.isfinite(s["loss"]) for s in report["steps"])

    # Without the check the step that decodes it fails, naming the file.
    result, _ = _train(tmp_path, perf_json, path, images, "--no-check-images")
    assert result.returncode == 1
    assert BROKEN in result.stderr.splitlines()[1] and "cannot decode image" in result.stderr


def test_a_dataset_with_no_usable_record_says_why(tmp_path):
    path, _ = _dataset(tmp_path)
    visual = tmp_path / "visual.json"
    visual.write_text(json.dumps([r for r in json.loads(path.read_text()) if "image" in r]))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    for data, message in [
        (
            visual,
            r"none of its 4 records can be trained on \(missing_image x4: image file "
            r".*relative to --image-folder",
        ),
        (empty, "the dataset holds no record"),
    ]:
        # The image folder is wrong: no image is found.
        result = run_cli("train", "--data", str(data), "--image-folder", os.fspath(tmp_path))
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and re.search(message, lines[0]), result.stderr
        assert "step" not in result.stdout
