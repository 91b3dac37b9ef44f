"""Sample shapes, model-family shape rules, the embedded synthetic workload and costs.

- :mod:`dflop.data.shapes`: :class:`SampleShapes` (columnar per-sample shapes),
  :class:`Modality` codes.
- :mod:`dflop.data.families`: the shape rules of each model family as data
  (:class:`FamilySpec`, :func:`get_family`) and the functions applying them.
- :mod:`dflop.data.synthetic`: :func:`synthetic_shapes`, a seeded generator mirroring the
  LLaVA-OneVision data mix (:class:`MixSpec`).
- :mod:`dflop.data.costs`: :class:`AnalyticCostModel`, FLOP-based per-sample costs with
  encoder/LLM presets, and :func:`synthetic_costs`.
- :mod:`dflop.data.profiler`: :func:`profile_dataset`, LLaVA-family JSON/JSONL/YAML
  datasets -> :class:`ShapeDistribution` (:mod:`dflop.data.distribution`), reading
  datasets with :mod:`dflop.data.dataset`, image sizes with
  :mod:`dflop.data.image_header` and text tokens with :mod:`dflop.data.text_tokens`.
- :mod:`dflop.data.reader`: :class:`DatasetReader`, the one walk over a dataset's records
  (description, skip accounting) that the profiler and :func:`read_records` (the records
  a training run draws from) share.
- :mod:`dflop.data.describe`: one record -> its raw descriptors (``describe_sample``,
  ``SampleDescriptor``, ``SampleError`` and its ``REASONS``, ``ImageSizeCache``), what the
  reader, the profiler and the training data read of a sample.
"""

from dflop.data.costs import (
    ENCODER_PRESETS,
    LLM_PRESETS,
    AnalyticCostModel,
    EncoderConfig,
    LLMConfig,
    SampleCostModel,
    synthetic_costs,
)
from dflop.data.dataset import DatasetError, iter_samples, parse_sampling_strategy, read_recipe
from dflop.data.distribution import ShapeDistribution
from dflop.data.families import FamilySpec, get_family, shapes_from_descriptors
from dflop.data.image_header import ImageHeaderError, read_image_header, read_image_size
from dflop.data.profiler import DataProfile, profile_dataset
from dflop.data.reader import DatasetReader, RecordSet, read_records
from dflop.data.shapes import Modality, SampleShapes
from dflop.data.synthetic import MixSpec, synthetic_shapes
from dflop.data.text_tokens import TextTokenCounter, make_text_counter

__all__ = [
    "ENCODER_PRESETS",
    "LLM_PRESETS",
    "AnalyticCostModel",
    "DataProfile",
    "DatasetError",
    "DatasetReader",
    "EncoderConfig",
    "FamilySpec",
    "ImageHeaderError",
    "LLMConfig",
    "MixSpec",
    "Modality",
    "RecordSet",
    "SampleCostModel",
    "SampleShapes",
    "ShapeDistribution",
    "TextTokenCounter",
    "get_family",
    "iter_samples",
    "make_text_counter",
    "parse_sampling_strategy",
    "profile_dataset",
    "read_image_header",
    "read_image_size",
    "read_recipe",
    "read_records",
    "shapes_from_descriptors",
    "synthetic_costs",
    "synthetic_shapes",
]
