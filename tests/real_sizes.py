"""A LLaVA-format dataset of real files at real sizes, generated (nothing is shipped or
downloaded): the end-to-end tests and ``benchmarks/bench_real_sizes.py`` train on it.

:func:`make_dataset` writes, under a folder, a recipe (``recipe.yaml``) over one JSON file
of records, with their images and video frames:

* single images of every size, from icons to 2,400 px pages (anyres grids of every shape),
* multi-image records (2 to 4 images),
* videos as folders of 40 frames (more than the families' 32-frame cap),
* text-only conversations, one to several turns,
* long records: documents of 16.5k to 17.8k characters with a question and a short answer
  (a long-context QA record reaches about 18k tokens with its image), and a long
  multi-turn conversation.

Text is words from a small vocabulary, so every tokenizer (and the byte-level stand-in of
tiny test models: one token per byte) sees ordinary text; about 1 in 10 records is long
(the others' median is about 2k characters); answers are shorter than prompts, so about
15% of the tokens are targets (LLaVA-style data: 5-15%). Images are flat colour blocks (PNG, JPEG),
small on disk whatever their size. The same seed gives the same files.
"""

from __future__ import annotations

import json
import os
import random

WORDS = (  # noqa: SIM905 (a sentence reads better than a list)
    "the a chart shows sales of three products over twelve months with clear upward trend "
    "in second half while document lists terms and table values for each region person "
    "walks across street holding red umbrella under grey sky next to parked cars building "
    "describe what happens in this video explain image detail answer question about figure"
).split()

SIZES = [(16, 16), (64, 48), (320, 240), (640, 480), (1024, 768), (1280, 720), (480, 1100),
         (2000, 400), (1240, 1754), (2400, 1800)]  # fmt: skip


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def _image(folder: str, name: str, size: tuple[int, int], rng: random.Random) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    w, h = size
    for _ in range(3):
        x, y = rng.randrange(w), rng.randrange(h)
        draw.rectangle((x, y, min(w - 1, x + w // 3), min(h - 1, y + h // 3)), fill=(0, 0, 0))
    image.save(os.path.join(folder, name))
    return name


def _turns(rng: random.Random, first: str, pairs: int, prompt: int, answer: int) -> list:
    out = []
    for k in range(pairs):
        question = _text(rng, rng.randint(prompt // 2, prompt))
        out.append(
            {"from": "human", "value": (first + "\n" if k == 0 and first else "") + question}
        )
        out.append({"from": "gpt", "value": _text(rng, rng.randint(answer // 2, answer))})
    return out


def make_dataset(out: str, num_records: int = 48, seed: int = 0) -> str:
    """Write the dataset under ``out`` (see the module docstring); returns the recipe's path."""
    rng = random.Random(seed)
    images = os.path.join(out, "images")
    videos = os.path.join(out, "videos")
    os.makedirs(images, exist_ok=True)
    os.makedirs(videos, exist_ok=True)
    records = []
    for i in range(num_records):
        kind = i % 10
        record: dict = {"id": f"real-{i:03d}"}
        if kind in (0, 1, 2, 3):  # single images of every size
            size = SIZES[(i * 7) % len(SIZES)]
            record["image"] = _image(images, f"img{i:03d}.png", size, rng)
            record["conversations"] = _turns(rng, "<image>", rng.choice([1, 2]), 1200, 400)
        elif kind == 4:  # multi-image
            count = 2 + i % 3
            record["image"] = [
                _image(images, f"multi{i:03d}_{k}.jpg", SIZES[(i + k) % 6], rng)
                for k in range(count)
            ]
            tags = " ".join(["<image>"] * count)
            record["conversations"] = _turns(rng, tags, 1, 1200, 400)
        elif kind in (5, 6):  # videos of 40 frames
            folder = f"clip{i:03d}"
            os.makedirs(os.path.join(videos, folder), exist_ok=True)
            for k in range(40):
                _image(os.path.join(videos, folder), f"frame_{k:03d}.jpg", (64, 48), rng)
            record["video"] = folder
            record["conversations"] = _turns(rng, "<video>", 1, 1000, 400)
        elif kind in (7, 8):  # text only
            record["conversations"] = _turns(rng, "", rng.choice([1, 3, 5]), 1500, 500)
        elif i % 20 == 9:  # a long document with a page image: about 18k tokens
            record["image"] = _image(images, f"page{i:03d}.png", (1240, 1754), rng)
            document = _text(rng, rng.randint(16_500, 17_800))
            record["conversations"] = [
                {"from": "human", "value": f"<image>\n{document}\nSummarise the terms."},
                {"from": "gpt", "value": _text(rng, 300)},
            ]
        else:  # a long text-only conversation
            record["conversations"] = _turns(rng, "", 6, 2500, 600)
        records.append(record)
    with open(os.path.join(out, "records.json"), "w", encoding="utf-8") as f:
        json.dump(records, f)
    recipe = os.path.join(out, "recipe.yaml")
    with open(recipe, "w", encoding="utf-8") as f:
        f.write(
            "image_folder: images\nvideo_folder: videos\ndatasets:\n"
            "  - json_path: records.json\n    sampling_strategy: all\n"
        )
    return recipe
