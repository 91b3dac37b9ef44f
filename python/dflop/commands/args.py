"""Argument types and checks the subcommands share."""

from __future__ import annotations

import argparse
import json

__all__ = ["json_object", "non_negative_int", "positive_int", "virtual_stage_list"]


def _int(text: str, minimum: int, rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be {rule}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (0 is refused, not read as "the default")."""
    return _int(text, 1, ">= 1")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int(text, 0, ">= 0")


def virtual_stage_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated chunk counts per LLM stage, holding 1 ("1,2")."""
    values = tuple(positive_int(part.strip()) for part in text.split(",") if part.strip())
    if 1 not in values:
        raise argparse.ArgumentTypeError(f"{text!r} must hold 1 (the plain 1F1B pipeline)")
    return values


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (``'{"text": 0.4}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error})") from None
    except RecursionError:
        raise argparse.ArgumentTypeError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
