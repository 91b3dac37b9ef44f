"""TrainConfig's sections: a config file (TOML, YAML) with errors that name what is wrong,
and the 'dflop train' flags generated from the fields (every field reachable)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from dflop.cli import build_parser
from dflop.commands.train import config_from_args
from dflop.train import TrainConfig
from dflop.train.config import SECTIONS

MIX = '{"single_image": 0.5, "multi_image": 0.1, "video": 0.1, "text": 0.3}'


def _config(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_field_has_a_section_a_doc_and_a_flag():
    parser_help = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["section"] in SECTIONS, f.name
        assert len(TrainConfig.field_doc(f.name)) > 10, f.name
        assert f"--{f.name.replace('_', '-')}" in parser_help, f.name
    # Fields the hand-written CLI could not reach, and the old spellings.
    config = _config(
        "--weight-decay", "0.1", "--lookahead", "3", "--no-schedule-deadline",
        "--grad-clip", "0", "--preset", "small", "--timeout", "60", "--no-adaptive",
        "--mix", MIX, "--quiet",
    )  # fmt: skip
    assert (config.weight_decay, config.lookahead, config.schedule_deadline) == (0.1, 3, False)
    assert config.grad_clip_norm is None and config.model == "small"
    assert (config.timeout_s, config.adaptive, config.mix, config.log_every) == (
        60.0, False, json.loads(MIX), 0
    )  # fmt: skip
    assert _config() == TrainConfig()  # no flag: the defaults


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_config_file_with_flags_on_top(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    if suffix == ".toml":
        path.write_text(
            "[optim]\nsteps = 7\nlr = 3e-4\ngrad_clip_norm = 0\n\n[data]\nglobal_batch = 12\n"
            '[schedule]\nscheduler = "compare"\n'
        )
    else:
        path.write_text(
            "optim: {steps: 7, lr: 3.0e-4, grad_clip_norm: 0}\ndata: {global_batch: 12}\n"
            "schedule: {scheduler: compare}\n"
        )
    config = _config("--config", str(path), "--steps", "9")
    assert (config.steps, config.lr, config.global_batch) == (9, 3e-4, 12)
    assert config.scheduler == "compare" and config.grad_clip_norm is None
    # The sections round-trip.
    assert TrainConfig.from_sections(config.to_sections()) == config


def test_the_old_scheduler_names_still_work_with_a_deprecation_warning(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text('[schedule]\nschedule = "blind"\n')
    with pytest.warns(DeprecationWarning, match=r"\[schedule\] schedule .* use scheduler"):
        assert TrainConfig.load(path).scheduler == "blind"
    assert _config("--schedule", "compare").scheduler == "compare"  # the old flag


@pytest.mark.parametrize(
    "text, message",
    [
        ("[optm]\nlr = 1\n", r"unknown section \[optm\] \(did you mean 'optim'\?\)"),
        ("[optim]\nlrr = 1\n", r"\[optim\] has no field 'lrr' \(did you mean 'lr'\?\)"),
        ("[data]\nlr = 1\n", r"'lr' belongs in \[optim\], not \[data\]"),
        ("lr = 1\n", r"unknown section \[lr\] \('lr' is a field of \[optim\]\)"),
        ("[optim]\nsteps = 0\n", r"TrainConfig.steps=0 must be an integer >= 1"),
        ("[optim\n", "not valid TOML"),
        # A value of the wrong kind is named as such, not read letter by letter.
        ('[data]\nmix = ", \\"-5\\""\n', r"mix must be a table of fractions .*got str"),
        ("[output]\ntrace = 5\n", r"TrainConfig.trace must be text, got int 5"),
        ('[data]\ncheck_images = "no"\n', r"check_images must be true or false, got str 'no'"),
        # Timeouts: nan, 1e-300 and 1e300 are named, with the range (no network error).
        ("[runtime]\nrun_timeout_s = nan\n", r"run_timeout_s=nan must be a number of seconds"),
        ("[runtime]\ntimeout_s = 1e-300\n", r"timeout_s=1e-300 must be a number of seconds from 1"),
        ("[runtime]\ntimeout_s = 1e300\n", r"timeout_s=1e\+300 must be .* \(one year\)"),
    ],
)
def test_config_file_errors_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises((ValueError, TypeError), match=message):
        _config("--config", str(path))


def test_a_huge_value_is_quoted_in_a_short_message():
    """A value that expanded to millions of items is quoted in a bounded message."""
    nested = [1] * 9
    for _ in range(7):
        nested = [nested] * 9  # 9^8 items, as a YAML alias bomb builds
    with pytest.raises(ValueError) as info:
        TrainConfig(steps=nested)
    assert "TrainConfig.steps=[[[" in str(info.value) and len(str(info.value)) < 250


def test_config_file_errors_are_one_line_on_the_command_line(tmp_path, capsys):
    from dflop.cli import main

    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlrr = 1\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no field 'lrr' (did you mean 'lr'?)" in err[0]
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
