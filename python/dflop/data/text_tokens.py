"""Text tokens of a conversation: from a local tokenizer, else a documented estimate.

A LLaVA-style conversation is a list of turns ``{"from": "human"|"gpt"|..., "value": str}``.
Its text tokens are what the LLM reads besides the visual tokens:

* the turns' text with the visual placeholders (``<image>``, ``<video>``) removed, since
  the profiler counts the visual tokens separately from the family's rules;
* ``tokens_per_turn`` template tokens per turn (role header and end-of-turn markers:
  Qwen2's ``<|im_start|>`` ``user`` ``\\n`` ... ``<|im_end|>`` ``\\n`` = 5 tokens);
* ``tokens_per_conversation`` once per sample (the chat template's system prompt:
  ``<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n`` = 11 tokens with the
  Qwen2 tokenizer used by LLaVA-OneVision).

Target (loss) tokens are the tokens a chat template labels, as LLaVA's preprocessing and
the Hugging Face processors do: the answer turns' text (``from`` is ``gpt`` or
``assistant``, any case) plus ``target_tokens_per_answer`` end-of-turn tokens per answer
(ChatML's ``<|im_end|>`` ``\n`` = 2); prompts, system turns, role headers and visual
tokens are not targets.

Counting the turns' text
------------------------
* With a tokenizer (:func:`make_text_counter` with ``tokenizer=...``): the exact number of
  tokens of each turn's text, ``add_special_tokens=False``. A tokenizer is a local path to
  a Hugging Face tokenizer folder (loaded with ``transformers.AutoTokenizer`` and
  ``local_files_only=True``: nothing is ever downloaded; ``transformers`` is imported only
  then), an object with an ``encode(text) -> list`` method (e.g. a loaded
  ``PreTrainedTokenizer``), or a callable ``text -> int``.
* Without one: ``ceil(characters / chars_per_token)`` per turn, ``chars_per_token = 4``
  (the usual ratio of BPE tokenizers on English text; CJK text and code are denser, so
  the estimate is low for them).

A turn's text is counted piece by piece between its visual placeholders, as the runtimes
tokenise it (the visual tokens go between the pieces).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

from dflop.errors import InputTypeError

__all__ = [
    "ANSWER_ROLES",
    "CHARS_PER_TOKEN",
    "TARGET_TOKENS_PER_ANSWER",
    "TOKENS_PER_CONVERSATION",
    "TOKENS_PER_TURN",
    "VISUAL_PLACEHOLDERS",
    "TextTokenCounter",
    "is_answer_turn",
    "make_text_counter",
    "strip_visual_placeholders",
]

CHARS_PER_TOKEN = 4.0
TOKENS_PER_TURN = 5
TOKENS_PER_CONVERSATION = 11
TARGET_TOKENS_PER_ANSWER = 2
VISUAL_PLACEHOLDERS = ("<image>", "<video>")
ANSWER_ROLES = ("gpt", "assistant")
"""``from`` values (lower-cased) of the turns whose text is a target."""

_PLACEHOLDER_RE = re.compile("|".join(re.escape(p) for p in VISUAL_PLACEHOLDERS))


def strip_visual_placeholders(text: str) -> str:
    """``text`` without the ``<image>``/``<video>`` placeholders."""
    return _PLACEHOLDER_RE.sub("", text)


def is_answer_turn(role: object) -> bool:
    """Whether a turn of this ``from`` role is an answer (its tokens are targets)."""
    return isinstance(role, str) and role.lower() in ANSWER_ROLES


@dataclass(frozen=True)
class TextTokenCounter:
    """Counts the text tokens of conversations (see the module docstring).

    Attributes:
        method: ``"estimate"`` or ``"tokenizer:<name>"`` (recorded in the profile).
        count_text: tokens of one turn's text (placeholders already removed).
        tokens_per_turn: template tokens added per turn.
        tokens_per_conversation: template tokens added per conversation.
        target_tokens_per_answer: template tokens of an answer turn that are targets (its
            end-of-turn tokens; part of ``tokens_per_turn``).
    """

    method: str
    count_text: Callable[[str], int]
    tokens_per_turn: int = TOKENS_PER_TURN
    tokens_per_conversation: int = TOKENS_PER_CONVERSATION
    target_tokens_per_answer: int = TARGET_TOKENS_PER_ANSWER

    def body(self, text: str) -> int:
        """Tokens of one turn's text, piece by piece between its visual placeholders."""
        return sum(self.count_text(piece) for piece in _PLACEHOLDER_RE.split(text) if piece)

    def __call__(self, turn_texts: Sequence[str]) -> int:
        """Text tokens of a conversation given its turns' texts."""
        body = sum(self.body(t) for t in turn_texts)
        return body + self.tokens_per_turn * len(turn_texts) + self.tokens_per_conversation

    def count_turns(self, turns: Sequence[tuple[str, str]]) -> tuple[int, int]:
        """``(text tokens, target tokens)`` of a conversation given its ``(role,
        text)`` turns (see the module docstring)."""
        segments = self.segments(turns)
        text = sum(n for n, _ in segments)
        return text, sum(n for n, target in segments if target)

    def segments(self, turns: Sequence[tuple[str, str]]) -> list[tuple[int, bool]]:
        """The conversation's text in sequence order as ``(tokens, are targets)`` runs:
        the template's once-per-conversation tokens, then per turn its header, its text
        and its end of turn (the last two targets on an answer)."""
        out = [(self.tokens_per_conversation, False)]
        footer = min(self.target_tokens_per_answer, self.tokens_per_turn)
        for role, text in turns:
            answer = is_answer_turn(role)
            out += [
                (self.tokens_per_turn - footer, False),
                (self.body(text), answer),
                (footer, answer),
            ]
        return out

    def targets_in_prefix(self, turns: Sequence[tuple[str, str]], keep: int) -> int:
        """Target tokens among the first ``keep`` text tokens of the conversation (what a
        sample truncated to ``keep`` text tokens still trains on)."""
        left, targets = max(0, int(keep)), 0
        for tokens, target in self.segments(turns):
            taken = min(tokens, left)
            targets += taken if target else 0
            left -= taken
        return targets


