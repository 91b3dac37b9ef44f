"""Hostile inputs: named pipes, YAML alias bombs, deeply nested JSON, paths that leave
their folder and non-image files whose bytes must not be echoed.

Each input is a real file; where the problem was seen on the command line the test runs
the CLI as a subprocess (with a timeout: a named pipe used to block ``open()`` forever).
In-process calls that could block run under :func:`_deadline`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA_DIR
from dflop.data import DatasetError, ShapeDistribution, profile_dataset, read_image_size
from dflop.data.image_header import ImageHeaderError, image_decode_error
from dflop.data.reader import read_records

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX named pipes")

MINI = DATA_DIR / "llava_mini"
PNG = MINI / "images" / "photo_640x480.png"  # 640 x 480
TIMEOUT_S = 120
SECRET = b"root:*:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"  # /etc/shadow-like
FORBIDDEN = ("root", "72 6f 6f 74", "726f6f74", "0x72", ":*:")  # content bytes, any spelling


def run_cli(*args: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    executable = shutil.which("dflop")
    command = [executable] if executable else [sys.executable, "-m", "dflop.cli"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@contextlib.contextmanager
def _deadline(seconds: float = 10.0):
    """Fail (instead of hanging the test session) if the block takes longer: SIGALRM
    interrupts a blocking ``open()`` of a named pipe."""

    def expired(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _conversation(tag: str = "<image>") -> list[dict]:
    return [{"from": "human", "value": f"{tag}\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]


def _image_record(image) -> dict:
    return {"image": image, "conversations": _conversation()}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records))
    return path


def _alias_bomb(levels: int = 9) -> tuple[str, str]:
    """A ~350-byte 'billion laughs' (9 nested levels of 9 aliases each: 9**9 leaves) and
    the name of its last anchor."""
    lines = ["a: &a [" + ", ".join(['"lol"'] * 9) + "]"]
    previous = "a"
    for name in "bcdefghijklmnop"[: levels - 1]:
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
        previous = name
    return "\n".join(lines) + "\n", previous


DEEP_JSON = "[" * 100_000 + "]" * 100_000


# --------------------------------------------------------------------------- 4. named pipes


@pytest.mark.parametrize("name", ["data.json", "data.jsonl", "recipe.yaml"])
def test_profile_data_refuses_a_named_pipe_as_the_dataset(tmp_path, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    line = _one_error_line(run_cli("profile-data", str(fifo), "-o", str(tmp_path / "s.json")))
    assert str(fifo) in line and "named pipe (FIFO), not a regular file" in line
    assert not (tmp_path / "s.json").exists()


def test_a_named_pipe_in_a_recipe_is_refused(tmp_path):
    os.mkfifo(tmp_path / "part.json")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("datasets:\n  - json_path: part.json\n")
    with _deadline(), pytest.raises(DatasetError, match=r"part\.json.* is a named pipe"):
        profile_dataset(recipe, progress=False)


def test_profile_data_counts_a_named_pipe_image_as_a_skipped_record(tmp_path):
    shutil.copy(PNG, tmp_path / "ok.png")
    os.mkfifo(tmp_path / "pipe.png")
    data = _write(tmp_path / "data.json", [_image_record("ok.png"), _image_record("pipe.png")])
    out = tmp_path / "s.json"
    result = run_cli("profile-data", str(data), "-o", str(out))
    assert result.returncode == 0, result.stderr
    profile = ShapeDistribution.load(out)
    assert len(profile.samples) == 1 and profile.num_read == 2
    assert profile.skipped == {"not_a_regular_file": 1}
    (example,) = profile.skipped_examples
    assert "pipe.png" in example["message"] and "named pipe" in example["message"]


def test_named_pipes_are_never_opened_by_the_readers(tmp_path):
    """The header reader, the decoder check and the training reader (which checks
    files that only size fields describe, and frames listed in 'frames') all refuse
    a named pipe at once."""
    from dflop.data.image_header import NotARegularFileError

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    os.mkdir(tmp_path / "clip")
    shutil.copy(PNG, tmp_path / "clip" / "0.png")
    os.mkfifo(tmp_path / "clip" / "1.png")
    with _deadline():
        with pytest.raises(NotARegularFileError, match=r"pipe\.png.* is a named pipe"):
            read_image_size(fifo)
        assert "named pipe" in image_decode_error(fifo)
        records = [
            {**_image_record("pipe.png"), "image_size": [640, 480]},  # header never read
            {
                "video": "clip",
                "frames": ["clip/0.png", "clip/1.png"],
                "conversations": _conversation("<video>"),
            },
            _image_record("pipe.png"),
        ]
        found = read_records(_write(tmp_path / "data.json", records))
    assert len(found) == 0
    assert found.distribution.skipped == {"not_a_regular_file": 3}


# --------------------------------------------------------------------------- 5. YAML bombs


def test_profile_data_refuses_a_yaml_alias_bomb(tmp_path):
    bomb, last = _alias_bomb()
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(bomb + f"datasets: [*{last}]\n")
    assert recipe.stat().st_size < 1024
    line = _one_error_line(run_cli("profile-data", str(recipe), "-o", str(tmp_path / "s.json")))
    assert str(recipe) in line and "alias" in line
    assert len(line) < 400


def test_yaml_loader_bounds_aliases_recursion_and_depth(tmp_path):
    from dflop.safe_io import load_yaml

    bomb, last = _alias_bomb()
    with pytest.raises(ValueError, match=r"^x\.yaml: YAML aliases expand the document"):
        load_yaml(bomb + f"steps: *{last}\n", "x.yaml")
    with pytest.raises(ValueError, match=r"^r\.yaml: YAML with a recursive alias"):
        load_yaml("a: &a [1, *a]\n", "r.yaml")
    with pytest.raises(ValueError, match=r"^d\.yaml: YAML nested too deeply"):
        load_yaml("[" * 100_000 + "]" * 100_000, "d.yaml")
    # Ordinary anchors, aliases and merge keys still work.
    doc = load_yaml(
        "common: &c {sampling_strategy: 'first:2'}\n"
        "datasets:\n  - {<<: *c, json_path: a.json}\n  - {<<: *c, json_path: b.json}\n",
        "ok.yaml",
    )
    assert [d["sampling_strategy"] for d in doc["datasets"]] == ["first:2", "first:2"]
    # A recipe using them reads.
    shutil.copy(MINI / "llava_mini.json", tmp_path / "a.json")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"image_folder: {MINI / 'images'}\ncommon: &c {{sampling_strategy: 'first:3'}}\n"
        "datasets:\n  - {<<: *c, json_path: a.json}\n  - {<<: *c, json_path: a.json}\n"
    )
    assert profile_dataset(recipe, progress=False).num_read == 6


def test_error_messages_quote_user_values_bounded(tmp_path):
    huge = "x" * 1_000_000
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"datasets:\n  - {huge}\n")
    with pytest.raises(DatasetError) as error:
        profile_dataset(recipe, progress=False)
    assert "must be a mapping with json_path" in str(error.value)
    assert len(str(error.value)) < 400
    strategy = ", ".join(["1"] * 50_000)
    recipe.write_text(
        f"datasets:\n  - json_path: {MINI / 'llava_mini.json'}\n"
        f"    sampling_strategy: [{strategy}]\n"
    )
    with pytest.raises(DatasetError, match="must be a string") as error:
        profile_dataset(recipe, progress=False)
    assert len(str(error.value)) < 400
    # Per-sample messages (kept in the saved profile) too.
    shutil.copy(PNG, tmp_path / "ok.png")
    records = [
        {**_image_record("ok.png"), "image_size": [[1, 2, 3]] * 100_000},
        {"conversations": [{"from": "human", "value": huge}] * 3 + [huge]},
        [huge] * 10,
    ]
    profile = profile_dataset(_write(tmp_path / "d.json", records), progress=False)
    assert sum(profile.skipped.values()) == 3
    assert all(len(e["message"]) < 400 for e in profile.skipped_examples)
    from dflop.safe_io import path_repr

    assert len(path_repr("/d/" + huge + "/name.png")) <= 250
    assert path_repr("/d/" + huge + "/name.png").endswith("/name.png'")


# --------------------------------------------------------------------------- 6. deep JSON


def test_profile_data_deep_json_file_is_a_clear_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text(DEEP_JSON)
    line = _one_error_line(run_cli("profile-data", str(path), "-o", str(tmp_path / "s.json")))
    assert str(path) in line and "nested too deeply" in line


def test_profile_data_deep_jsonl_line_is_a_bad_record(tmp_path):
    shutil.copy(PNG, tmp_path / "ok.png")
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(_image_record("ok.png")) + "\n" + DEEP_JSON + "\n")
    out = tmp_path / "s.json"
    result = run_cli("profile-data", str(path), "-o", str(out))
    assert result.returncode == 0, result.stderr
    profile = ShapeDistribution.load(out)
    assert len(profile.samples) == 1 and profile.skipped == {"invalid_json": 1}
    assert "nested too deeply" in profile.skipped_examples[0]["message"]
    assert profile.skipped_examples[0]["line"] == 2


def test_deep_json_in_dflop_files_is_a_clear_error(tmp_path):
    from dflop.planner import Plan
    from dflop.profiling import PerformanceModel

    path = tmp_path / "deep.json"
    path.write_text(DEEP_JSON)
    for load in (ShapeDistribution.load, PerformanceModel.load, Plan.load):
        with pytest.raises(ValueError, match="nested too deeply") as error:
            load(path)
        assert str(path) in str(error.value)
    line = _one_error_line(run_cli("inspect", str(path)))
    assert str(path) in line and "nested too deeply" in line


# --------------------------------------------------------------------------- 9. paths, bytes


def _outside_layout(tmp_path: Path) -> tuple[Path, Path]:
    """``data/ds.json`` whose images are in ``data/`` (its folder) or elsewhere."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    shutil.copy(PNG, data / "in.png")
    shutil.copy(PNG, tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", data / "link.png")  # inside by name only
    (tmp_path / "clip").mkdir()
    shutil.copy(PNG, tmp_path / "clip" / "0.png")
    records = [
        _image_record("in.png"),
        _image_record("sub/../in.png"),  # stays inside
        _image_record("../outside.png"),
        _image_record(str(data / "in.png")),  # absolute, and inside: where it leads counts
        _image_record(str(tmp_path / "outside.png")),  # absolute, outside
        _image_record("link.png"),
        _image_record(["in.png", "../outside.png"]),
        {"video": "../clip", "conversations": _conversation("<video>")},
        {"video": "clip", "frames": ["../clip/0.png"], "conversations": _conversation("<video>")},
    ]
    return _write(data / "ds.json", records), data


def test_paths_are_confined_to_the_folders_unless_allowed(tmp_path):
    path, data = _outside_layout(tmp_path)
    confined = profile_dataset(path, progress=False)
    assert len(confined.samples) == 3
    assert confined.skipped == {"outside_folder": 6}
    messages = [e["message"] for e in confined.skipped_examples]
    assert any("'../outside.png' is outside its folder" in m for m in messages)
    assert any("is absolute, outside its folder" in m for m in messages)
    assert all("allow_outside_paths" in m for m in messages)
    # The records training would use: the same rule.
    assert len(read_records(path)) == 3
    # Explicit folders confine as well (here the dataset's own, spelled out).
    assert profile_dataset(path, image_folder=data, video_folder=data, progress=False).skipped
    # Opting in reads them all (the frames list points at an existing frame).
    allowed = profile_dataset(path, progress=False, allow_outside_paths=True)
    assert allowed.skipped == {} and len(allowed.samples) == 9
    assert len(read_records(path, allow_outside_paths=True)) == 9


def test_a_nul_in_a_path_is_a_skipped_record(tmp_path):
    shutil.copy(PNG, tmp_path / "ok.png")
    path = _write(tmp_path / "d.json", [_image_record("ok.png"), _image_record("ok\x00.png")])
    profile = profile_dataset(path, progress=False)
    assert len(profile.samples) == 1 and profile.skipped == {"bad_image_field": 1}
    allowed = profile_dataset(path, progress=False, allow_outside_paths=True)
    assert len(allowed.samples) == 1 and sum(allowed.skipped.values()) == 1


def test_profile_data_allow_outside_paths_flag(tmp_path):
    path, _ = _outside_layout(tmp_path)
    out = tmp_path / "s.json"
    result = run_cli("profile-data", str(path), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "outside_folder: 6" in result.stdout
    assert ShapeDistribution.load(out).skipped == {"outside_folder": 6}
    result = run_cli("profile-data", str(path), "-o", str(out), "--allow-outside-paths")
    assert result.returncode == 0, result.stderr
    assert ShapeDistribution.load(out).skipped == {}


def test_train_config_allow_outside_paths_field(tmp_path):
    from dflop.cli import build_parser
    from dflop.commands.train import config_from_args
    from dflop.train import TrainConfig
    from dflop.train.data import load_distribution

    assert TrainConfig().allow_outside_paths is False
    parsed = build_parser().parse_args(["train", "--allow-outside-paths"])
    config = config_from_args(parsed)
    assert config.allow_outside_paths is True
    assert config.to_sections()["data"]["allow_outside_paths"] is True
    path, _ = _outside_layout(tmp_path)
    assert len(load_distribution(str(path))) == 3
    assert len(load_distribution(str(path), allow_outside_paths=True)) == 9


def test_a_non_image_file_is_named_not_echoed(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(SECRET)
    webp = tmp_path / "chunk.webp"
    webp.write_bytes(b"RIFF\x20\x00\x00\x00WEBProot" + b"\x00" * 30)
    jpeg = tmp_path / "bad.jpg"
    jpeg.write_bytes(b"\xff\xd8root:*:19000")

    def scrubbed(text: str) -> str:  # the paths may hold 'root' (/tmp/pytest-of-root)
        return text.replace(str(tmp_path), "<tmp>")

    for path in (secret, webp, jpeg):
        with pytest.raises(ImageHeaderError) as error:
            read_image_size(path)
        assert str(path) in str(error.value)
        assert not any(text in scrubbed(str(error.value)) for text in FORBIDDEN), error.value
    with pytest.raises(ImageHeaderError, match="not a PNG, JPEG, GIF, BMP or WebP image"):
        read_image_size(secret)
    assert not any(text in scrubbed(image_decode_error(secret)) for text in FORBIDDEN)
    # On the command line: the error line and the saved profile hold no content byte.
    shutil.copy(PNG, tmp_path / "ok.png")
    data = _write(tmp_path / "d.json", [_image_record("ok.png"), _image_record("secret.png")])
    out = tmp_path / "s.json"
    result = run_cli("profile-data", str(data), "-o", str(out))
    assert result.returncode == 0, result.stderr
    saved = scrubbed(out.read_text())
    assert "unrecognised image format" in saved and "secret.png" in saved
    assert not any(text in saved + scrubbed(result.stdout) for text in FORBIDDEN)


# --------------------------------------------------------------------------- dflop train


@pytest.mark.integration
@pytest.mark.parametrize("case", ["fifo_data", "fifo_config", "bomb_config", "deep_data"])
def test_train_refuses_hostile_files_in_one_line(tmp_path, case):
    if case == "fifo_data":
        os.mkfifo(tmp_path / "data.json")
        args, expect = ["--data", str(tmp_path / "data.json")], "is a named pipe (FIFO)"
    elif case == "fifo_config":
        os.mkfifo(tmp_path / "run.yaml")
        args, expect = ["--config", str(tmp_path / "run.yaml")], "is a named pipe (FIFO)"
    elif case == "bomb_config":  # the anchors inline: steps is a list of 9**9 leaves
        bomb, _ = _alias_bomb()
        levels = ", ".join(line.split(": ", 1)[1] for line in bomb.splitlines())
        (tmp_path / "run.yaml").write_text(f"optim:\n  steps: [{levels}]\n")
        assert (tmp_path / "run.yaml").stat().st_size < 1024
        args, expect = ["--config", str(tmp_path / "run.yaml")], "YAML aliases expand"
    else:
        (tmp_path / "data.json").write_text(DEEP_JSON)
        args, expect = ["--data", str(tmp_path / "data.json")], "nested too deeply"
    line = _one_error_line(run_cli("train", *args))
    assert expect in line and str(tmp_path) in line and len(line) < 400


@pytest.mark.integration
def test_train_says_why_no_record_is_usable(tmp_path):
    """A named pipe image and paths leaving the folder: skipped with reasons, no hang."""
    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data" / "pipe.png")
    shutil.copy(PNG, tmp_path / "outside.png")
    records = [_image_record("pipe.png"), _image_record("../outside.png")]
    data = _write(tmp_path / "data" / "d.json", records)
    line = _one_error_line(run_cli("train", "--data", str(data)))
    assert "none of its 2 records can be trained on" in line
    assert "not_a_regular_file x1" in line and "outside_folder x1" in line
