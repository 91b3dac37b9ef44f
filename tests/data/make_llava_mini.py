"""Generate tests/data/llava_mini: a tiny LLaVA-format dataset for the data profiler tests.

Run once (``python tests/data/make_llava_mini.py``) and commit the outputs; the tests only
read them. Needs Pillow (with WebP support). Images are solid colours (or 1-bit for the
large ones) so the whole folder stays well under 300 KB.

Contents:

* ``images/``: PNG, JPEG (baseline, progressive, EXIF-rotated), GIF, BMP (1-bit),
  WebP (lossy VP8, lossless VP8L, extended VP8X with alpha), a large A4-at-300-dpi scan,
  a 16 px icon and a corrupt file.
* ``videos/``: ``clip_frames/`` (8 frames plus a stray text file), ``long_clip_frames/``
  (40 frames, above the 32-frame cap), ``empty_frames/`` (no images), and ``clip.mp4`` (a
  placeholder file: the profiler never decodes videos).
* ``llava_mini.json`` (28 samples), ``llava_mini.jsonl`` (12 samples and a blank line),
  ``recipe.yaml`` (every sampling strategy). ``expected.json`` records the true image
  sizes and which samples are meant to be skipped, and why.
"""

from __future__ import annotations

import json
import os
import shutil

from PIL import Image

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llava_mini")
IMAGES = os.path.join(ROOT, "images")
VIDEOS = os.path.join(ROOT, "videos")

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
    "a",
    "clear",
    "upward",
    "trend",
    "in",
    "the",
    "second",
    "half",
    "while",
    "the",
    "document",
    "lists",
    "terms",
    "and",
    "a",
    "table",
    "of",
    "figures",
]


def text(num_words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + k) % len(WORDS)] for k in range(num_words))


def conv(*turns: str) -> list[dict[str, str]]:
    return [{"from": "human" if k % 2 == 0 else "gpt", "value": t} for k, t in enumerate(turns)]


def make_images() -> dict[str, tuple[int, int]]:
    os.makedirs(IMAGES, exist_ok=True)
    sizes: dict[str, tuple[int, int]] = {}

    def save(name: str, img: Image.Image, **kwargs: object) -> None:
        img.save(os.path.join(IMAGES, name), **kwargs)
        sizes[name] = img.size

    save("photo_640x480.png", Image.new("RGB", (640, 480), (200, 30, 30)))
    save("photo_1024x768.jpg", Image.new("RGB", (1024, 768), (30, 120, 200)), quality=50)
    save(
        "scan_1700x2200_progressive.jpg",
        Image.new("L", (1700, 2200), 235),
        quality=30,
        progressive=True,
    )
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    save("exif_rotated_800x600.jpg", Image.new("RGB", (800, 600), (90, 90, 20)), exif=exif)
    save("anim_500x375.gif", Image.new("P", (500, 375), 3))
    save("chart_200x150.bmp", Image.new("1", (200, 150), 1))
    save("lossy_800x600.webp", Image.new("RGB", (800, 600), (10, 160, 60)), quality=30)
    save("lossless_300x200.webp", Image.new("RGB", (300, 200), (250, 250, 0)), lossless=True)
    save("alpha_640x360.webp", Image.new("RGBA", (640, 360), (0, 0, 255, 128)), quality=30)
    save("document_2480x3508.png", Image.new("1", (2480, 3508), 1))
    save("icon_16x16.png", Image.new("RGB", (16, 16), (0, 0, 0)))
    with open(os.path.join(IMAGES, "corrupt.png"), "wb") as f:
        f.write(b"this is not an image, only text pretending to be one\n")
    return sizes


