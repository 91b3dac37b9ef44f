"""Generate a held-out LLaVA-format dataset of real image and video-frame files for the
benchmarks (about 300 samples; nothing is downloaded).

    python benchmarks/make_llava_bench.py --out /tmp/dflop-llava-bench

Writes ``OUT/llava_bench.json`` (LLaVA conversations; ``image`` as a path or a list of
paths, ``video`` as a frames folder), ``OUT/images/`` and ``OUT/videos/``. The mix, by
design not tuned to anything dflop does: about 42% single images of every size from
icons to 4000 px scans and A4 documents (PNG, JPEG, WebP, every aspect ratio), 15%
multi-image samples (2 to 6 images), 11% videos (frame folders of 4 to 48 frames), 30%
text-only conversations (one to several turns, short to long), and a few bad samples (a
missing file, a corrupt file, a malformed conversation, an empty frames folder) that the
readers must skip and report. Images are drawn, not noise: gradients, shapes and text
lines, so that decoders and encoders see structured content. The same seed gives the same
files.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from PIL import Image, ImageDraw

WORDS = [
    "the",
    "a",
    "chart",
    "shows",
    "sales",
    "of",
    "three",
    "products",
    "over",
    "twelve",
    "months",
    "with",
    "clear",
    "upward",
    "trend",
    "in",
    "second",
    "half",
    "while",
    "document",
    "lists",
    "terms",
    "and",
    "table",
    "of",
    "values",
    "for",
    "each",
    "region",
    "person",
    "walks",
    "across",
    "street",
    "holding",
    "red",
    "umbrella",
    "under",
    "grey",
    "sky",
    "next",
    "to",
    "parked",
    "cars",
    "building",
    "describe",
    "what",
    "happens",
    "in",
    "this",
    "video",
    "explain",
    "image",
    "detail",
    "answer",
    "question",
    "about",
    "figure",
]

# (width, height) choices by kind; documents and scans are large, icons tiny.
SIZES = {
    "icon": [(16, 16), (32, 32), (64, 64), (96, 48)],
    "photo": [(320, 240), (640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080)],
    "portrait": [(480, 640), (720, 1280), (1080, 1920), (600, 1200)],
    "wide": [(2000, 400), (1600, 300), (3000, 1000)],
    "document": [(1240, 1754), (2480, 3508), (1700, 2200)],
    "scan": [(4000, 3000), (3000, 4000), (3508, 2480)],
}
KIND_WEIGHTS = {"icon": 1, "photo": 6, "portrait": 2, "wide": 1, "document": 2, "scan": 1}


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _draw(path: str, size: tuple[int, int], rng: random.Random) -> None:
    w, h = size
    image = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 12)):  # shapes and lines of "text"
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = (
            min(w - 1, x0 + rng.randint(1, max(2, w // 3))),
            min(h - 1, y0 + rng.randint(1, max(2, h // 3))),
        )
        colour = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            draw.ellipse((x0, y0, x1, y1), outline=colour, width=max(1, w // 200))
    for row in range(0, h, max(8, h // 40)):
        if rng.random() < 0.3:
            draw.line((w // 20, row, w - w // 20, row), fill=(0, 0, 0), width=max(1, h // 500))
    ext = os.path.splitext(path)[1]
    if ext == ".png":
        image.save(path, optimize=True)
    elif ext == ".webp":
        image.save(path, quality=80)
    else:
        image.save(path, quality=85)


def _image(out: str, index: int, rng: random.Random) -> str:
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    size = rng.choice(SIZES[kind])
    ext = rng.choice([".jpg", ".jpg", ".png", ".webp"] if kind != "scan" else [".jpg"])
    name = f"{kind}_{index:04d}_{size[0]}x{size[1]}{ext}"
    _draw(os.path.join(out, "images", name), size, rng)
    return name


def _conversation(rng: random.Random, visual: str, turns: int) -> list[dict[str, str]]:
    out = []
    for t in range(turns):
        question = _text(rng, 4, 30)
        if t == 0 and visual:
            question = f"{visual}\n{question}"
        out.append({"from": "human", "value": question})
        out.append({"from": "gpt", "value": _text(rng, 5, rng.choice([20, 60, 200, 600]))})
    return out


def make(out: str, num_samples: int = 300, seed: int = 0) -> str:
    """Write the dataset under ``out``; returns the JSON's path."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    os.makedirs(os.path.join(out, "videos"), exist_ok=True)
    samples = []
    for i in range(num_samples):
        r = rng.random()
        sample: dict = {"id": f"bench-{i:04d}"}
        if r < 0.42:
            sample["image"] = _image(out, i, rng)
            sample["conversations"] = _conversation(rng, "<image>", rng.choice([1, 1, 2, 3]))
        elif r < 0.57:
            count = rng.randint(2, 6)
            sample["image"] = [_image(out, i * 10 + k, rng) for k in range(count)]
            tags = " ".join("<image>" for _ in range(count))
            sample["conversations"] = _conversation(rng, tags, rng.choice([1, 2]))
        elif r < 0.68:
            folder = f"clip_{i:04d}"
            os.makedirs(os.path.join(out, "videos", folder), exist_ok=True)
            size = rng.choice([(320, 240), (640, 360), (1280, 720)])
            for k in range(rng.randint(4, 48)):
                _draw(os.path.join(out, "videos", folder, f"frame_{k:03d}.jpg"), size, rng)
            sample["video"] = folder
            sample["conversations"] = _conversation(rng, "<video>", rng.choice([1, 2]))
        else:
            sample["conversations"] = _conversation(rng, "", rng.choice([1, 2, 3, 5]))
        samples.append(sample)
    # A few bad samples, which the readers skip and report.
    with open(os.path.join(out, "images", "corrupt.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not really a jpeg")
    os.makedirs(os.path.join(out, "videos", "empty_clip"), exist_ok=True)
    bad = [
        {
            "id": "bad-missing",
            "image": "does_not_exist.png",
            "conversations": _conversation(rng, "<image>", 1),
        },
        {
            "id": "bad-corrupt",
            "image": "corrupt.jpg",
            "conversations": _conversation(rng, "<image>", 1),
        },
        {
            "id": "bad-conversation",
            "image": samples[0].get("image", "x.png"),
            "conversations": [{"from": "human"}],
        },
        {
            "id": "bad-video",
            "video": "empty_clip",
            "conversations": _conversation(rng, "<video>", 1),
        },
    ]
    for k, sample in enumerate(bad):
        samples.insert((k + 1) * len(samples) // (len(bad) + 1), sample)
    path = os.path.join(out, "llava_bench.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(samples, f, indent=1)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/dflop-llava-bench")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = make(args.out, args.samples, args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
