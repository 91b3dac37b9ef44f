"""Embedded synthetic workload: realistic sample shapes with no dataset at hand.

:func:`synthetic_shapes` draws raw sample descriptors (image sizes, image counts, video
lengths, text lengths) that mirror the LLaVA-OneVision training mix, then turns them into
shapes with the chosen model family's rules (:func:`dflop.data.families.shapes_from_descriptors`,
the same code path the data profiler uses). It is deterministic for a seed
(``numpy.random.Generator``/PCG64), and the draws do not depend on the family, so the
same seed gives the same samples under ``"llava-ov"`` and ``"internvl"``.

Data mix (defaults of :class:`MixSpec`, fractions of samples)
-------------------------------------------------------------
LLaVA-OneVision trains on ~3.2M single-image samples (with some text-only instruction
data) followed by ~1.6M "OneVision" samples (single-image, multi-image and video). Over
the whole recipe, approximately:

==============  ========  ===============================================================
modality        fraction  shape of the raw descriptors
==============  ========  ===============================================================
single image    0.65      one image of one of the kinds below
multi image     0.10      ``2 + Geometric(0.45) - 1`` images (mean ~3.2), capped at 12;
                          image sizes as for photos
video           0.13      duration ~ LogNormal(median 45 s, sigma 0.9), clipped to
                          [4 s, 600 s], one frame per second (frame cap applied by the
                          family: 32, so ~65% of videos hit the cap)
text only       0.12      no visual input
==============  ========  ===============================================================

Single-image kinds (fraction of single-image samples):

==================  ========  =========================================================
kind                fraction  size
==================  ========  =========================================================
photo               0.40      long side 640 px (55%, COCO-like), 500 (10%), 1024 (10%)
                              or ~ LogNormal(median 800, sigma 0.35) clipped to
                              [256, 1600] (25%); aspect 4:3 (50%), 3:2 (15%), 16:9 (20%),
                              1:1 (15%); 30% portrait
high-res photo      0.10      long side ~ Uniform[1600, 4032]; aspect 4:3 (50%), 16:9
                              (30%), 1:1 (20%); 30% portrait
screenshot          0.15      desktop 1920x1080, 1280x720, 2560x1440, 1366x768,
                              1440x900, 1024x768 and phone 1080x2340, 1170x2532,
                              750x1334
document            0.20      width ~ LogNormal(median 1240 px, sigma 0.3) clipped to
                              [600, 2600]; height/width 1.414 (A4, 50%), 1.294 (letter,
                              30%) or ~ Uniform[2, 4] (long pages, receipts: 20%)
chart / diagram     0.15      long side ~ Uniform[300, 900]; aspect ~ Uniform[0.6, 1.8]
==================  ========  =========================================================

Text tokens (conversation, prompt + answers) are heavy-tailed: LogNormal bodies with
medians of 150 (single image), 200 (multi image), 120 (video) and 350 (text only) tokens
and sigma 1.0 / 0.9 / 0.8 / 1.2; 5% of samples are long multi-turn conversations drawn
from LogNormal(median 2,000, sigma 0.7). All are clipped to [8, 8,192] tokens. The
answers' share of a sample's text (its target tokens) is Beta(2.5, 2) (mean 0.56), drawn
from a stream of its own (``(seed, 1)``), so the other fields do not depend on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import numpy as np

from dflop.data.families import FamilySpec, get_family, shapes_from_descriptors
from dflop.data.shapes import Modality, SampleShapes
from dflop.errors import InputTypeError, bounded_repr

__all__ = ["MixSpec", "synthetic_shapes"]

TEXT_TOKENS_MIN = 8
TEXT_TOKENS_MAX = 8192
LONG_TEXT_FRACTION = 0.05
MAX_IMAGES_PER_SAMPLE = 12
VIDEO_SAMPLING_FPS = 1.0

# (median tokens, sigma) of the text-length body, by Modality code.
_TEXT_BODY = {
    Modality.TEXT: (350.0, 1.2),
    Modality.IMAGE: (150.0, 1.0),
    Modality.MULTI_IMAGE: (200.0, 0.9),
    Modality.VIDEO: (120.0, 0.8),
}
_LONG_TEXT = (2000.0, 0.7)

# Long side of ordinary photos: 640 (COCO and most web crawls), 500, 1024, or other.
_PHOTO_LONG_SIDE_FRACTIONS = (0.55, 0.10, 0.10, 0.25)
_IMAGE_KIND_FRACTIONS = (0.40, 0.10, 0.15, 0.20, 0.15)  # photo, hi-res, screen, doc, chart
_SCREENS = np.array(
    [
        (1920, 1080),
        (1280, 720),
        (2560, 1440),
        (1366, 768),
        (1440, 900),
        (1024, 768),
        (1080, 2340),
        (1170, 2532),
        (750, 1334),
    ],
    dtype=np.float64,
)
_SCREEN_WEIGHTS = np.array([0.30, 0.12, 0.08, 0.08, 0.07, 0.05, 0.12, 0.10, 0.08])


@dataclass(frozen=True)
class MixSpec:
    """Fractions of samples per modality; non-negative, summing to 1.

    Attributes:
        single_image: one image per sample (default 0.65).
        multi_image: several images per sample, one tile each in LLaVA-OneVision (0.10).
        video: one video per sample (0.13).
        text: text-only samples (0.12).
    """

    single_image: float = 0.65
    multi_image: float = 0.10
    video: float = 0.13
    text: float = 0.12

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise InputTypeError(f"MixSpec.{f.name}={value!r} must be a number")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"MixSpec.{f.name}={value!r} must be finite and >= 0")
        total = sum(getattr(self, f.name) for f in fields(self))
        if abs(total - 1.0) > 1e-6:
            names = ", ".join(f.name for f in fields(self))
            raise ValueError(f"MixSpec fractions ({names}) sum to {total:.6g}; they must sum to 1")

    @classmethod
    def from_mapping(cls, mix: Mapping[str, float]) -> MixSpec:
        """A MixSpec from ``{"single_image": .., ...}``; missing keys keep their defaults."""
        if not isinstance(mix, Mapping):  # a string would be read letter by letter
            raise InputTypeError(
                f"mix must map modalities to fractions, got {type(mix).__name__} "
                f"{bounded_repr(mix)}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(mix) - known))
        if unknown:
            raise ValueError(
                f"mix has unknown field(s) {', '.join(map(bounded_repr, unknown))}; known: "
                f"{', '.join(sorted(known))}"
            )
        return cls(**dict(mix))

    def probabilities(self) -> np.ndarray:
        """(4,) float64 probabilities indexed by :class:`Modality` code."""
        p = np.zeros(4)
        p[Modality.TEXT] = self.text
        p[Modality.IMAGE] = self.single_image
        p[Modality.MULTI_IMAGE] = self.multi_image
        p[Modality.VIDEO] = self.video
        return p / p.sum()

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size: int) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(size))


def _photo_sizes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    common = rng.choice(np.array([640.0, 500.0, 1024.0, 0.0]), size=n, p=_PHOTO_LONG_SIDE_FRACTIONS)
    other = np.round(np.clip(_lognormal(rng, 800.0, 0.35, n), 256.0, 1600.0))
    long_side = np.where(common > 0, common, other)
    aspect = rng.choice(np.array([4 / 3, 3 / 2, 16 / 9, 1.0]), size=n, p=[0.5, 0.15, 0.2, 0.15])
    portrait = rng.random(n) < 0.3
    return _orient(long_side, aspect, portrait)


def _orient(
    long_side: np.ndarray, aspect: np.ndarray, portrait: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    short_side = np.maximum(np.round(long_side / aspect), 1.0)
    long_side = np.round(long_side)
    width = np.where(portrait, short_side, long_side)
    height = np.where(portrait, long_side, short_side)
    return width, height


def _single_image_sizes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    kind = rng.choice(5, size=n, p=_IMAGE_KIND_FRACTIONS)
    num = np.bincount(kind, minlength=5)
    width = np.empty(n)
    height = np.empty(n)

    def put(k: int, wk: np.ndarray, hk: np.ndarray) -> None:
        sel = kind == k
        width[sel] = wk
        height[sel] = hk

    put(0, *_photo_sizes(rng, num[0]))
    hi_long = rng.uniform(1600.0, 4032.0, num[1])
    hi_aspect = rng.choice(np.array([4 / 3, 16 / 9, 1.0]), size=num[1], p=[0.5, 0.3, 0.2])
    put(1, *_orient(hi_long, hi_aspect, rng.random(num[1]) < 0.3))
    screen = _SCREENS[rng.choice(len(_SCREENS), size=num[2], p=_SCREEN_WEIGHTS)]
    put(2, screen[:, 0], screen[:, 1])
    doc_w = np.round(np.clip(_lognormal(rng, 1240.0, 0.3, num[3]), 600.0, 2600.0))
    doc_kind = rng.random(num[3])
    long_page = rng.uniform(2.0, 4.0, num[3])
    doc_ratio = np.where(doc_kind < 0.5, 1.414, np.where(doc_kind < 0.8, 1.294, long_page))
    put(3, doc_w, np.round(doc_w * doc_ratio))
    chart_long = rng.uniform(300.0, 900.0, num[4])
    chart_aspect = rng.uniform(0.6, 1.8, num[4])
    put(4, *_orient(chart_long, np.maximum(chart_aspect, 1 / chart_aspect), chart_aspect < 1))
    return width, height


_TEXT_MEDIAN = np.array([_TEXT_BODY[m][0] for m in range(4)])
_TEXT_SIGMA = np.array([_TEXT_BODY[m][1] for m in range(4)])


def _text_tokens(rng: np.random.Generator, modality: np.ndarray) -> np.ndarray:
    n = modality.shape[0]
    tokens = _TEXT_MEDIAN[modality] * np.exp(_TEXT_SIGMA[modality] * rng.standard_normal(n))
    long = np.flatnonzero(rng.random(n) < LONG_TEXT_FRACTION)
    tokens[long] = _lognormal(rng, *_LONG_TEXT, long.size)
    return np.clip(np.round(tokens), TEXT_TOKENS_MIN, TEXT_TOKENS_MAX).astype(np.int64)


def _target_tokens(seed: int, text: np.ndarray) -> np.ndarray:
    """The answers' tokens: a Beta(2.5, 2) share of the text, at least 1, leaving >= 1."""
    share = np.random.default_rng([seed, 1]).beta(2.5, 2.0, size=text.shape[0])
    return np.clip(np.round(share * text), 1, text - 1).astype(np.int64)