def _estimate(chars_per_token: float) -> Callable[[str], int]:
    def count(text: str) -> int:
        return math.ceil(len(text) / chars_per_token)

    return count


def load_local_tokenizer(path: str | os.PathLike[str], fallback: str) -> Any:
    """A Hugging Face tokenizer from a local folder (never downloads). ``fallback`` says
    what to pass instead when ``transformers`` is missing."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer folder {path!r} does not exist (give a local folder with a "
            "Hugging Face tokenizer; nothing is downloaded)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"loading the tokenizer at {path!r} needs the 'transformers' package; "
            f"install it or pass {fallback}"
        ) from exc
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def make_text_counter(
    tokenizer: Any = None,
    *,
    chars_per_token: float = CHARS_PER_TOKEN,
    tokens_per_turn: int = TOKENS_PER_TURN,
    tokens_per_conversation: int = TOKENS_PER_CONVERSATION,
    target_tokens_per_answer: int = TARGET_TOKENS_PER_ANSWER,
) -> TextTokenCounter:
    """A :class:`TextTokenCounter` for ``tokenizer`` (``None``: the character estimate).

    Args:
        tokenizer: ``None``, a local tokenizer folder (str/PathLike), an object with
            ``encode``, or a callable ``text -> int`` (see the module docstring).
        chars_per_token: characters per token of the estimate (> 0).
        tokens_per_turn, tokens_per_conversation: template overheads (>= 0).
        target_tokens_per_answer: end-of-turn tokens of an answer that are targets (>= 0).

    Raises:
        FileNotFoundError: the tokenizer folder does not exist.
        ImportError: a tokenizer folder was given but ``transformers`` is not installed.
        TypeError: ``tokenizer`` is none of the accepted kinds.
    """
    if not (math.isfinite(chars_per_token) and chars_per_token > 0):
        raise ValueError(f"chars_per_token={chars_per_token!r} must be finite and > 0")
    for arg, value in (
        ("tokens_per_turn", tokens_per_turn),
        ("tokens_per_conversation", tokens_per_conversation),
        ("target_tokens_per_answer", target_tokens_per_answer),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{arg}={value!r} must be an int >= 0")
    overheads = {
        "tokens_per_turn": tokens_per_turn,
        "tokens_per_conversation": tokens_per_conversation,
        "target_tokens_per_answer": target_tokens_per_answer,
    }
    if tokenizer is None:
        return TextTokenCounter(
            f"estimate:chars/{chars_per_token:g}", _estimate(chars_per_token), **overheads
        )
    if isinstance(tokenizer, (str, os.PathLike)):
        name = os.fspath(tokenizer)
        tokenizer = load_local_tokenizer(tokenizer, "tokenizer=None to use the character estimate")
    else:
        name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):
        try:  # Hugging Face tokenizers: no BOS/EOS, the template overheads count those
            encode("", add_special_tokens=False)
            kwargs: dict[str, Any] = {"add_special_tokens": False}
        except TypeError:
            kwargs = {}

        def count(text: str) -> int:
            return len(encode(text, **kwargs))

        return TextTokenCounter(f"tokenizer:{name}", count, **overheads)
    if callable(tokenizer):
        return TextTokenCounter(f"tokenizer:{name}", lambda text: int(tokenizer(text)), **overheads)
    raise InputTypeError(
        "tokenizer must be None, a local tokenizer folder, an object with encode(), "
        f"or a callable text -> int; got {type(tokenizer).__name__}"
    )