def make_videos() -> None:
    os.makedirs(VIDEOS, exist_ok=True)
    clip = os.path.join(VIDEOS, "clip_frames")
    os.makedirs(clip)
    for k in range(8):
        Image.new("RGB", (64, 48), (k * 30, 0, 0)).save(
            os.path.join(clip, f"frame_{k:03d}.jpg"), quality=30
        )
    with open(os.path.join(clip, "notes.txt"), "w") as f:
        f.write("not a frame\n")
    long_clip = os.path.join(VIDEOS, "long_clip_frames")
    os.makedirs(long_clip)
    for k in range(40):
        Image.new("L", (8, 8), k).save(os.path.join(long_clip, f"{k:04d}.png"))
    empty = os.path.join(VIDEOS, "empty_frames")
    os.makedirs(empty)
    with open(os.path.join(empty, "README.txt"), "w") as f:
        f.write("a frames folder without frames\n")
    with open(os.path.join(VIDEOS, "clip.mp4"), "wb") as f:
        f.write(b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom placeholder, not a video")


def json_samples() -> tuple[list[object], dict[int, str]]:
    q = "<image>\nDescribe the image in detail."
    single = [
        "photo_640x480.png",
        "photo_1024x768.jpg",
        "scan_1700x2200_progressive.jpg",
        "exif_rotated_800x600.jpg",
        "anim_500x375.gif",
        "chart_200x150.bmp",
        "lossy_800x600.webp",
        "lossless_300x200.webp",
        "alpha_640x360.webp",
        "document_2480x3508.png",
        "icon_16x16.png",
    ]
    samples: list[object] = []
    for k, name in enumerate(single):  # 0..10
        samples.append(
            {"id": f"single-{k}", "image": name, "conversations": conv(q, text(10 + 7 * k, k))}
        )
    samples += [
        # 11: a list of one path is a single image (anyres)
        {"id": "list-of-one", "image": ["photo_640x480.png"], "conversations": conv(q, text(20))},
        # 12, 13: multi-image
        {
            "id": "multi-3",
            "image": ["photo_640x480.png", "photo_1024x768.jpg", "anim_500x375.gif"],
            "conversations": conv("<image>\n<image>\n<image>\nCompare the images.", text(60, 3)),
        },
        {
            "id": "multi-2",
            "image": ["lossy_800x600.webp", "chart_200x150.bmp"],
            "conversations": conv("<image> and <image>: what differs?", text(25, 5)),
        },
        # 14..16: videos
        {
            "id": "video-frames",
            "video": "clip_frames",
            "conversations": conv("<video>\nWhat happens?", text(30)),
        },
        {
            "id": "video-long",
            "video": "long_clip_frames",
            "conversations": conv("<video>\nSummarise.", text(40)),
        },
        {
            "id": "video-file-meta",
            "video": "clip.mp4",
            "num_frames": 120,
            "conversations": conv("<video>\nWhat happens?", text(15)),
        },
        # 17, 18: text only
        {"id": "text-1", "conversations": conv("What is the capital of France?", "Paris.")},
        {
            "id": "text-long",
            "conversations": conv(text(200), text(300, 1), text(50, 2), text(400, 3)),
        },
        # 19..21: size metadata takes precedence over the file / stands in for it
        {
            "id": "meta-size",
            "image": "photo_640x480.png",
            "image_size": [2000, 1000],
            "conversations": conv(q, text(12)),
        },
        {
            "id": "meta-wh-no-file",
            "image": "not_here.png",
            "width": 1280,
            "height": 720,
            "conversations": conv(q, text(12)),
        },
        {
            "id": "meta-multi",
            "image": ["a.png", "b.png"],
            "image_sizes": [[640, 480], {"width": 300, "height": 900}],
            "conversations": conv("<image><image> compare", text(12)),
        },
        # 22..27: unreadable / malformed
        {"id": "missing-file", "image": "missing.jpg", "conversations": conv(q, text(5))},
        {"id": "no-conversations", "image": "photo_640x480.png"},
        {"id": "bad-turn", "conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
        {"id": "corrupt-image", "image": "corrupt.png", "conversations": conv(q, text(5))},
        {"id": "video-file-no-meta", "video": "clip.mp4", "conversations": conv("<video>", "x")},
        {"id": "bad-image-field", "image": 42, "conversations": conv(q, "x")},
    ]
    skipped = {
        22: "missing_image",
        23: "missing_conversations",
        24: "bad_conversations",
        25: "unreadable_image",
        26: "video_without_frame_count",
        27: "bad_image_field",
    }
    return samples, skipped


def jsonl_lines() -> tuple[list[str], dict[int, str]]:
    q = "<image>\nWhat is shown?"
    rows: list[str] = [
        json.dumps({"id": "l-text", "conversations": conv("Hello?", text(8))}),
        json.dumps(
            {"id": "l-jpg", "image": "photo_1024x768.jpg", "conversations": conv(q, text(30))}
        ),
        '{"id": "l-broken", "image": "photo_640x480.png", "conversations": [',  # invalid JSON
        json.dumps(
            {
                "id": "l-multi",
                "image": ["icon_16x16.png", "document_2480x3508.png"],
                "conversations": conv("<image><image>", text(9)),
            }
        ),
        json.dumps(
            {"id": "l-video", "video": "clip_frames", "conversations": conv("<video>", text(14))}
        ),
        json.dumps([1, 2, 3]),  # not an object
        json.dumps(
            {"id": "l-webp", "image": "lossless_300x200.webp", "conversations": conv(q, text(7))}
        ),
        json.dumps({"id": "l-text-2", "conversations": conv(text(40), text(80))}),
        json.dumps(
            {"id": "l-empty-frames", "video": "empty_frames", "conversations": conv("<video>", "x")}
        ),
        json.dumps(
            {
                "id": "l-both",
                "image": "photo_640x480.png",
                "video": "clip_frames",
                "conversations": conv("<image>", "x"),
            }
        ),
        json.dumps(
            {"id": "l-png", "image": "photo_640x480.png", "conversations": conv(q, text(11))}
        ),
        json.dumps({"id": "l-text-3", "conversations": conv("Thanks", "You are welcome.")}),
    ]
    # A blank line after sample 4 (not a sample: indices count non-blank lines).
    lines = rows[:5] + [""] + rows[5:]
    skipped = {
        2: "invalid_json",
        5: "not_an_object",
        8: "empty_frames_folder",
        9: "image_and_video",
    }
    return lines, skipped


RECIPE = """\
# A LLaVA-OneVision-style training recipe over the mini dataset (every strategy once).
image_folder: images
video_folder: videos
datasets:
  - json_path: llava_mini.json
    sampling_strategy: all
  - json_path: llava_mini.json
    sampling_strategy: "first:5"
  - json_path: llava_mini.jsonl
    sampling_strategy: first:50%   # ceil(12 * 0.5) = 6
  - json_path: llava_mini.json
    sampling_strategy: end:3
  - json_path: llava_mini.jsonl
    sampling_strategy: random:4
  - json_path: llava_mini.json
    sampling_strategy: random:25%  # ceil(28 * 0.25) = 7
"""


def main() -> None:
    if os.path.exists(ROOT):
        shutil.rmtree(ROOT)
    os.makedirs(ROOT)
    sizes = make_images()
    make_videos()
    samples, json_skipped = json_samples()
    with open(os.path.join(ROOT, "llava_mini.json"), "w") as f:
        json.dump(samples, f, indent=1)
        f.write("\n")
    lines, jsonl_skipped = jsonl_lines()
    with open(os.path.join(ROOT, "llava_mini.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(ROOT, "recipe.yaml"), "w") as f:
        f.write(RECIPE)
    expected = {
        "image_sizes_px": {k: list(v) for k, v in sorted(sizes.items())},
        "json_num_samples": len(samples),
        "jsonl_num_samples": len(lines) - 1,
        "json_skipped": {str(k): v for k, v in json_skipped.items()},
        "jsonl_skipped": {str(k): v for k, v in jsonl_skipped.items()},
    }
    with open(os.path.join(ROOT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(ROOT) for n in names)
    print(f"wrote {ROOT} ({total / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