def synthetic_shapes(
    num_samples: int,
    seed: int = 0,
    family: str | FamilySpec = "llava-ov",
    mix: MixSpec | Mapping[str, float] | None = None,
) -> SampleShapes:
    """Draw ``num_samples`` sample shapes mirroring the LLaVA-OneVision data mix.

    Args:
        num_samples: number of samples (>= 0).
        seed: seed of the ``numpy.random.Generator``; equal seeds give equal shapes.
        family: model family whose shape rules apply (``"llava-ov"``, ``"internvl"`` or a
            :class:`~dflop.data.families.FamilySpec`).
        mix: modality proportions (a :class:`MixSpec` or a mapping of its fields);
            defaults to ``MixSpec()`` (see the module docstring).

    Returns:
        :class:`~dflop.data.shapes.SampleShapes` of length ``num_samples``.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)):
        raise InputTypeError(f"num_samples must be an int, got {type(num_samples).__name__}")
    if num_samples < 0:
        raise ValueError(f"num_samples={num_samples} must be >= 0")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InputTypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    spec = get_family(family)
    if mix is None:
        mix_spec = MixSpec()
    elif isinstance(mix, MixSpec):
        mix_spec = mix
    elif isinstance(mix, Mapping):
        mix_spec = MixSpec.from_mapping(mix)
    else:
        raise InputTypeError(f"mix must be a MixSpec, a mapping or None, got {type(mix).__name__}")

    n = int(num_samples)
    rng = np.random.default_rng(int(seed))
    modality = rng.choice(4, size=n, p=mix_spec.probabilities()).astype(np.int8)

    single = np.flatnonzero(modality == Modality.IMAGE)
    multi = np.flatnonzero(modality == Modality.MULTI_IMAGE)
    s_w, s_h = _single_image_sizes(rng, single.size)
    count = np.minimum(1 + rng.geometric(0.45, size=multi.size), MAX_IMAGES_PER_SAMPLE)
    m_idx = np.repeat(multi, count)
    m_w, m_h = _photo_sizes(rng, m_idx.size)
    # Ragged image layout: any order works (each image names its sample).
    image_sample_index = np.concatenate([single, m_idx])
    image_w = np.concatenate([s_w, m_w])
    image_h = np.concatenate([s_h, m_h])

    video = np.flatnonzero(modality == Modality.VIDEO)
    duration_s = np.clip(_lognormal(rng, 45.0, 0.9, video.size), 4.0, 600.0)
    video_frames = np.ones(n, dtype=np.int64)
    video_frames[video] = np.ceil(duration_s * VIDEO_SAMPLING_FPS)
    text = _text_tokens(rng, modality)

    return shapes_from_descriptors(
        spec,
        modality,
        text,
        image_sample_index=image_sample_index,
        image_width_px=image_w,
        image_height_px=image_h,
        video_num_frames=video_frames,
        target_tokens=_target_tokens(int(seed), text),
    )
